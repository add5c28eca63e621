"""The run's life: its directory, its lock, what a resume changes, stop signals and guards.

One trainer per run directory (:func:`take_run_directory`, :class:`RunLock`), the config a
resume may change (:class:`ResumeCheck`), SIGTERM / SIGUSR1 / Ctrl-C in every phase
(:class:`StopSignals`), and the stability guards that skip a step or stop a run that is
diverging or dead. The rest of the trainer imports the names below, never a module of this
folder.
"""

from reco_megatron.trainer.lifecycle.config_history import CONFIG_HEADER, ResumeCheck
from reco_megatron.trainer.lifecycle.guards import (
    DeadRunGuard,
    NoSignalGuard,
    NoSignalStop,
    StabilityGuard,
    StabilityStop,
    unparsable_count,
)
from reco_megatron.trainer.lifecycle.run_dir import clean_aborted_save, take_run_directory
from reco_megatron.trainer.lifecycle.run_life import RunLife
from reco_megatron.trainer.lifecycle.run_lock import RunLock, RunLockError
from reco_megatron.trainer.lifecycle.stop_signals import (
    EXIT_RESUMABLE,
    RunAborted,
    StopSignals,
    report_abort,
    stop_agreed,
    stop_here,
)

__all__ = [
    "CONFIG_HEADER",
    "EXIT_RESUMABLE",
    "DeadRunGuard",
    "NoSignalGuard",
    "NoSignalStop",
    "ResumeCheck",
    "RunAborted",
    "RunLife",
    "RunLock",
    "RunLockError",
    "StabilityGuard",
    "StabilityStop",
    "StopSignals",
    "clean_aborted_save",
    "report_abort",
    "stop_agreed",
    "stop_here",
    "take_run_directory",
    "unparsable_count",
]
