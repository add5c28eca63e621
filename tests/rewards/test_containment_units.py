"""The containment's steps one at a time, in this process (``reco_megatron.rewards.containment``).

``test_containment.py`` runs the whole keeper; its processes are other processes, so a
mutation tester that traces the test process sees none of their code. Here each step is
called directly, with the system calls it makes replaced by recorders where a real one would
end the test process (``os._exit``, a signal to itself) or could not be made to fail on
demand (a process that exits between the scan and the kill)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from reco_megatron.rewards import containment

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl is Linux")


class _Exited(Exception):
    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


def _no_exit(code: int) -> None:
    raise _Exited(code)


def _exit_like(monkeypatch, status: int) -> tuple[int, list, list]:
    handlers, kills = [], []
    monkeypatch.setattr(os, "_exit", _no_exit)
    monkeypatch.setattr(os, "kill", lambda pid, sig: kills.append((pid, sig)))
    monkeypatch.setattr(signal, "signal", lambda sig, handler: handlers.append((sig, handler)))
    with pytest.raises(_Exited) as exited:
        containment._exit_like(status)
    return exited.value.code, handlers, kills


def test_the_keeper_exits_with_its_scorers_status(monkeypatch) -> None:
    """An exit code is passed on; a signal death is reproduced (the default action restored,
    then the signal sent to itself), and exit 1 only if that signal did not kill."""
    assert _exit_like(monkeypatch, 3 << 8) == (3, [], [])
    assert _exit_like(monkeypatch, 0)[0] == 0
    code, handlers, kills = _exit_like(monkeypatch, signal.SIGTERM)
    assert (code, handlers) == (1, [(signal.SIGTERM, signal.SIG_DFL)])
    assert kills == [(os.getpid(), signal.SIGTERM)]
    code, handlers, kills = _exit_like(monkeypatch, signal.SIGKILL)
    assert (handlers, kills) == ([], [(os.getpid(), signal.SIGKILL)])  # SIGKILL takes none


_KEEPER = textwrap.dedent(
    """
    import os, signal
    from reco_megatron.rewards.containment import keeper_main
    def scorer(fd):
        os.kill(os.getpid(), signal.SIGKILL)  # as the OOM killer would
    keeper_main(os.getppid(), os.open(os.devnull, os.O_RDONLY), scorer)
    """
)


def test_a_sigkilled_scorer_is_a_sigkilled_keeper_without_a_traceback() -> None:
    """Before: ``signal.signal(SIGKILL, SIG_DFL)`` raised EINVAL in the keeper, which printed a
    traceback on the trainer's stderr and exited 1 (the pool logged "exit code 1")."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", _KEEPER], env=env, capture_output=True, text=True, timeout=60
    )
    assert (done.returncode, done.stderr) == (-signal.SIGKILL, "")
