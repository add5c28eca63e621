"""Reporting: what a run tells the person watching it, and what it leaves behind.

The global ``metrics.jsonl`` row of a step (:func:`global_row`), its writer with the trackers
and the progress bar (:class:`MetricsWriter`), reward-failure health, the training curves and
the end-of-run summary. The rest of the trainer imports the names below, never a module of
this folder.
"""

from reco_megatron.trainer.reporting.metrics_writer import (
    MetricsWriter,
    plot_training_curves,
    truncate_jsonl,
)
from reco_megatron.trainer.reporting.progress import announce_startup, sft_progress
from reco_megatron.trainer.reporting.reward_health import check_failures, failure_row, local_counts
from reco_megatron.trainer.reporting.run_report import RunReport
from reco_megatron.trainer.reporting.step_metrics import global_row, is_wall_clock, rollout_counters
from reco_megatron.trainer.reporting.summary import process_seconds, summary_lines

__all__ = [
    "MetricsWriter",
    "RunReport",
    "announce_startup",
    "check_failures",
    "failure_row",
    "global_row",
    "is_wall_clock",
    "local_counts",
    "plot_training_curves",
    "process_seconds",
    "rollout_counters",
    "sft_progress",
    "summary_lines",
    "truncate_jsonl",
]
