"""One trainer per run directory: an exclusive lock on ``<output_dir>/trainer.lock``.

A second trainer on the same directory would delete the first one's in-progress save as
debris, interleave ``metrics.jsonl`` rows and prune the other's checkpoints. Global rank 0
takes the lock before anything else is written to the directory (the trainer broadcasts the
outcome, so every rank of a refused job exits 2 with one line naming the holder).

Mechanism: a POSIX record lock (``fcntl.lockf``, i.e. ``fcntl(F_SETLK)``) on the lock file,
held for the whole run; the kernel (or the file server) releases it when the process dies,
however it dies. The file itself holds the holder's host, PID, Slurm job id and start time
(JSON), refreshed every :data:`HEARTBEAT_S` seconds, and is removed on a clean exit, while
still locked. A process that opened the file just before (it waited on the holder's lock)
then holds a lock on a removed file; so :meth:`RunLock.acquire` checks, once it has the lock,
that the path still names the file it locked, and opens the path again when not. A run that
did not exit cleanly (SIGKILL, node failure) leaves the file with its record.

* Busy (another process holds the lock): :class:`RunLockError` naming the holder; a requeued
  Slurm job whose previous incarnation still holds it (same ``SLURM_JOB_ID``; a file server
  keeps a dead client's lock until its lease expires) waits up to ``own_wait_s`` for it.
* Free but the file names a holder: that process died without a clean exit (SIGKILL, node
  failure). Taken over with one line, unless the record is from another host and was
  refreshed less than :data:`STALE_AFTER_S` ago (a file system whose locks are node-local,
  e.g. Lustre mounted with ``localflock``, cannot see a holder on another node; the
  heartbeat can), which is refused like a busy lock unless it is the same Slurm job.
* A file system without locks (``ENOLCK``/``EOPNOTSUPP``): one warning, then the heartbeat
  record alone decides (a same-host holder is checked by PID).

File systems (docs/stability.md): local disks (ext4, xfs, btrfs, tmpfs) and NFSv3 (NLM) /
NFSv4 honour ``lockf`` across processes and clients; Lustre only when mounted with ``flock``
(``localflock``: node-local only, the heartbeat covers other nodes); GPFS/Spectrum Scale and
BeeGFS (``tuneUseGlobalFileLocks``) honour it cluster-wide.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from reco_megatron.utils.logging import get_logger

__all__ = ["LOCK_NAME", "RUN_MARKER", "Holder", "RunLock", "RunLockError"]

logger = get_logger(__name__)

LOCK_NAME = "trainer.lock"
RUN_MARKER = "run.json"
"""The run directory's marker (``run_dir``); a failed start in a new directory removes it."""
HEARTBEAT_S = 30.0
"""Seconds between refreshes of the lock file's modification time."""
STALE_AFTER_S = 3 * HEARTBEAT_S
"""A record from another host refreshed more recently than this counts as a live holder."""
_BUSY = (errno.EACCES, errno.EAGAIN)
_UNSUPPORTED = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


class RunLockError(RuntimeError):
    """Another trainer holds the run directory (exit status 2, one line)."""


@dataclass(frozen=True)
class Holder:
    """Who holds (or held) a run directory."""

    host: str
    pid: int
    slurm_job_id: str = ""
    started: str = ""

    @classmethod
    def me(cls) -> Holder:
        return cls(
            host=socket.gethostname(),
            pid=os.getpid(),
            slurm_job_id=os.environ.get("SLURM_JOB_ID", ""),
            started=time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        )

    @classmethod
    def parse(cls, text: str) -> Holder | None:
        try:
            data = json.loads(text)
            return cls(
                host=str(data["host"]),
                pid=int(data["pid"]),
                slurm_job_id=str(data.get("slurm_job_id", "")),
                started=str(data.get("started", "")),
            )
        except (ValueError, KeyError, TypeError):
            return None

    def describe(self) -> str:
        job = f", Slurm job {self.slurm_job_id}" if self.slurm_job_id else ""
        since = f", since {self.started}" if self.started else ""
        return f"PID {self.pid} on {self.host}{job}{since}"

    def same_job(self, other: Holder) -> bool:
        return bool(self.slurm_job_id) and self.slurm_job_id == other.slurm_job_id


