"""Per-step metrics: ``metrics.jsonl`` (one JSON object per step), TensorBoard, progress (a
bar, or lines where no bar can be drawn: :mod:`reco_megatron.trainer.reporting.progress`), and the
plots written at the end of a run (:mod:`reco_megatron.trainer.reporting.plots`). Rank 0 only."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from reco_megatron.trainer.reporting import loggers as loggers_mod
from reco_megatron.trainer.reporting.plots import plot_training_curves
from reco_megatron.trainer.reporting.progress import StepProgress
from reco_megatron.trainer.sections import missing
from reco_megatron.utils.logging import get_logger

logger = get_logger(__name__)

__all__ = ["KEY_METRICS", "MetricsWriter", "plot_training_curves", "read_metrics", "truncate_jsonl"]

KEY_METRICS = ("reward_mean", "unique_frac", "loss", "entropy_mean", "clip_frac", "grad_norm")


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None  # JSON has no NaN/inf
    return value


class MetricsWriter:
    """Appends one line per step to ``<output_dir>/metrics.jsonl`` and to the ``loggers``
    (TensorBoard, W&B, MLflow: :mod:`reco_megatron.trainer.reporting.loggers`); the progress counts
    from ``initial_step`` to ``total_steps``."""

    def __init__(
        self,
        output_dir: Path,
        total_steps: int,
        *,
        progress: bool,
        initial_step: int = 0,
        log_interval: int = 1,
        loggers: Sequence[str] = ("tensorboard",),
        project: str = "reco-megatron",
        run_config: Mapping[str, Any] | None = None,
    ):
        self.path = output_dir / "metrics.jsonl"
        self.output_dir = output_dir
        names = list(loggers)
        if "tensorboard" in names and missing(["tensorboard"]):
            logger.info("tensorboard is not installed: its logger is off (pip install tensorboard)")
            names.remove("tensorboard")
        self._loggers = loggers_mod.build_loggers(
            names, output_dir, project=project, config=run_config or {}
        )
        # progress=False: no bar, a line every log_interval steps (also where no bar fits)
        self._progress = StepProgress(
            total_steps,
            desc=loss_label((run_config or {}).get("loss", {})),
            initial=initial_step,
            every=log_interval,
            bar=None if progress else False,
        )

    def restart_clock(self) -> None:
        """The next step's time counts from now (after the SFT warm-up, not from start-up)."""
        self._progress.restart_clock()

    def write(self, row: dict[str, Any]) -> None:
        """Append ``row`` (must hold ``step``)."""
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps({k: _clean(v) for k, v in row.items()}, sort_keys=True) + "\n")
        step = int(row["step"])
        for tracker in self._loggers:
            tracker.log(row, step)
        self._progress.update(
            {k: float(row[k]) for k in KEY_METRICS if isinstance(row.get(k), int | float)}
        )

    def close(self) -> None:
        for tracker in self._loggers:
            tracker.close()
        self._progress.close()


def truncate_jsonl(path: Path, last_step: int) -> int:
    """Keep the rows of ``path`` with ``step <= last_step``; returns how many were dropped.

    A run resumed from the checkpoint of step S redoes the steps after S, so their rows from
    the interrupted attempt must go, or every such step would appear twice. The file is
    replaced atomically (temporary file, fsync, rename); the dropped lines are appended to
    ``<path>.discarded`` so nothing is lost. A line that is not JSON (the interrupted
    attempt's last write cut short) is dropped too.
    """
    if not path.exists():
        return 0
    keep, drop = [], []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        try:
            step = json.loads(line)["step"]
            (keep if isinstance(step, int) and step <= last_step else drop).append(line)
        except (json.JSONDecodeError, KeyError, TypeError):
            drop.append(line)
    if not drop:
        return 0
    with path.with_name(path.name + ".discarded").open("a", encoding="utf-8") as f:
        f.write("".join(line + "\n" for line in drop))
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as f:
        f.write("".join(line + "\n" for line in keep))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    logger.warning(
        "%s: dropped %d row(s) after step %d, written by a run stopped before its next "
        "checkpoint (kept in %s.discarded)",
        path,
        len(drop),
        last_step,
        path.name,
    )
    return len(drop)


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """All rows of a ``metrics.jsonl``."""
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


IDENTITY = (
    "objective",
    "advantage_mode",
    "response_weight",
    "token_ratio",
    "c_trust",
    "aggregation",
)
"""The ``loss.*`` keys that tell the methods apart (clip widths and KL are tuning)."""


def loss_label(loss: Mapping[str, Any]) -> str:
    """The name a run's steps are shown with: the first preset (``grpo``, ``reco``, ...) whose
    identity keys the ``loss`` section (plain) matches, else its ``objective``."""
    from dataclasses import fields

    from reco_megatron.algo import PRESETS, LossConfig

    defaults = {f.name: f.default for f in fields(LossConfig)}
    for name, preset in PRESETS.items():
        if all(loss.get(k) == preset.get(k, defaults[k]) for k in IDENTITY):
            return name
    return str(loss.get("objective", "rl"))
