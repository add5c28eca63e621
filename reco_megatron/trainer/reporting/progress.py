"""Progress while a person waits: a bar with a rate and an ETA, or lines when no bar fits.

:class:`StepProgress` counts steps of one phase (the SFT warm-up, the RL steps). Its rate and
ETA ignore the first step this process takes (it pays for compilation, allocator warm-up and
the first weight sync) and count only the steps of this process (a resumed run does not
divide by the time the earlier attempt took). A bar is drawn when stderr is a terminal at
least :data:`MIN_COLUMNS` wide; otherwise (a file, a Slurm log, a pipe, a 0-column pty) each
``every``-th step is one log line with the same numbers, so the output never goes silent.
Rank 0 only: other ranks make it with ``enabled=False``.
"""

from __future__ import annotations

import shutil
import sys
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, TextIO

from reco_megatron.utils.logging import get_logger

if TYPE_CHECKING:  # the config imports torch; this module stays light
    from reco_megatron.trainer.config import TrainConfig

logger = get_logger(__name__)

MIN_COLUMNS = 40
"""Narrower terminals get lines instead of a bar."""

BAR_VALUES = 3
"""Values shown on a bar (the first of ``shown``); a line shows them all."""


def can_draw_bar(stream: TextIO | None = None) -> bool:
    """Whether ``stream`` (stderr) is a terminal wide enough for a bar."""
    stream = stream or sys.stderr
    try:
        if not stream.isatty():
            return False
        columns = shutil.get_terminal_size(fallback=(0, 0)).columns
    except (AttributeError, ValueError, OSError):
        return False
    return columns >= MIN_COLUMNS


def format_seconds(seconds: float) -> str:
    """``75.3`` -> ``"1:15"``, ``3725`` -> ``"1:02:05"``, under 10 s with one decimal."""
    if seconds != seconds or seconds < 0:  # NaN
        return "?"
    if seconds < 10:
        return f"{seconds:.1f} s"
    whole = round(seconds)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


class StepProgress:
    """Progress of ``total`` steps starting at ``initial`` (a resumed run's step)."""

    def __init__(
        self,
        total: int,
        *,
        desc: str,
        initial: int = 0,
        enabled: bool = True,
        every: int = 1,
        bar: bool | None = None,
    ) -> None:
        self.total, self.desc, self.every = total, desc, max(1, every)
        self.bar_values = BAR_VALUES
        self.done = initial
        self.enabled = enabled and total > initial
        self._times: list[float] = []  # durations of this process's steps
        self._last = time.perf_counter()
        self._bar = None
        if self.enabled and (can_draw_bar() if bar is None else bar):
            from tqdm import tqdm

            self._bar = tqdm(
                total=total,
                initial=initial,
                desc=desc,
                unit="step",
                dynamic_ncols=True,
                bar_format="{desc} {n_fmt}/{total_fmt} |{bar}| {postfix}",
                file=sys.stderr,
            )

    def restart_clock(self) -> None:
        """The next step's time counts from now (work before it is not a step's)."""
        self._last = time.perf_counter()

    def seconds_per_step(self) -> float:
        """Mean duration of this process's steps after its first (NaN before the second;
        the first one's when it is the only one)."""
        steady = self._times[1:] or self._times
        return sum(steady) / len(steady) if steady else float("nan")

    def eta(self) -> float:
        """Seconds left at the current rate."""
        return self.seconds_per_step() * (self.total - self.done)

    def update(self, shown: Mapping[str, float] | None = None) -> None:
        """One step done; ``shown`` values go on the bar or line (``name=value``)."""
        now = time.perf_counter()
        self._times.append(now - self._last)
        self._last = now
        self.done += 1
        if not self.enabled:
            return
        shown = dict(shown or {})
        values = " ".join(f"{k}={v:.4g}" for k, v in shown.items())
        rate = self.seconds_per_step()
        timing = (
            f"{rate:.2f} s/step, ETA {format_seconds(self.eta())}" if rate == rate else "first step"
        )
        if self._bar is not None:
            brief = " ".join(f"{k}={v:.3g}" for k, v in list(shown.items())[: self.bar_values])
            self._bar.set_postfix_str(f"{brief}  {timing}".strip(), refresh=False)
            self._bar.update(1)
        elif len(self._times) == 1 and self.done < self.total:
            logger.info(
                "%s %d/%d %s (first step %s, includes warm-up)",
                self.desc,
                self.done,
                self.total,
                values,
                format_seconds(self._times[0]),
            )
        elif self.done % self.every == 0 or self.done == self.total:
            logger.info("%s %d/%d %s (%s)", self.desc, self.done, self.total, values, timing)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    @property
    def elapsed(self) -> float:
        """Seconds of this process's steps so far."""
        return sum(self._times)


def sft_progress(steps: int, rank0: bool, bar: bool, initial: int = 0) -> StepProgress:
    """The SFT warm-up's progress: a bar (``trainer.progress`` and a terminal) or a line every
    10 steps, on rank 0; ``initial``: the step a resumed warm-up continues after."""
    return StepProgress(
        steps, desc="sft", initial=initial, enabled=rank0, every=10, bar=None if bar else False
    )


def announce_startup(cfg: TrainConfig) -> None:
    """One line before the slow start-up work (process groups, model, optimizer, rollout
    engine, reward workers, data), so a person knows the run is alive."""
    sft = f"{cfg.sft.steps} SFT steps, then " if cfg.sft.steps else ""
    logger.info(
        "config OK: %s%d RL steps into %s; building process groups, model, rollout engine "
        "and reward workers",
        sft,
        cfg.trainer.max_steps,
        cfg.trainer.output_dir,
    )
