"""The megatron decoder's CUDA graphs: captured decode steps replay exactly what the eager
steps compute, and both give the CPU decoder's answers on the same weights.

The worker (``tests/gpu/_decoder_worker.py``) decodes the reference prompts and settings of
``tests/megatron/test_decoder_reference.py`` (greedy, T = 1, top-k + top-p + stop ids, a
third of the vocabulary as stop ids: rows finish at many steps, so the batch shrinks and
several batch sizes are captured) twice on the GPU: with CUDA graphs and eagerly.

Tolerances (stated, not yet observed on a GPU): graphs vs eager run the same kernels on the
same inputs, so tokens, finish reasons and log-probs are equal (1e-6 for log-probs, room for
a kernel choosing another algorithm between the eager and the captured run). Against the
CPU's fixture in fp32 with TF32 off: 1e-4 on log-probs (every kernel differs: cuBLAS vs the
CPU BLAS, GPU exp/log), and tokens equal except where a row's two most likely tokens are
within that of each other (not the case on these weights: the CPU decoders agree to 1e-6).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from tests.gpu._cuda import GPU
from tests.megatron import _decoder_reference as ref

pytestmark = GPU
ROOT = Path(__file__).resolve().parents[2]


def _compare(got: dict, want: dict, tol: float) -> None:
    for name in ref.SETTINGS:
        for (gt, gl, gr), (wt, wl, wr) in zip(got[name], want[name], strict=True):
            assert (gt, gr) == (wt, wr), f"{name}: {gt} {gr} != {wt} {wr}"
            gap = max((abs(a - b) for a, b in zip(gl, wl, strict=True)), default=0.0)
            assert gap < tol, f"{name}: log-prob gap {gap}"


def test_captured_decode_steps_equal_eager_ones_and_the_cpu(tmp_path: Path) -> None:
    out = tmp_path / "decoded.pt"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.run(
        [sys.executable, "-m", "tests.gpu._decoder_worker", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = torch.load(out, weights_only=False)
    assert got["graphs"]["captures"] > 1, got["graphs"]["captures"]  # several batch sizes
    assert got["eager"]["captures"] == 0
    _compare(got["graphs"]["outputs"], got["eager"]["outputs"], 1e-6)
    want = json.loads(ref.FIXTURE.read_text())["dense"]
    _compare(got["graphs"]["outputs"], want, 1e-4)
