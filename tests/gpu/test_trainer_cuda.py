"""The trainer on CUDA: 3 steps with checkpoints, and a run stopped at step 2 that resumes
from its checkpoint and continues with the uninterrupted run's metrics.

Runs ``python -m reco_megatron.train`` on the tiny config as a user would (one process, NCCL,
the embedded rollout engine on the same GPU). Tolerance: unlike on the CPU (bit-for-bit, see
``tests/trainer/test_resume.py``), CUDA kernels such as the embedding backward accumulate with
atomics in a run-dependent order, so the resumed step's floating-point metrics agree to
``atol 1e-4 + rtol 1e-3`` (values of order 1 after one update of ~1e-7 differences); the
sampled tokens, hence rewards and lengths, are equal unless a ~1e-7 difference flips a
sample (probability ~1e-5 over 3 steps of 16 responses of <= 8 tokens, as in
``tests/trainer/test_loop.py``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.gpu._cuda import GPU
from tests.trainer.test_loop import TINY

pytestmark = GPU
ROOT = Path(__file__).resolve().parents[2]
EXACT = ("step", "reward_mean", "response_len_mean", "truncated_frac", "pass@1", "pass@4")
CLOSE = ("loss", "entropy_mean", "grad_norm", "clip_frac", "weight_mean", "logprob_mismatch", "lr")


def _train(out: Path, steps: int) -> str:
    cmd = [
        sys.executable,
        "-m",
        "reco_megatron.train",
        "examples/tiny_cpu.yaml",
        *TINY,
        f"trainer.max_steps={steps}",
        "checkpoint.save_interval=2",
        f"trainer.output_dir={out}",
    ]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stderr


def _rows(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]


def test_three_steps_then_resume_on_cuda(tmp_path: Path) -> None:
    log = _train(tmp_path / "full", 3)
    assert "(nccl)" in log, "the run did not start NCCL: not on the GPU?"
    assert "CPU backend enabled" not in log
    full = _rows(tmp_path / "full")
    assert [r["step"] for r in full] == [1, 2, 3]
    assert (tmp_path / "full" / "checkpoints" / "latest").read_text().strip() == "step_00000003"

    cut = tmp_path / "cut"
    _train(cut, 2)
    assert (cut / "checkpoints" / "latest").read_text().strip() == "step_00000002"
    log = _train(cut, 3)
    assert "resumed from" in log
    resumed = _rows(cut)
    assert [r["step"] for r in resumed] == [1, 2, 3]
    for got, want in zip(resumed, full, strict=True):
        for key in EXACT:
            assert got[key] == want[key], (got["step"], key)
        for key in CLOSE:
            assert got[key] == pytest.approx(want[key], abs=1e-4, rel=1e-3, nan_ok=True), (
                got["step"],
                key,
            )
