"""One trainer per run directory: a second one is refused with one line naming the holder, a
dead holder's lock is taken over, a requeued Slurm job gets its own directory back.

Holders are real processes (POSIX locks belong to a process: a lock taken and tested in one
process would always succeed)."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from reco_megatron.trainer.lifecycle import run_lock
from reco_megatron.trainer.lifecycle.run_lock import LOCK_NAME, RunLock, RunLockError
from tests.tiny_overrides import TINY_RUN

ROOT = Path(__file__).resolve().parents[2]
HOLD = (
    "import sys, time; from reco_megatron.trainer.lifecycle.run_lock import RunLock; "
    "RunLock(sys.argv[1]).acquire(); print('held', flush=True); time.sleep(600)"
)


def _holder(out: Path, **env: str) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(out)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), **env},
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline().strip() == "held"
    return proc


def _kill(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)


def test_second_process_is_refused_then_takes_over_from_a_dead_holder(tmp_path, caplog) -> None:
    holder = _holder(tmp_path)
    try:
        with pytest.raises(RunLockError) as info:
            RunLock(tmp_path).acquire()
        message = str(info.value)
        assert f"PID {holder.pid} on {socket.gethostname()}" in message and "\n" not in message
        assert "choose another trainer.output_dir" in message
    finally:
        _kill(holder)  # SIGKILL: no clean exit, the record stays
    assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == holder.pid
    with caplog.at_level(logging.WARNING), RunLock(tmp_path) as lock:
        assert lock.held
        assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
    assert f"taking over {tmp_path} from PID {holder.pid}" in caplog.text
    assert not (tmp_path / LOCK_NAME).exists()  # a clean release removes the file


def test_a_clean_exit_removes_the_lock_file_and_a_waiter_locks_the_new_one(
    tmp_path, monkeypatch
) -> None:
    """The holder exits cleanly between another process's open and its lock: that process
    must not hold a lock on the removed file while a third locks a new file of the same name.
    (Fails with ``acquire``'s link check taken out: the waiter keeps the removed file.)"""
    first = RunLock(tmp_path).acquire()
    lock_file = tmp_path / LOCK_NAME
    assert lock_file.exists()
    take = RunLock._lock
    opened: list[int] = []

    def holder_exits_first(self: RunLock, fd: int) -> bool:
        if not opened:
            opened.append(os.fstat(fd).st_ino)
            first.release()  # a clean exit: the file goes while still locked
            assert not lock_file.exists()
        return take(self, fd)

    monkeypatch.setattr(RunLock, "_lock", holder_exits_first)
    second = RunLock(tmp_path).acquire()
    try:
        held = os.fstat(second._fd)
        assert held.st_nlink == 1  # a file the path names, not the removed one
        assert (held.st_dev, held.st_ino) == (lock_file.stat().st_dev, lock_file.stat().st_ino)
        assert json.loads(lock_file.read_text())["pid"] == os.getpid()
    finally:
        second.release()
    assert not lock_file.exists()


def test_a_requeued_slurm_job_waits_for_its_previous_run(tmp_path, monkeypatch) -> None:
    holder = _holder(tmp_path, SLURM_JOB_ID="4242")
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    try:
        with pytest.raises(RunLockError, match=r"Slurm job 4242.*waited 1 s"):
            RunLock(tmp_path, own_wait_s=1).acquire()
        killer = subprocess.Popen(["sh", "-c", f"sleep 1; kill -9 {holder.pid}"])
        start = time.monotonic()
        with RunLock(tmp_path, own_wait_s=60) as lock:
            assert lock.held and time.monotonic() - start < 30
        killer.wait(timeout=30)
    finally:
        if holder.poll() is None:
            _kill(holder)


def _fake_record(out: Path, host: str, age_s: float, job: str = "") -> None:
    out.mkdir(parents=True, exist_ok=True)
    record = {"host": host, "pid": 1, "slurm_job_id": job, "started": "earlier"}
    (out / LOCK_NAME).write_text(json.dumps(record))
    then = time.time() - age_s
    os.utime(out / LOCK_NAME, (then, then))


def test_a_fresh_record_from_another_host_counts_as_alive(tmp_path, monkeypatch) -> None:
    """On a file system whose locks are node-local (Lustre ``localflock``) the kernel lock is
    free although a trainer on another node holds the directory: its heartbeat says so."""
    _fake_record(tmp_path, "node-b", age_s=5)
    with pytest.raises(RunLockError, match=r"PID 1 on node-b.*refreshed 5 s ago"):
        RunLock(tmp_path).acquire()
    _fake_record(tmp_path, "node-b", age_s=5, job="77")
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    RunLock(tmp_path).acquire().release()  # our own job, requeued on another node
    monkeypatch.delenv("SLURM_JOB_ID")
    _fake_record(tmp_path, "node-b", age_s=run_lock.STALE_AFTER_S + 5)
    RunLock(tmp_path).acquire().release()  # no heartbeat for long: stale


def test_a_failed_start_leaves_no_directory_behind(tmp_path) -> None:
    out = tmp_path / "new" / "run"
    lock = RunLock(out).acquire()
    assert lock.created
    lock.release(failed_start=True)
    assert not out.exists()
    (out / "data").mkdir(parents=True)  # a directory with content stays
    lock = RunLock(out).acquire()
    lock.release(failed_start=True)
    assert sorted(p.name for p in out.iterdir()) == ["data"]


@pytest.mark.dist
def test_second_trainer_exits_2_and_deletes_nothing(tmp_path) -> None:
    """Before: the second trainer removed the first one's in-progress save as debris."""
    out = tmp_path / "run"
    partial = out / "checkpoints" / ".tmp-step_00000002" / "dist"
    partial.mkdir(parents=True)
    holder = _holder(out)
    try:
        args = [f"trainer.output_dir={out}", "sft.steps=0", "trainer.max_steps=1"]
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "reco_megatron.train",
                "examples/tiny_cpu.yaml",
                *TINY_RUN,
                *args,
            ],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        _kill(holder)
    assert done.returncode == 2, done.stderr[-3000:]
    line = next(x for x in done.stderr.splitlines() if x.startswith("reco-train:"))
    assert "output directory in use" in line and f"PID {holder.pid}" in line
    assert "Traceback" not in done.stderr
    assert partial.is_dir(), "the other trainer's in-progress save was removed"
    assert not (out / "metrics.jsonl").exists()
