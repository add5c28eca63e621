"""Multi-turn episodes with ``rollout.placement=separate``: with ``max_staleness=0`` and one
worker the run is the colocated one.

The worker gets the run's environment settings in its setup, runs each request's episodes
through the colocated trainer's code (``EpisodeService``) and sends them back with their loss
masks, per-turn rewards and counters. Compared with the colocated run on the same seeds:

* the episodes: every environment call (reset, then each action's token ids and finish
  reason) is recorded by the test environment, and the two runs' records are the same;
* every column of ``metrics.jsonl`` (rewards, loss, entropy over the policy's tokens only,
  ``env_*`` counters) is the same, except wall-clock columns and ``logprob_mismatch``, which
  compares the engine's log-probs with the trainer's: the embedded engine batches the
  episodes' later turns as their environment steps come back (a timing-dependent batch), and
  a CPU matmul's last bits depend on the batch's composition, so those log-probs differ in
  their last bits (the sampled tokens, seeded per episode and turn, do not);
* the spawned CPU worker runs with ``OMP_WAIT_POLICY=PASSIVE`` (it shares the cores with the
  trainer), and its environment workers are gone when the run ends.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from reco_megatron.trainer.reporting import is_wall_clock
from tests.tiny_overrides import TINY_RUN

pytestmark = [pytest.mark.slow, pytest.mark.dist]
ROOT = Path(__file__).resolve().parents[2]
RUN = [
    *TINY_RUN,
    "rollout.max_new_tokens=24",
    "rollout.env=tests.envs._envs:Recorder",
    "rollout.env_workers=2",
    "sft.steps=0",
    "trainer.max_steps=2",
    "checkpoint.save_interval=0",
    "eval.interval=0",
]
SEPARATE = ["rollout.placement=separate", "rollout.max_staleness=0", "rollout.worker_timeout_s=60"]
LOOSE = {"logprob_mismatch"}
"""Columns of the engine's log-probs (see the module doc)."""


def _start(out: Path, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "reco_megatron.train", "examples/calculator_cpu.yaml", *RUN,
           f"trainer.output_dir={out}", *extra]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    env.update(PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    env["RECO_TEST_EPISODE_LOG"] = str(out.parent / f"{out.name}-episodes.jsonl")
    return subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _finish(proc: subprocess.Popen) -> None:
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]


def _episodes(out: Path) -> list[str]:
    lines = (out.parent / f"{out.name}-episodes.jsonl").read_text().splitlines()
    return sorted(lines)  # environment calls of different episodes run in any order


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _worker_and_envs(
    trainer: subprocess.Popen, within: float = 120
) -> tuple[psutil.Process, list[int]]:
    """The spawned rollout worker, once its environment workers are up."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if trainer.poll() is not None:
            raise AssertionError(trainer.communicate()[1][-3000:])
        with_cmd = []
        for p in psutil.Process(trainer.pid).children(recursive=True):
            try:
                with_cmd.append((p, " ".join(p.cmdline())))
            except psutil.Error:
                continue
        workers = [p for p, cmd in with_cmd if "reco_megatron.rollout_worker" in cmd]
        envs = [p.pid for p, cmd in with_cmd if "reco_megatron.envs._worker" in cmd]
        if workers and len(envs) >= 2:
            return workers[0], envs
        time.sleep(0.2)
    raise AssertionError("the rollout worker and its environment workers did not start")


def test_separate_episodes_at_k0_equal_the_colocated_run(tmp_path: Path) -> None:
    colocated = _start(tmp_path / "colocated")
    _finish(colocated)
    separate = _start(tmp_path / "separate", *SEPARATE)
    worker, envs = _worker_and_envs(separate)
    assert worker.environ().get("OMP_WAIT_POLICY") == "PASSIVE"
    _finish(separate)

    ref, got = _episodes(tmp_path / "colocated"), _episodes(tmp_path / "separate")
    assert len(ref) > 16 and any('"turn": 3' in line for line in ref), ref[:4]
    assert got == ref

    ref_rows, got_rows = _rows(tmp_path / "colocated"), _rows(tmp_path / "separate")
    assert len(ref_rows) == len(got_rows) == 2
    for a, b in zip(ref_rows, got_rows, strict=True):
        assert a["env_tool_calls_mean"] > 0 and a["env_observation_frac"] > 0
        assert a["env_failed"] == 0
        same = {k: v for k, v in a.items() if not is_wall_clock(k) and k not in LOOSE}
        assert {k: b[k] for k in same} == same
        assert b["logprob_mismatch"] == pytest.approx(a["logprob_mismatch"], rel=0.5, abs=1e-6)
        assert b["staleness_max"] == 0
    _, alive = psutil.wait_procs([psutil.Process(p) for p in envs if psutil.pid_exists(p)], 10)
    assert not alive, f"environment workers outlived their rollout worker: {alive}"
