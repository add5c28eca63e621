"""The dead-run guard on a real training process: a reward that pays for the first two steps
and never again stops the run with exit status 3 and one line naming the last checkpoint
whose weights still earned rewards."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.tiny_overrides import TINY_RUN

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def test_dead_run_stops_with_exit_3(tmp_path) -> None:
    out = tmp_path / "run"
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "RECO_TEST_COUNTER": str(tmp_path / "counter"),
        "RECO_TEST_ALIVE_ITEMS": "32",  # 4 prompts x G = 4: steps 1 and 2 earn rewards
    }
    cmd = [
        sys.executable, "-m", "reco_megatron.train", "examples/tiny_cpu.yaml", *TINY_RUN,
        "sft.steps=0", "trainer.max_steps=8", "eval.interval=0",
        "checkpoint.save_interval=1", "checkpoint.keep_last=3", "stability.dead_run_steps=2",
        "reward.reward=tests.rewards._helpers:alive_then_dead", f"trainer.output_dir={out}",
    ]  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, env=env, timeout=600, capture_output=True, text=True)
    assert done.returncode == 3, done.stderr[-3000:]
    assert "may rotate out" not in done.stderr  # keep_last 3 x interval 1 covers 2 dead steps
    lines = [line for line in done.stderr.splitlines() if "dead run:" in line]
    assert len(lines) == 1, done.stderr[-3000:]
    assert "steps 3-4 had no non-zero reward" in lines[0]
    assert lines[0].endswith(f"last good checkpoint: {out / 'checkpoints' / 'step_00000001'}")
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]  # the dead steps are on record
    assert [r["reward_nonzero_frac"] for r in rows] == [1.0, 1.0, 0.0, 0.0]
    assert all(r["reward_unparsable_frac"] == 0.0 for r in rows)
