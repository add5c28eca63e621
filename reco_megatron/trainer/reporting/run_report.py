"""What a run tells the person watching it, held in one object for the loop.

:class:`RunReport` owns the rows (``metrics.jsonl``, the trackers and the progress bar, on
rank 0), the seconds per phase the end-of-run summary reads, and the training curves drawn
when the run ends. A resumed run first drops the rows of steps after its checkpoint (they are
trained again), in ``metrics.jsonl`` and ``eval.jsonl``.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from reco_megatron.trainer.reporting.metrics_writer import (
    MetricsWriter,
    plot_training_curves,
    truncate_jsonl,
)

if TYPE_CHECKING:  # annotations only: the configuration imports no room
    from reco_megatron.trainer.config import TrainConfig


class RunReport:
    """Rows, phase times and curves of one run; writes only on global rank 0."""

    def __init__(
        self,
        cfg: TrainConfig,
        out: Path,
        *,
        step: int,
        rank: int,
        run_config: Mapping[str, Any],
        phases: dict[str, float],
    ) -> None:
        self.out = out
        self.phases = phases
        """Seconds per phase (``startup``, ``sft``, ``rl``), for the end-of-run summary."""
        self.writer: MetricsWriter | None = None
        if rank != 0:
            return
        for name in ("metrics.jsonl", "eval.jsonl"):  # rows after the resumed step are redone
            truncate_jsonl(out / name, step)
        t = cfg.trainer
        self.writer = MetricsWriter(
            out,
            t.max_steps,
            loggers=t.loggers,
            project=t.project,
            run_config=run_config,
            progress=t.progress and step < t.max_steps,
            initial_step=step,
            log_interval=t.log_interval,
        )

    def write(self, row: dict[str, Any]) -> None:
        """One step's row (rank 0; elsewhere nothing)."""
        if self.writer is not None:
            self.writer.write(row)

    def restart_clock(self) -> None:
        """The next step's time counts from now (called after the SFT warm-up)."""
        if self.writer is not None:
            self.writer.restart_clock()

    def draw_curves(self) -> None:
        """``training_curves.png`` from ``metrics.jsonl`` (rank 0, once the run ended)."""
        if self.writer is not None and (self.out / "metrics.jsonl").exists():
            plot_training_curves(self.out / "metrics.jsonl", self.out / "training_curves.png")

    def close(self) -> None:
        """Close the trackers and the progress bar (idempotent)."""
        if self.writer is not None:
            self.writer.close()
