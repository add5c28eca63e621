"""Every kind of reward failure is counted and logged once with an example; a worker never
outlives the process that started it and ignores the job's stop signals."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from reco_megatron.rewards.pool import RewardPool
from reco_megatron.rewards.pool_config import RewardPoolConfig
from reco_megatron.rewards.types import FAILURE_KINDS

H = "tests.rewards._helpers"
ROOT = Path(__file__).resolve().parents[2]

KINDS = ["raise", "nan", "none", "str", "memory", "hang", "die", "grader", "huge"]
"""Responses that make ``fails_by_command`` fail, one per kind of FAILURE_KINDS."""


def test_each_kind_is_counted_and_logged_once(caplog) -> None:
    cfg = RewardPoolConfig(
        reward=f"{H}:fails_by_command", num_workers=2, timeout_s=1.5, memory_limit_mb=1024
    )
    responses = [*KINDS, "inf", "a", *KINDS]  # twice each kind, and NaN's sibling -inf
    with RewardPool(cfg) as pool, caplog.at_level(logging.WARNING):
        batch = pool.score(responses, ["a"] * len(responses))
    statuses = dict(zip(responses, batch.statuses, strict=False))
    expected = ["error", "nan", "none", "invalid", "memory", "timeout", "crash"]
    expected += ["grader_timeout", "out_of_range"]
    assert [statuses[k] for k in KINDS] == expected
    assert statuses["inf"] == "nan" and statuses["a"] == "ok"
    n = len(KINDS)
    assert batch.scores == [0.0] * (n + 1) + [1.0] + [0.0] * n
    assert sorted(batch.statuses) == sorted([*expected, *expected, "nan", "ok"])
    assert batch.metrics["reward/grader_timeouts/sum"] == 2
    assert set(expected) == set(FAILURE_KINDS)  # the helper covers every kind
    for name in FAILURE_KINDS.values():
        logged = [r for r in caplog.records if f"failed ({name})" in r.getMessage()]
        assert len(logged) == 1, (name, [r.getMessage() for r in logged])
    text = caplog.text
    assert "KeyError" in text and "returned nan" in text and "returned None" in text
    assert "returned '1.0'" in text and "exit code 3" in text and "over 1.5 s" in text
    assert "returned 1e+39, beyond reward.max_abs_score=1e+06" in text


def test_numpy_scalars_are_numbers() -> None:
    """Before: ``numpy.True_`` was "not a number", so the start-up self-check refused the reward
    (a traceback in the trainer)."""
    cfg = RewardPoolConfig(reward=f"{H}:fails_by_command", num_workers=1, timeout_s=5)
    with RewardPool(cfg) as pool:
        batch = pool.score(["np_true"], ["a"])
    assert (batch.scores, batch.statuses) == ([1.0], ["ok"])


def test_grader_timeout_is_validated() -> None:
    with pytest.raises(ValueError, match="whole number of seconds"):
        RewardPoolConfig(grader_timeout_s=0)


def test_max_failed_frac_is_validated() -> None:
    for bad in (-0.1, 1.5, True, "half"):
        with pytest.raises(ValueError, match=r"reward.max_failed_frac=.* must be a share"):
            RewardPoolConfig(max_failed_frac=bad)  # type: ignore[arg-type]
    assert RewardPoolConfig(max_failed_frac=1).max_failed_frac == 1


_PARENT = textwrap.dedent(
    """
    import os, sys, threading
    from reco_megatron.rewards.pool import RewardPool
    from reco_megatron.rewards.pool_config import RewardPoolConfig
    pool = RewardPool(RewardPoolConfig(reward="tests.rewards._helpers:sleeps_on_sleep",
                                       num_workers=2, timeout_s=3600, memory_limit_mb=None))
    print(" ".join(str(w.proc.pid) for w in pool._workers), flush=True)
    pool.score(["sleep", "sleep"], ["a", "a"])   # both workers busy for an hour
    """
)


def _start_parent(**popen: object) -> tuple[subprocess.Popen, list[int]]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-c", _PARENT],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        text=True,
        **popen,
    )
    pids = [int(p) for p in proc.stdout.readline().split()]
    assert len(pids) == 2, "the parent did not start its pool"
    return proc, pids


def _alive(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            pass
    return alive


def test_busy_workers_die_with_a_sigkilled_parent() -> None:
    proc, workers = _start_parent()
    time.sleep(1.0)  # the items are in flight: the workers sleep inside the reward function
    proc.kill()
    proc.wait(timeout=30)
    deadline = time.monotonic() + 20
    while _alive(workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _alive(workers) == [], "reward workers outlived their SIGKILLed parent"


_TRAINER_LIKE = textwrap.dedent(
    """
    import signal, sys
    from reco_megatron.rewards.pool import RewardPool
    from reco_megatron.rewards.pool_config import RewardPoolConfig
    got = []
    signal.signal(signal.SIGTERM, lambda *a: got.append("TERM"))  # as the trainer's StopSignal
    pool = RewardPool(RewardPoolConfig(reward="tests.rewards._helpers:exact", num_workers=2))
    print(" ".join(str(w.proc.pid) for w in pool._workers), flush=True)
    sys.stdin.readline()
    batch = pool.score(["a", "b", "c"], ["a", "b", "x"])
    print(got, batch.statuses, batch.scores, pool.restarts, flush=True)
    pool.close()
    """
)


def test_workers_ignore_a_process_group_sigterm() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-c", _TRAINER_LIKE],
        cwd=ROOT,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        workers = [int(p) for p in proc.stdout.readline().split()]
        os.killpg(proc.pid, signal.SIGTERM)  # as Slurm does: every process of the step
        time.sleep(1.0)
        assert _alive(workers) == workers, "a reward worker died from the job's SIGTERM"
        out, _ = proc.communicate("go\n", timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert out.strip() == "['TERM'] ['ok', 'ok', 'ok'] [1.0, 1.0, 0.0] 0"
