"""What every ``gpu``-marked test shares: the marker, the skip and its reason."""

from __future__ import annotations

import os

import pytest
import torch

REASON = (
    "needs a CUDA GPU and none is visible to torch "
    f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}; tests/conftest.py hides "
    "GPUs unless CUDA_VISIBLE_DEVICES is set: run `CUDA_VISIBLE_DEVICES=0 pytest -m gpu "
    "tests/gpu` or `bash benchmarks/gpu/check.sh OUT_DIR`)"
)

GPU = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason=REASON)]
"""``pytestmark`` of every GPU test module."""
