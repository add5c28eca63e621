"""Helper processes that die with their parent and survive the job's stop signals.

Slurm signals every process of a job step (``scancel``, preemption: SIGTERM; ``--signal=USR1``
without ``B:``: SIGUSR1), and a terminal's Ctrl-C reaches the whole foreground process group.
The trainer turns SIGTERM/SIGUSR1 into "finish the step, checkpoint, exit 75", but a helper
process (a reward worker) with the default handlers would die on the same signal and take the
step with it. Helpers therefore ignore those signals and instead end when their parent ends:
:func:`die_with_parent` asks Linux to SIGKILL the helper when the parent dies
(``PR_SET_PDEATHSIG``), so a SIGKILLed trainer leaves no orphan behind.

``PR_SET_PDEATHSIG`` fires when the *thread* that started the helper exits; the trainer starts
its helpers from the main thread, whose exit is the process's. On other systems (macOS) the
call is a no-op that returns False; helpers then rely on their pipe to the parent closing.

No torch import here: reward workers use this before importing the reward function.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

__all__ = ["STOP_SIGNALS", "die_with_parent", "ignore_stop_signals"]

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>

STOP_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
"""Signals a job's processes receive together; the parent alone decides what they mean."""


def ignore_stop_signals() -> None:
    """Ignore :data:`STOP_SIGNALS` in this (helper) process."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


def die_with_parent(parent_pid: int, sig: int = signal.SIGKILL) -> bool:
    """Have the kernel send ``sig`` to this process when its parent dies (Linux).

    Args:
        parent_pid: the pid the parent had when it started us; if the parent is already gone
            (our parent pid differs), this process exits at once with status 1.
        sig: the signal delivered on the parent's death.
    Returns:
        True when the death signal is armed, False where the platform has no ``prctl``.
    """
    armed = False
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"prctl(PR_SET_PDEATHSIG) failed: {os.strerror(err)}")
        armed = True
    if os.getppid() != parent_pid:  # the parent died before the signal was armed
        os._exit(1)
    return armed
