"""Nothing a reward function starts outlives its worker, the pool, or the trainer.

A reward is user code: it may fork, and a child that calls ``setsid`` leaves the worker's
process group and session, so neither killing the worker nor its group reaches it; on the
trainer's death it would run on with PPID 1 (on Slurm until the job's cgroup goes). Each
worker is therefore two processes::

    trainer --Popen(start_new_session)--> keeper --fork--> scorer (runs the reward)

* The **keeper** (``python -m reco_megatron.rewards._worker``) runs no user code. It is a
  *child subreaper* (``PR_SET_CHILD_SUBREAPER``): every process the scorer starts, at any
  depth and in any session, is re-parented to the keeper when its own parent exits, so the
  keeper's process subtree (``/proc/*/stat`` parent links) always holds all of them. It reaps
  them, and when the scorer exits (``None`` from the pool, a MemoryError, a crash) it
  SIGKILLs what is left of the subtree and exits with the scorer's status.
* The trainer's death (however it dies, SIGKILL included) sends the keeper
  :data:`END_SIGNAL` (``PR_SET_PDEATHSIG``); so does the pool to end a worker (close, a
  timeout, a replacement). On it the keeper SIGKILLs its whole subtree, reaps it and exits.
  The kernel delivers the signal when the trainer's main thread exits; the keeper is blocked
  in ``waitpid`` and runs no user code, so it acts at once: the subtree is gone within
  :data:`KILL_ROUNDS` scans of ``/proc`` (milliseconds each), well under a second on an idle
  machine. The pool falls back to SIGKILLing the keeper's process group after
  ``stop_timeout_s`` if the keeper itself is stuck.
* The **scorer** dies with the keeper (``PR_SET_PDEATHSIG`` = SIGKILL). Its stop signals
  (SIGTERM, SIGINT, SIGUSR1: Slurm sends them to every process of a step) are caught by a
  no-op handler rather than ignored, so programs a reward ``exec``s get the default actions
  back instead of inheriting "ignored".

Linux only (``prctl``); elsewhere the keeper still ends its scorer, but not grandchildren.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from multiprocessing.connection import Connection

from reco_megatron.utils.processes import STOP_SIGNALS, die_with_parent, ignore_stop_signals

__all__ = [
    "END_SIGNAL",
    "KILL_ROUNDS",
    "descendants",
    "keeper_main",
    "kill_subtree",
    "start_worker",
    "stop_worker",
]

END_SIGNAL = signal.SIGHUP
"""What tells a keeper to end its worker: the trainer's death, or the pool. A keeper is in its
own session, so no terminal sends it SIGHUP."""
KILL_ROUNDS = 200
"""Scans of ``/proc`` (kill what is found, reap, look again) before the keeper gives up on a
subtree that keeps forking; each round kills every process found in it."""
PR_SET_CHILD_SUBREAPER = 36  # <linux/prctl.h>


def _parents() -> dict[int, int]:
    """pid -> parent pid of every live (non-zombie) process, from ``/proc``."""
    parents = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue  # exited meanwhile
        fields = stat[stat.rfind(b")") + 2 :].split()  # the name may hold spaces and ')'
        if fields and fields[0] != b"Z":
            parents[int(entry)] = int(fields[1])
    return parents


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (children, their children, ...)."""
    children: dict[int, list[int]] = {}
    for child, parent in _parents().items():
        children.setdefault(parent, []).append(child)
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _reap() -> None:
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass


def kill_subtree(pid: int | None = None) -> int:
    """SIGKILL every process below ``pid`` (default: this process), round after round, until
    none is left (or :data:`KILL_ROUNDS`); returns how many were killed."""
    pid = os.getpid() if pid is None else pid
    killed = 0
    for _ in range(KILL_ROUNDS):
        found = descendants(pid)
        if not found:
            break
        for child in found:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(child, signal.SIGKILL)
                killed += 1
        if pid == os.getpid():
            _reap()
        time.sleep(0.001)
    return killed


def _become_subreaper() -> None:
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"prctl(PR_SET_CHILD_SUBREAPER) failed: {os.strerror(err)}")


def _end(*_: object) -> None:
    """The keeper's :data:`END_SIGNAL` handler: nothing below it survives, then exit."""
    kill_subtree()
    os._exit(0)


def _exit_like(status: int) -> None:
    """Exit with the scorer's wait ``status`` (a signal death is reproduced as one)."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig != signal.SIGKILL:  # SIGKILL takes no handler (EINVAL); it always kills
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 1)


def keeper_main(parent_pid: int, fd: int, scorer: Callable[[int], None]) -> None:
    """Run as the keeper: arm the death signal, fork ``scorer(fd)`` as the scorer, then
    reap until it exits; never returns."""
    ignore_stop_signals()
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # an inherited SIG_IGN reaps unseen
    signal.signal(END_SIGNAL, _end)
    _become_subreaper()
    die_with_parent(parent_pid, END_SIGNAL)
    me = os.getpid()
    pid = os.fork()
    if pid == 0:
        for sig in STOP_SIGNALS:  # caught, not ignored: exec'd programs get the defaults
            signal.signal(sig, lambda *_: None)
        signal.signal(END_SIGNAL, signal.SIG_DFL)
        die_with_parent(me)
        code = 1
        try:
            scorer(fd)
            code = 0
        except SystemExit as exc:  # a reward that calls sys.exit(3) ends with status 3
            code = exc.code if isinstance(exc.code, int) else 1
        finally:
            os._exit(code)
    os.close(fd)  # only the scorer holds the socket: its death reads as EOF in the pool
    while True:  # the scorer is a child until reaped here, so waitpid has one to wait for
        done, status = os.waitpid(-1, 0)
        if done == pid:
            break
    kill_subtree()
    _exit_like(status)


# ---------------------------------------------------------------- the pool's side
def start_worker(
    env: dict[str, str],
    first_message: object,
    module: str = "reco_megatron.rewards._worker",
) -> tuple[subprocess.Popen, Connection]:
    """Start a keeper (in a session of its own) with ``env``; send ``first_message`` to its
    scorer. ``module``: the worker's entry point (``python -m module FD PARENT_PID``; the
    environments' workers reuse this machinery). Returns the keeper's process and the pool's
    end of the socket."""
    parent_sock, child_sock = socket.socketpair()
    fd = child_sock.fileno()
    proc = subprocess.Popen(
        [sys.executable, "-m", module, str(fd), str(os.getpid())],
        pass_fds=(fd,),
        env=env,
        stdin=subprocess.DEVNULL,
        start_new_session=True,  # no terminal signal reaches it; its group is its own
    )
    child_sock.close()  # only the worker holds its end: its death reads as EOF here
    conn = Connection(parent_sock.detach())
    conn.send(first_message)
    return proc, conn


def stop_worker(proc: subprocess.Popen, conn: Connection, timeout_s: float = 5.0) -> None:
    """End a worker and everything its reward started: :data:`END_SIGNAL` to the keeper,
    then, if it is still there after ``timeout_s``, SIGKILL to its process group."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, END_SIGNAL)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):  # SIGKILL is not ignorable
                proc.wait(timeout=timeout_s)
    conn.close()