class RunLock:
    """The lock of one run directory; :meth:`acquire` it, :meth:`release` it at the end."""

    def __init__(self, out_dir: str | Path, *, own_wait_s: float = 120.0) -> None:
        self.path = Path(out_dir) / LOCK_NAME
        self.own_wait_s = own_wait_s
        self.me = Holder.me()
        self._fd: int | None = None
        self.created = False
        """Whether :meth:`acquire` created the run directory (a failed start removes it)."""
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None

    # ------------------------------------------------------------------ acquire
    def acquire(self) -> RunLock:
        """Take the lock or raise :class:`RunLockError` (busy) / ``OSError`` (cannot write)."""
        self.created = not self.path.parent.exists()
        while True:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                kernel = self._lock(fd)
                if kernel and not self._linked(fd):  # its holder removed it: open it anew
                    os.close(fd)
                    continue
                self._check_record(fd, kernel)
                self._write_record(fd)
            except BaseException:
                os.close(fd)
                raise
            break
        self._fd = fd
        self._beat = threading.Thread(target=self._heartbeat, name="run-lock", daemon=True)
        self._beat.start()
        return self

    def _lock(self, fd: int) -> bool:
        """Take the kernel lock (waiting for our own job's previous incarnation); False when
        the file system has no locks."""
        deadline = None
        while True:
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return True
            except OSError as exc:
                if exc.errno in _UNSUPPORTED:
                    logger.warning(
                        "the file system of %s does not support file locks (%s): one trainer per "
                        "run directory is enforced by the lock file's heartbeat alone",
                        self.path,
                        exc.strerror,
                    )
                    return False
                if exc.errno not in _BUSY:
                    raise
            holder = _read_holder(fd)
            if holder is None or not holder.same_job(self.me):
                raise RunLockError(self._busy(holder))
            if deadline is None:
                deadline = time.monotonic() + self.own_wait_s
                logger.warning(
                    "%s is still held by this Slurm job's previous run (%s): waiting up to "
                    "%.0f s for it to be released",
                    self.path,
                    holder.describe(),
                    self.own_wait_s,
                )
            if time.monotonic() > deadline:
                raise RunLockError(self._busy(holder, waited=self.own_wait_s))
            time.sleep(1.0)

    def _linked(self, fd: int) -> bool:
        """Whether :attr:`path` still names the file open as ``fd``."""
        try:
            named = os.stat(self.path, follow_symlinks=False)
        except FileNotFoundError:
            return False
        held = os.fstat(fd)
        return (named.st_dev, named.st_ino) == (held.st_dev, held.st_ino)

    def _check_record(self, fd: int, kernel: bool) -> None:
        """The lock is ours (or there are no locks): is the record of a live holder?"""
        holder = _read_holder(fd)
        if holder is None or holder == self.me:
            return
        age = time.time() - os.fstat(fd).st_mtime
        if holder.same_job(self.me):
            alive = False  # a requeued job takes its own directory back
        elif holder.host == self.me.host:
            alive = not kernel and _pid_alive(holder.pid)
        else:
            alive = age < STALE_AFTER_S
        if alive:
            raise RunLockError(self._busy(holder, refreshed=age))
        logger.warning(
            "taking over %s from %s, which did not exit cleanly (%s)",
            self.path.parent,
            holder.describe(),
            "this Slurm job's previous run"
            if holder.same_job(self.me)
            else f"record last refreshed {age:.0f} s ago",
        )

    def _busy(self, holder: Holder | None, *, waited: float = 0, refreshed: float = -1) -> str:
        who = holder.describe() if holder else "another process (no record in the lock file)"
        extra = f" (waited {waited:.0f} s for this job's previous run)" if waited else ""
        if refreshed >= 0:
            extra = (
                f" (its record was refreshed {refreshed:.0f} s ago; if it is gone, delete "
                f"{self.path} or wait {STALE_AFTER_S:.0f} s)"
            )
        return (
            f"trainer.output_dir={str(self.path.parent)!r} is in use by {who}{extra}: one "
            "trainer per run directory. Wait for it to finish, stop it, or choose another "
            "trainer.output_dir"
        )

    def _write_record(self, fd: int) -> None:
        data = json.dumps(asdict(self.me)).encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, data + b"\n", 0)
        os.fsync(fd)

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            with contextlib.suppress(OSError):
                os.utime(self.path)

    # ------------------------------------------------------------------ release
    def release(self, *, failed_start: bool = False) -> None:
        """Remove the lock file while still holding it, then drop the lock (idempotent): a
        process waiting on it finds the path gone or new, and :meth:`acquire` takes the lock
        of the file the path names. After a ``failed_start`` in a directory :meth:`acquire`
        created and nothing else wrote to, the directory goes too, as if the run had never
        started."""
        self._stop.set()
        if self._beat is not None and self._beat is not threading.current_thread():
            self._beat.join(timeout=5.0)  # no refresh of a file of the same name after this
        fd, self._fd = self._fd, None
        if fd is None:
            return
        out = self.path.parent
        names = {p.name for p in out.iterdir()}
        unused = failed_start and self.created and names <= {LOCK_NAME, RUN_MARKER}
        with contextlib.suppress(OSError):
            if unused:
                (out / RUN_MARKER).unlink(missing_ok=True)
            if self._linked(fd):  # never another process's file of the same name
                self.path.unlink()  # while holding it: a waiter checks the link (acquire)
            else:
                os.ftruncate(fd, 0)
            if unused:
                out.rmdir()
        with contextlib.suppress(OSError):
            fcntl.lockf(fd, fcntl.LOCK_UN)
        os.close(fd)

    @property
    def held(self) -> bool:
        return self._fd is not None

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()


def _read_holder(fd: int) -> Holder | None:
    try:
        raw = os.pread(fd, 4096, 0)
    except OSError:
        return None
    return Holder.parse(raw.decode("utf-8", errors="replace")) if raw.strip() else None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
