"""Shared pytest setup: deterministic torch, CPU only."""

import os

os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
