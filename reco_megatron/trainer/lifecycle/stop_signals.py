"""Stop signals: SIGTERM, SIGUSR1 and SIGINT (Ctrl-C), in every phase of a run.

Slurm sends SIGTERM on preemption (and ``--signal=B:USR1@120`` SIGUSR1 before the time
limit); a person at a terminal presses Ctrl-C. The handlers are installed before the trainer
is built and stay installed until the process ends, so start-up, the SFT warm-up, RL steps,
evaluation, the stop checkpoint and shutdown all behave the same:

* **first signal** (any of the three): noted in one line; the run finishes the step it is in
  (an SFT step or an RL step), saves a checkpoint at that safe point (none when nothing was
  trained since the last one) and exits with :data:`EXIT_RESUMABLE` (75).
* **SIGTERM / SIGUSR1 again**: noted in one line; the checkpoint completes, exit 75.
* **SIGINT again** (a second Ctrl-C): stop at once. :class:`RunAborted` is raised wherever the
  run is; the partial checkpoint (if a save was under way) is removed, the previous complete
  checkpoint stays intact and is named, exit 75 (the run resumes from that checkpoint).

Every rank installs the handlers; the loop agrees on "stop" with an all-reduce at each safe
point, so all ranks save the same step.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Callable
from types import FrameType

from reco_megatron.utils.logging import get_logger

__all__ = [
    "EXIT_RESUMABLE",
    "RunAborted",
    "StopSignals",
    "report_abort",
    "stop_agreed",
    "stop_here",
]

logger = get_logger(__name__)

EXIT_RESUMABLE = 75
"""Exit status after a stop signal (EX_TEMPFAIL): run the same command again to resume."""


class RunAborted(BaseException):
    """A second SIGINT: stop at once, without a checkpoint (a BaseException, so that no
    ``except Exception`` on the way swallows it)."""


class StopSignals:
    """Records the first stop signal; a second SIGINT raises :class:`RunAborted`."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)

    def __init__(self) -> None:
        self.received: int | None = None
        self.saving = False
        """True from the start of the stop checkpoint (for the messages)."""
        self.saved = False
        """True once the stop checkpoint is complete (or none was needed)."""
        self._previous: dict[int, object] = {}

    @property
    def name(self) -> str:
        return signal.Signals(self.received).name if self.received is not None else ""

    def install(self) -> StopSignals:
        """Install the handlers; idempotent. Only the main thread can (a trainer built in
        another thread keeps the process's handlers)."""
        if threading.current_thread() is not threading.main_thread():
            return self
        for sig in self.SIGNALS:
            if sig not in self._previous:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def restore(self) -> None:
        """Put the previous handlers back (for callers that run a trainer in-process)."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.received is None:
            self.received = signum
            again = " (Ctrl-C again stops at once, without a checkpoint)"
            logger.warning(
                "received %s: finishing this step, then checkpoint and exit %d%s",
                name,
                EXIT_RESUMABLE,
                again if signum == signal.SIGINT else "",
            )
            return
        if signum == signal.SIGINT:
            raise RunAborted(name)
        if self.saved:
            state = "the checkpoint is complete, shutting down"
        elif self.saving:
            state = "the stop checkpoint is being written and completes"
        else:
            state = "already stopping at the end of this step"
        logger.warning("received %s again: %s, then exit %d", name, state, EXIT_RESUMABLE)


def stop_agreed(signals: StopSignals) -> bool:
    """Whether any rank received a stop signal (collective: every rank calls it at the same
    safe point and gets the same answer)."""
    import torch
    import torch.distributed as dist

    from reco_megatron.parallel.collectives import collective_device

    flag = torch.tensor([1.0 if signals.received is not None else 0.0])
    if dist.is_initialized():
        flag = flag.to(collective_device())
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item() > 0)


def stop_here(signals: StopSignals, *, step: int, save: Callable[[], None] | None) -> bool:
    """At a safe point of the loop, after RL step ``step``: when any rank got a stop signal,
    call ``save`` (None: nothing was trained since the last checkpoint) and say so
    (collective); the caller then exits with :data:`EXIT_RESUMABLE`."""
    if not stop_agreed(signals):
        return False
    signals.saving = True
    if save is not None:
        save()
    signals.saved = True
    logger.warning(
        "stopped by signal %s after step %d; %s, exit %d (resume by running the same command)",
        signals.name or "(on another rank)",
        step,
        "checkpoint saved" if save is not None else "nothing trained since the last checkpoint",
        EXIT_RESUMABLE,
    )
    return True


def report_abort(output_dir: str, rank: int) -> int:
    """After :class:`RunAborted`: remove the partial checkpoint a save left (rank 0), say in
    one line what is intact, and return :data:`EXIT_RESUMABLE`."""
    from pathlib import Path

    if rank != 0:
        return EXIT_RESUMABLE
    from reco_megatron.trainer.lifecycle.run_dir import clean_aborted_save, read_run_id

    try:
        run_id = read_run_id(output_dir) or ""
    except ValueError:
        run_id = None  # not a marked run: remove nothing
    removed, latest = clean_aborted_save(Path(output_dir) / "checkpoints", run_id)
    gone = f"removed the partial checkpoint {', '.join(removed)}; " if removed else ""
    kept = (
        f"the previous complete checkpoint {latest} is intact: run the same command to resume "
        "from it"
        if latest is not None
        else "there is no complete checkpoint yet: the same command starts over"
    )
    sys.stderr.write(f"reco-train: stopped at once by a second Ctrl-C: {gone}{kept}\n")
    return EXIT_RESUMABLE
