"""The containment's steps one at a time, in this process (``reco_megatron.rewards.containment``).

``test_containment.py`` runs the whole keeper; its processes are other processes, so a
mutation tester that traces the test process sees none of their code. Here each step is
called directly, with the system calls it makes replaced by recorders where a real one would
end the test process (``os._exit``, a signal to itself) or could not be made to fail on
demand (a process that exits between the scan and the kill)."""

from __future__ import annotations

import ctypes
import errno
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from reco_megatron.rewards import containment
from reco_megatron.rewards.containment import END_SIGNAL, KILL_ROUNDS, start_worker, stop_worker

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl is Linux")


class _Exited(Exception):
    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


def _no_exit(code: int) -> None:
    raise _Exited(code)


def _scripted_kill(monkeypatch, rounds: list[list[int]], fails: dict[int, type[OSError]]):
    """``descendants`` answers ``rounds`` in turn (then none); ``os.kill`` records each call
    and raises ``fails[pid]`` (once) for a pid that has gone or is not ours."""
    scans, kills, reaps, sleeps = [], [], [], []
    script = iter(rounds)

    def descendants(pid: int) -> list[int]:
        scans.append(pid)
        return next(script, [])

    def kill(pid: int, sig: int) -> None:
        kills.append((pid, sig))
        if pid in fails:
            raise fails.pop(pid)()

    monkeypatch.setattr(containment, "descendants", descendants)
    monkeypatch.setattr(containment, "_reap", lambda: reaps.append(True))
    monkeypatch.setattr(os, "kill", kill)
    monkeypatch.setattr(containment.time, "sleep", sleeps.append)
    return scans, kills, reaps, sleeps


def test_the_kill_counts_the_signals_delivered_and_rides_over_races(monkeypatch) -> None:
    """A process that exits between the scan and the kill (ProcessLookupError) or whose pid
    went to a process that is not ours (PermissionError) is skipped, not counted, and does
    not stop the kill; one still listed after its SIGKILL (not dead yet) is killed again."""
    gone, foreign = ProcessLookupError, PermissionError
    scans, kills, reaps, sleeps = _scripted_kill(
        monkeypatch, [[11, 12, 13], [11]], {12: gone, 13: foreign}
    )
    assert containment.kill_subtree(5) == 2  # 11 twice; 12 and 13 got no signal
    assert kills == [(pid, signal.SIGKILL) for pid in (11, 12, 13, 11)]
    assert scans == [5, 5, 5]  # the third scan finds none: done
    assert reaps == []  # another process's subtree: its zombies are not ours to reap
    assert sleeps and max(sleeps) <= 0.01  # rounds of milliseconds, as documented


def test_the_kill_defaults_to_its_own_subtree_and_reaps_it(monkeypatch) -> None:
    """``kill_subtree()`` is the keeper's: it scans below itself and reaps its own children
    after each round (they are its children, or re-parented to it as the subreaper)."""
    scans, _, reaps, _ = _scripted_kill(monkeypatch, [[21], [22]], {})
    assert containment.kill_subtree() == 2
    assert scans == [os.getpid()] * 3 and len(reaps) == 2


def test_a_subtree_that_keeps_forking_is_given_up_after_the_rounds(monkeypatch) -> None:
    scans, _, _, _ = _scripted_kill(monkeypatch, [[31]] * (KILL_ROUNDS + 5), {})
    assert containment.kill_subtree(5) == KILL_ROUNDS == len(scans)


def test_the_scan_goes_on_past_a_process_that_exits_during_it(monkeypatch) -> None:
    """A pid listed in /proc whose stat can no longer be read (it exited) hides nothing after
    it. 4194305 is above the kernel's largest pid_max, so it never exists."""
    entries = os.listdir("/proc")
    monkeypatch.setattr(os, "listdir", lambda path: ["4194305", *entries])
    assert os.getpid() in containment._parents()


def test_reap_collects_every_exited_child_and_returns(monkeypatch) -> None:
    """``_reap`` waits without blocking until no exited child is left (0: children live on,
    none exited; ChildProcessError: no children at all)."""
    for answers in ([(41, 0), (42, 9), (0, 0)], [(41, 0), ChildProcessError()]):
        script, calls = iter(answers), []

        def waitpid(pid: int, options: int, script=script, calls=calls) -> tuple[int, int]:
            calls.append((pid, options))
            answer = next(script)
            if isinstance(answer, BaseException):
                raise answer
            return answer

        monkeypatch.setattr(os, "waitpid", waitpid)
        containment._reap()
        assert calls == [(-1, os.WNOHANG)] * len(answers)


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


def test_the_end_signal_kills_the_keepers_own_subtree_and_exits_0(monkeypatch) -> None:
    calls = []
    monkeypatch.setattr(containment, "kill_subtree", lambda *a: calls.append(a))
    monkeypatch.setattr(os, "_exit", _no_exit)
    with pytest.raises(_Exited) as exited:
        containment._end(END_SIGNAL, None)
    assert (calls, exited.value.code) == ([()], 0)


