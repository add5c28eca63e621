"""No process a reward starts outlives the pool, its worker, or the trainer
(``reco_megatron.rewards.containment``). The reward forks a child that calls ``setsid``
(so it leaves the worker's process group and session) and ignores SIGTERM.

The stated bound is "well under a second on an idle machine" (the keeper acts as soon as the
kernel signals it); the tests poll for up to 60 s so that a loaded CI machine cannot fail
them, and assert only that the child ends."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from reco_megatron.rewards.containment import descendants, kill_subtree
from reco_megatron.rewards.pool import RewardPool
from reco_megatron.rewards.pool_config import RewardPoolConfig

ROOT = Path(__file__).resolve().parents[2]
REWARD = "tests.rewards._helpers:forks_a_session"
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl is Linux")


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _ends(pid: int, within_s: float = 60.0) -> bool:
    deadline = time.monotonic() + within_s
    while _alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _pids(path: Path) -> list[int]:
    return [int(x) for x in path.read_text().split()]


def _pool(**kw: object) -> RewardPool:
    return RewardPool(RewardPoolConfig(reward=REWARD, num_workers=1, memory_limit_mb=None, **kw))


def test_close_ends_a_setsid_child(tmp_path) -> None:
    """Before: the child ran on with PPID 1 after close (and after the trainer exited 0)."""
    pids = tmp_path / "pids"
    pool = _pool()
    try:
        assert pool.score(["ok"], [str(pids)]).scores == [1.0]
        (child,) = _pids(pids)
        assert _alive(child) and os.getsid(child) == child  # its own session
    finally:
        pool.close()
    assert _ends(child), "a process the reward started outlived RewardPool.close()"


@pytest.mark.parametrize("how", ["crash", "hang"])
def test_a_crashed_or_timed_out_worker_takes_its_children(tmp_path, how) -> None:
    pids = tmp_path / "pids"
    with _pool(timeout_s=5.0) as pool:
        batch = pool.score([how], [str(pids)])
        assert batch.statuses == ["crash" if how == "crash" else "timeout"]
        (child,) = _pids(pids)
        assert _ends(child), f"the child of a worker that ended by {how} lived on"
        assert pool.score(["ok"], [str(pids)]).scores == [1.0]  # the replacement works


_TRAINER = textwrap.dedent(
    """
    import sys, time
    from reco_megatron.rewards.pool import RewardPool
    from reco_megatron.rewards.pool_config import RewardPoolConfig
    pool = RewardPool(RewardPoolConfig(reward=sys.argv[1], num_workers=2, memory_limit_mb=None))
    print(pool.score(["ok", "ok"], [sys.argv[2] + ".a", sys.argv[2] + ".b"]).scores, flush=True)
    time.sleep(3600)
    """
)


def test_children_die_with_a_sigkilled_trainer(tmp_path) -> None:
    """SIGKILL of the trainer: the kernel signals each keeper, which ends its subtree."""
    pids = tmp_path / "pids"
    trainer = subprocess.Popen(
        [sys.executable, "-c", _TRAINER, REWARD, str(pids)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert trainer.stdout.readline().strip() == "[1.0, 1.0]"
        children = [*_pids(Path(f"{pids}.a")), *_pids(Path(f"{pids}.b"))]
        keepers = [p.pid for p in psutil.Process(trainer.pid).children()]
        assert len(children) == 2 and all(_alive(c) for c in children)
    finally:
        trainer.kill()
        trainer.wait(timeout=30)
    for pid in [*children, *keepers]:
        assert _ends(pid), f"pid {pid} outlived its SIGKILLed trainer"


_CHAIN = textwrap.dedent(
    """
    import os, sys, time
    for _ in range(int(sys.argv[2])):  # each level forks the next and leaves its session
        if os.fork() != 0:
            break
        os.setsid()
        with open(sys.argv[1], "a") as f:
            f.write(f"{os.getpid()}\\n")
    time.sleep(3600)
    """
)


def test_kill_subtree_reaches_every_depth(tmp_path) -> None:
    """A chain four levels deep below ``proc``, each level in a session of its own: the scan
    finds all of them (not only the direct child) and the kill ends every one."""
    pids, depth = tmp_path / "pids", 4
    proc = subprocess.Popen([sys.executable, "-c", _CHAIN, str(pids), str(depth)])
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not (pids.exists() and len(_pids(pids)) == depth):
            time.sleep(0.05)
        chain = _pids(pids)
        assert len(chain) == depth
        assert sorted(descendants(proc.pid)) == sorted(chain)
        assert sorted(descendants(chain[1])) == sorted(chain[2:])  # from the middle too
        assert kill_subtree(proc.pid) >= depth
        for pid in chain:
            assert _ends(pid), f"pid {pid} ({chain.index(pid) + 1} levels down) outlived the kill"
        assert _alive(proc.pid)  # the root itself is not part of its subtree
    finally:
        for pid in _pids(pids) if pids.exists() else []:  # a failed kill leaves none behind
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.kill()
        proc.wait(timeout=30)


_NAMED = """
import ctypes, sys, time
ctypes.CDLL(None).prctl(15, sys.argv[1].encode(), 0, 0, 0)  # PR_SET_NAME: /proc/PID/stat's comm
print("ready", flush=True)
time.sleep(60)
"""


def test_the_scan_skips_zombies_and_reads_names_with_a_parenthesis() -> None:
    """An exited, unreaped child (state Z) is no process to kill; a live child whose name holds
    ``) Z 1 (`` is still found (the stat line is split after the *last* ``)``)."""
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])
    named = subprocess.Popen(
        [sys.executable, "-c", _NAMED, "a) Z 1 (b"], stdout=subprocess.PIPE, text=True
    )
    try:
        assert named.stdout is not None and named.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and psutil.Process(zombie.pid).status() != "zombie":
            time.sleep(0.02)
        assert psutil.Process(zombie.pid).status() == "zombie"
        assert psutil.Process(named.pid).name() == "a) Z 1 (b"
        found = descendants(os.getpid())
        assert zombie.pid not in found
        assert named.pid in found
    finally:
        named.kill()
        named.wait(timeout=30)
        zombie.wait(timeout=30)
