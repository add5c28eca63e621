"""One ReCo rollout update (old-policy pass + 2 optimizer steps) on CUDA equals the same
update on the CPU, in fp32, from the same weights and the same rollout batch.

Each device runs in its own process (``tests/gpu/_update_worker.py``): the CPU one with CUDA
hidden (gloo + megatron's CPU backend), the CUDA one as the trainer runs it (NCCL).

Tolerances (stated from the arithmetic, not yet observed on a GPU): TF32 is off, so both
devices compute in fp32, but every kernel differs (cuBLAS vs the CPU BLAS, GPU exp/log/rsqrt,
reduction orders): ~1e-6 relative per op on values of order 1. ``tests/megatron/_reco.py``
uses Adam eps 1e-3, making an update Lipschitz in the gradient with constant lr/eps = 10;
two steps compound it. Old log-probs and response weights agree to 1e-5, losses and metrics
to 5e-5, parameters to 1e-4 (5x the TP/DP layout test's bounds, for kernels that differ in
every op rather than in summation order only).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.gpu._cuda import GPU

pytestmark = GPU
ROOT = Path(__file__).resolve().parents[2]
STATS_ATOL, LOSS_ATOL, PARAM_ATOL = 1e-5, 5e-5, 1e-4


def _run(device: str, init: Path, out: Path) -> dict:
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path}
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    proc = subprocess.run(
        [sys.executable, "-m", "tests.gpu._update_worker", device, str(init), str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(out, weights_only=False)


def test_update_on_cuda_equals_cpu(tmp_path: Path) -> None:
    init = tmp_path / "init.pt"
    cpu = _run("cpu", init, tmp_path / "cpu.pt")
    cuda = _run("cuda", init, tmp_path / "cuda.pt")
    assert cpu["device"] == "cpu" and cuda["device"].startswith("cuda")
    # what the engine returns to the trainer is on the CPU (engine docstring)
    assert cuda["old_logprobs"].device.type == "cpu" and cuda["weights"].device.type == "cpu"
    torch.testing.assert_close(cuda["old_logprobs"], cpu["old_logprobs"], atol=STATS_ATOL, rtol=0)
    torch.testing.assert_close(cuda["weights"], cpu["weights"], atol=STATS_ATOL, rtol=0)
    assert cuda["prep"]["logprob_mismatch"] == pytest.approx(
        cpu["prep"]["logprob_mismatch"], abs=STATS_ATOL
    )
    for got, want in zip(cuda["steps"], cpu["steps"], strict=True):
        for key in ("loss", "clip_frac", "entropy", "token_ratio_max", "weight_mean", "grad_norm"):
            assert got[key] == pytest.approx(want[key], abs=LOSS_ATOL), key
    assert cuda["params"].keys() == cpu["params"].keys()
    for name, want in cpu["params"].items():
        torch.testing.assert_close(cuda["params"][name], want, atol=PARAM_ATOL, rtol=0, msg=name)