def test_become_subreaper_makes_orphans_this_processs_children() -> None:
    """Checked with PR_GET_CHILD_SUBREAPER (37), then undone: the test process stays as it was."""
    libc = ctypes.CDLL(None, use_errno=True)
    before, after = ctypes.c_int(-1), ctypes.c_int(-1)
    assert libc.prctl(37, ctypes.byref(before), 0, 0, 0) == 0
    libc.prctl(containment.PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)
    try:
        containment._become_subreaper()
        assert libc.prctl(37, ctypes.byref(after), 0, 0, 0) == 0 and after.value == 1
    finally:
        libc.prctl(containment.PR_SET_CHILD_SUBREAPER, before.value, 0, 0, 0)


def test_a_worker_starts_in_its_own_session_with_only_the_given_env_and_no_stdin() -> None:
    """The keeper leads a session and group of its own (no terminal signal reaches it, and the
    pool's fallback kills that group only), gets exactly ``env`` (not the trainer's), and never
    reads the trainer's stdin: fd 0 here is made a pipe for the test, the worker's must be
    /dev/null."""
    env = {"PYTHONPATH": str(ROOT), "PROBE_MARK": "given"}
    os.environ["PROBE_TRAINER_ONLY"] = "1"
    saved, (r, w) = os.dup(0), os.pipe()
    os.dup2(r, 0)
    try:
        proc, conn = start_worker(env, "hello", module="tests.rewards._probe_worker")
    finally:
        os.dup2(saved, 0)
        for fd in (saved, r, w):
            os.close(fd)
        del os.environ["PROBE_TRAINER_ONLY"]
    try:
        assert conn.poll(30), "the probe worker did not answer"
        seen = conn.recv()
    finally:
        stop_worker(proc, conn)
    assert (seen["first_message"], seen["parent_pid"]) == ("hello", os.getpid())
    assert seen["session"] == seen["group"] == proc.pid
    assert seen["env"].get("PROBE_MARK") == "given" and "PROBE_TRAINER_ONLY" not in seen["env"]
    assert seen["stdin_is_devnull"]
    assert proc.returncode is not None and conn.closed


class _Proc:
    """A keeper as ``stop_worker`` sees it: ``waits`` answers each ``wait`` in turn (None: it
    exited; an exception: still running)."""

    def __init__(self, running: bool, waits: list) -> None:
        self.pid, self.running, self.waits, self.timeouts = 4194305, running, iter(waits), []

    def poll(self) -> int | None:
        return None if self.running else 0

    def wait(self, timeout: float) -> None:
        self.timeouts.append(timeout)
        answer = next(self.waits)
        if answer is not None:
            raise answer


class _Conn:
    closed = False

    def close(self) -> None:
        self.closed = True


def _stop(monkeypatch, proc: _Proc, kill_fails=None, killpg_fails=None, **kw) -> list:
    signals = []

    def sender(name, fails):
        def send(pid, sig):
            signals.append((name, pid, sig))
            if fails is not None:
                raise fails()

        return send

    monkeypatch.setattr(os, "kill", sender("kill", kill_fails))
    monkeypatch.setattr(os, "killpg", sender("killpg", killpg_fails))
    conn = _Conn()
    stop_worker(proc, conn, **kw)
    assert conn.closed  # always, whatever the keeper did
    return signals


def test_stop_worker_signals_the_keeper_then_kills_its_group_if_it_stays(monkeypatch) -> None:
    pid, stuck = 4194305, subprocess.TimeoutExpired("keeper", 1)
    assert _stop(monkeypatch, _Proc(False, [])) == []  # it had exited: nothing to signal
    proc = _Proc(True, [None])
    assert _stop(monkeypatch, proc) == [("kill", pid, END_SIGNAL)]
    assert proc.timeouts == [5.0]  # the documented default
    proc = _Proc(True, [stuck, None])
    assert _stop(monkeypatch, proc, timeout_s=0.5) == [
        ("kill", pid, END_SIGNAL),
        ("killpg", pid, signal.SIGKILL),
    ]
    assert proc.timeouts == [0.5, 0.5]
    # Races: the keeper exited between poll and kill; its group is gone (or, pid reused, not
    # ours) by the killpg; it is still not reaped after the second wait. None is an error.
    for gone in (ProcessLookupError, PermissionError):
        proc = _Proc(True, [stuck, stuck])
        sent = _stop(monkeypatch, proc, ProcessLookupError, gone, timeout_s=0.5)
        assert [s[0] for s in sent] == ["kill", "killpg"] and len(proc.timeouts) == 2


