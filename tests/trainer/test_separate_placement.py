"""``rollout.placement=separate`` end to end: workers in their own processes, on CPU.

* ``max_staleness=0`` equals the colocated run bit for bit (every metric but wall-clock
  columns, and the exported final weights): the plumbing (prompt order, seeds, the weight push
  in buckets, versions) changes nothing.
* ``max_staleness=1`` on the same seeds differs from it and reaches staleness 1 (the workers
  generated while the trainer trained); a killed worker stops that run with exit 75 and one
  line naming it, checkpointed; the rerun resumes, says how many in-flight groups it
  discarded, and trains to the end. SIGTERM saves and exits 75
  with the workers gone; a SIGKILLed trainer takes its worker with it within seconds.
* ``worker_failure=continue``: with two workers, one frozen (SIGSTOP, a hang, not a death)
  is noticed by its silence and the run trains to the end on the other.
* A worker whose engine hangs in a generation (its heartbeats still come) reports it after
  ``rollout.generate_timeout_s`` and exits; the run stops resumably naming it.

The run is ``TINY_RUN`` with a reward that has signal without a warm-up (digit share), so the
updates move the weights from the first step.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from reco_megatron.trainer.reporting import is_wall_clock
from tests.tiny_overrides import TINY_RUN

pytestmark = pytest.mark.slow
MAIN_STACK_ONLY = pytest.mark.skipif(
    sys.version_info < (3, 12),
    reason="main stack only (CI time): the workers and the push are plain torch on both stacks; "
    "the K = 0 equalities run on both",
)
ROOT = Path(__file__).resolve().parents[2]
BASE = [
    *TINY_RUN,
    "sft.steps=0",
    "checkpoint.save_interval=0",
    "reward.reward=tests.trainer._dense_reward:digit_share",
]
SEPARATE = ["rollout.placement=separate", "rollout.worker_timeout_s=60"]
ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT)}


def _cmd(out: Path, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "reco_megatron.train", "examples/tiny_cpu.yaml", *BASE,
        f"trainer.output_dir={out}", *extra,
    ]  # fmt: skip


def _run(out: Path, *extra: str, timeout: float = 600) -> subprocess.CompletedProcess:
    done = subprocess.run(
        _cmd(out, *extra), cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout
    )
    return done


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _export(ckpt: Path, out: Path) -> dict:
    from safetensors.torch import load_file

    cmd = [sys.executable, "-m", "reco_megatron.export", str(ckpt), str(out)]
    done = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    tensors: dict = {}
    for f in sorted(out.glob("*.safetensors")):
        tensors.update(load_file(f))
    return tensors


def _workers(trainer_pid: int) -> list[psutil.Process]:
    try:
        kids = psutil.Process(trainer_pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    return [p for p in kids if "reco_megatron.rollout_worker" in " ".join(_cmdline(p))]


def _cmdline(p: psutil.Process) -> list[str]:
    try:
        return p.cmdline()
    except psutil.Error:
        return []


def _wait_for_step(out: Path, step: int, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        f = out / "metrics.jsonl"
        if f.exists() and len(f.read_text().splitlines()) >= step:
            return
        time.sleep(0.2)
    raise AssertionError(f"step {step} not reached in {timeout} s")


def _wait_gone(pids: list[int], within: float) -> float:
    start = time.monotonic()
    while time.monotonic() - start < within:
        if not any(psutil.pid_exists(p) and psutil.Process(p).status() != "zombie" for p in pids):
            return time.monotonic() - start
        time.sleep(0.1)
    raise AssertionError(f"processes {pids} still alive {within} s later")


@pytest.fixture(scope="module")
def colocated(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("colocated")
    done = _run(out, "trainer.max_steps=4")
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def test_max_staleness_0_equals_colocated_bit_for_bit(colocated: Path, tmp_path: Path) -> None:
    out = tmp_path / "separate"
    done = _run(out, "trainer.max_steps=4", *SEPARATE, "rollout.max_staleness=0")
    assert done.returncode == 0, done.stderr[-3000:]
    ref, got = _rows(colocated), _rows(out)
    assert len(got) == len(ref) == 4
    for a, b in zip(ref, got, strict=True):
        same = {k: v for k, v in a.items() if not is_wall_clock(k)}
        assert {k: b[k] for k in same} == same  # NaN-free columns: == is exact
        assert b["staleness_max"] == 0 and b["groups_dropped_stale"] == 0
        assert b["weight_push_s"] > 0 and b["trainer_wait_s"] >= 0
    final = "checkpoints/step_00000004"
    want = _export(colocated / final, tmp_path / "hf_colocated")
    have = _export(out / final, tmp_path / "hf_separate")
    assert want.keys() == have.keys() and len(want) > 0
    assert all(want[k].equal(have[k]) for k in want)


@MAIN_STACK_ONLY
def test_a_killed_worker_stops_resumably_and_the_rerun_resumes(
    colocated: Path, tmp_path: Path
) -> None:
    """At K = 1 the run overlaps (staleness 1 from step 2) and trains on other data than the
    colocated run; a worker killed at step 2 stops it resumably, and the rerun finishes."""
    out = tmp_path / "run"
    extra = ("trainer.max_steps=8", *SEPARATE, "rollout.max_staleness=1", "loss.tis_cap=2.0")
    proc = subprocess.Popen(
        _cmd(out, *extra), cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        _wait_for_step(out, 2, proc)
        workers = _workers(proc.pid)
        assert len(workers) == 1, "the worker's command line names it"
        workers[0].kill()
        killed = time.monotonic()
        _, err = proc.communicate(timeout=120)
        took = time.monotonic() - killed
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 75, err[-3000:]
    assert took < 30, f"noticed {took:.1f} s after the kill"
    lines = [line for line in err.splitlines() if "rollout worker 0" in line and "ERROR" in line]
    assert len(lines) == 1, err[-3000:]
    saved = sorted((out / "checkpoints").glob("step_*"))
    assert saved, "the stop saved a checkpoint"
    step = int(saved[-1].name.removeprefix("step_"))
    assert step >= 2
    rerun = _run(out, *extra)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert "in flight at the checkpoint; they are discarded" in rerun.stderr
    rows = _rows(out)
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert rows[0]["staleness_max"] == 0  # the first step's groups come from the start weights
    assert max(r["staleness_max"] for r in rows) == 1  # generated while the trainer trained
    assert all(r["staleness_max"] <= 1 for r in rows)
    # stale groups are other data than the colocated run's: the K = 0 equality could fail
    ref = _rows(colocated)
    assert any(a["grad_norm"] != b["grad_norm"] for a, b in zip(ref, rows[:4], strict=True))


@MAIN_STACK_ONLY
def test_sigterm_saves_and_a_killed_trainer_takes_its_worker_along(tmp_path: Path) -> None:
    out = tmp_path / "run"
    extra = ("trainer.max_steps=20", *SEPARATE, "rollout.max_staleness=1", "loss.tis_cap=2.0")
    for sig in (signal.SIGTERM, signal.SIGKILL):
        # The resumed run must write steps of its own before it is killed: the first run may
        # have logged past its checkpoint, and those rows are already in the file.
        metrics = out / "metrics.jsonl"
        logged = len(metrics.read_text().splitlines()) if metrics.exists() else 0
        proc = subprocess.Popen(
            _cmd(out, *extra), cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            _wait_for_step(out, logged + (1 if sig == signal.SIGTERM else 2), proc)
            pids = [p.pid for p in _workers(proc.pid)]
            assert len(pids) == 1
            proc.send_signal(sig)
            _, err = proc.communicate(timeout=120)
            gone = _wait_gone(pids, within=15)
        finally:
            if proc.poll() is None:
                proc.kill()
        if sig == signal.SIGTERM:
            assert proc.returncode == 75, err[-3000:]
            assert sorted((out / "checkpoints").glob("step_*")), "SIGTERM saved"
        else:
            assert proc.returncode == -signal.SIGKILL
        assert gone < 15


@MAIN_STACK_ONLY
def test_worker_failure_continue_trains_on_after_a_hang(tmp_path: Path) -> None:
    out = tmp_path / "run"
    extra = (
        "trainer.max_steps=6", *SEPARATE, "rollout.num_workers=2", "rollout.max_staleness=1",
        "loss.tis_cap=2.0", "rollout.worker_failure=continue", "rollout.worker_timeout_s=8",
    )  # fmt: skip
    proc = subprocess.Popen(
        _cmd(out, *extra), cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        _wait_for_step(out, 2, proc)
        workers = _workers(proc.pid)
        assert len(workers) == 2
        frozen = next(w for w in workers if "--worker-id" in _cmdline(w))
        frozen.suspend()  # SIGSTOP: alive, silent
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-3000:]
    assert "carrying on with workers" in err
    rows = _rows(out)
    assert [r["step"] for r in rows] == list(range(1, 7))
    assert rows[0]["rollout_workers_alive"] == 2 and rows[-1]["rollout_workers_alive"] == 1
    assert not psutil.pid_exists(frozen.pid) or frozen.status() == "zombie"


@MAIN_STACK_ONLY
def test_a_generation_that_hangs_stops_the_run_naming_the_worker(tmp_path: Path) -> None:
    out = tmp_path / "run"
    hook = str(Path(__file__).parent / "_hung_engine")
    env = {**ENV, "PYTHONPATH": f"{hook}{os.pathsep}{ROOT}", "RECO_TEST_HANG_WORKER": "0:3"}
    extra = ("trainer.max_steps=6", *SEPARATE, "rollout.max_staleness=0")
    cmd = _cmd(out, *extra, "rollout.generate_timeout_s=4")
    start = time.monotonic()
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    took = time.monotonic() - start
    assert done.returncode == 75, done.stderr[-3000:]
    lines = [ln for ln in done.stderr.splitlines() if "rollout worker 0" in ln and "ERROR" in ln]
    assert len(lines) == 1 and "has been generating request 2 for" in lines[0], done.stderr[-3000:]
    assert "rollout.generate_timeout_s=4" in lines[0]
    assert [r["step"] for r in _rows(out)] == [1, 2]  # the third generation hung
    assert (out / "checkpoints" / "step_00000002").exists(), "the stop saved a checkpoint"
    log = (out / "rollout" / "worker-0.log").read_text()
    assert "has been generating request 2" in log and "exiting" in log
    assert took < 120, f"the run took {took:.0f} s to stop"


def _train(rank: int, world: int, out: str, extra: list[str]) -> int:
    from reco_megatron.train import main

    args = ["examples/tiny_cpu.yaml", *BASE, f"trainer.output_dir={out}", *extra]
    return main([*args, "trainer.max_steps=3", f"parallel.pipeline_model_parallel_size={world}"])


@pytest.mark.dist
def test_two_pipeline_stages_push_from_two_senders(tmp_path: Path) -> None:
    """PP 2: each stage exports and sends its own layers (no stage gathers the model); the
    worker assembles them, and K = 0 still equals the colocated run."""
    from reco_megatron.testing import run_distributed

    runs = {"colocated": [], "separate": [*SEPARATE, "rollout.max_staleness=0"]}
    for name, extra in runs.items():
        assert run_distributed(_train, 2, args=(str(tmp_path / name), extra), timeout=600) == [0, 0]
    ref, got = _rows(tmp_path / "colocated"), _rows(tmp_path / "separate")
    assert len(ref) == len(got) == 3
    for a, b in zip(ref, got, strict=True):
        same = {k: v for k, v in a.items() if not is_wall_clock(k)}
        assert {k: b[k] for k in same} == same