def _scorer_reports(fd: int, outcome: object, calls: list) -> None:
    """The scorer: write what it sees of its signals and its own calls (its copy of the
    recorder) to ``fd``, then end as ``outcome`` says."""
    seen = {
        "calls": calls,
        "stop_signals_caught": all(
            callable(signal.getsignal(s)) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
        ),
        "end_signal_default": signal.getsignal(END_SIGNAL) == signal.SIG_DFL,
    }
    os.write(fd, repr(seen).encode())
    os.close(fd)
    if isinstance(outcome, BaseException):
        raise outcome


@pytest.mark.parametrize(
    ("outcome", "status", "sigchld"),
    [
        (None, 0, signal.SIG_DFL),
        (SystemExit(3), 3 << 8, signal.SIG_DFL),
        (SystemExit(3), 3 << 8, signal.SIG_IGN),  # inherited: would reap the scorer unseen
        (SystemExit("bye"), 1 << 8, signal.SIG_DFL),
        (ValueError("x"), 1 << 8, signal.SIG_DFL),
    ],
)
def test_the_keeper_forks_the_scorer_waits_for_it_and_ends_its_subtree(
    monkeypatch, outcome, status, sigchld
) -> None:
    """``keeper_main`` in this process, its own exit, kill and waits recorded; the scorer is a
    real fork. The scorer catches the stop signals (not ignores them) and has END_SIGNAL's default;
    the keeper arms its own handler and the death signal, closes its copy of the scorer's fd,
    waits for the scorer, kills what is left below itself and exits with the scorer's status
    (``sys.exit(3)``: 3; another exit value or an exception: 1)."""
    me, real_exit, real_waitpid, calls = os.getpid(), os._exit, os.waitpid, []

    def exit_here(code: int) -> None:
        if os.getpid() != me:  # the forked scorer really exits, and never runs on as pytest
            try:
                real_exit(code)
            finally:
                real_exit(99)  # a code os._exit refuses
        raise _Exited(code)

    def waitpid(pid: int, options: int) -> tuple[int, int]:
        calls.append(("waitpid", pid, options))
        return real_waitpid(pid, options)

    monkeypatch.setattr(os, "_exit", exit_here)
    monkeypatch.setattr(containment, "ignore_stop_signals", lambda: calls.append("ignore"))
    monkeypatch.setattr(containment, "_become_subreaper", lambda: calls.append("subreaper"))
    monkeypatch.setattr(containment, "die_with_parent", lambda *a: calls.append(("pdeath", *a)))
    monkeypatch.setattr(containment, "kill_subtree", lambda *a: calls.append(("kill", *a)))
    monkeypatch.setattr(containment, "_exit_like", lambda st: calls.append(("exit", st)))
    monkeypatch.setattr(os, "waitpid", waitpid)
    handler, chld = signal.getsignal(END_SIGNAL), signal.signal(signal.SIGCHLD, sigchld)
    r, w = os.pipe()
    try:
        containment.keeper_main(4194305, w, lambda fd: _scorer_reports(fd, outcome, calls))
        assert signal.getsignal(END_SIGNAL) is containment._end
    finally:
        signal.signal(END_SIGNAL, handler)
        signal.signal(signal.SIGCHLD, chld)
    with pytest.raises(OSError):
        os.fstat(w)  # closed in the keeper: only the scorer held it
    with os.fdopen(r) as f:
        seen = f.read()
    armed = ["ignore", "subreaper", ("pdeath", 4194305, END_SIGNAL)]
    # the scorer dies with the keeper (this process): SIGKILL, die_with_parent's default
    scorer = {"calls": [*armed, ("pdeath", me)], "stop_signals_caught": True}
    assert seen == repr({**scorer, "end_signal_default": True})
    assert calls[:3] == armed
    # the keeper blocks in waitpid (options 0: no busy polling) until the scorer is reaped
    waits = calls[3:-2]
    assert waits and all(c[:3] == ("waitpid", -1, 0) for c in waits)
    assert calls[-2:] == [("kill",), ("exit", status)]


def test_a_refused_subreaper_call_is_an_oserror_naming_the_reason(monkeypatch) -> None:
    """A kernel that refuses the prctl (here a stand-in libc) stops the keeper with the errno
    and its text. The stand-in keeps ctypes' rule: the errno that ``ctypes.get_errno`` reads
    is the call's own only for a library loaded with ``use_errno=True``."""

    class _Libc:
        def __init__(self, use_errno: bool) -> None:
            self.use_errno = use_errno

        def prctl(self, *args: int) -> int:
            assert args == (containment.PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
            ctypes.set_errno(errno.EINVAL if self.use_errno else 0)
            return -1

    monkeypatch.setattr(ctypes, "CDLL", lambda name, use_errno=False: _Libc(use_errno))
    with pytest.raises(OSError) as refused:
        containment._become_subreaper()
    assert refused.value.errno == errno.EINVAL
    assert refused.value.strerror == (
        f"prctl(PR_SET_CHILD_SUBREAPER) failed: {os.strerror(errno.EINVAL)}"
    )
