"""Per-rank RNG states of a checkpoint (python, numpy, torch, CUDA, megatron's tracker),
stored as tensors and plain values so that ``torch.load(weights_only=True)`` reads them."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

__all__ = ["rng_state", "set_rng_state"]


def rng_state() -> dict[str, Any]:
    from megatron.core import tensor_parallel

    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": _numpy_state_to_tensors(np.random.get_state()),
        "torch": torch.get_rng_state(),
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _numpy_state_to_tensors(state: tuple) -> dict[str, Any]:
    """numpy's legacy RNG state as tensors/ints, loadable with ``torch.load(weights_only=True)``."""
    name, keys, pos, has_gauss, cached = state
    return {
        "name": name,
        "keys": torch.from_numpy(keys.astype(np.int64)),
        "pos": int(pos),
        "has_gauss": int(has_gauss),
        "cached": float(cached),
    }


def _numpy_state_from_tensors(state: dict[str, Any]) -> tuple:
    keys = state["keys"].numpy().astype(np.uint32)
    return (state["name"], keys, state["pos"], state["has_gauss"], state["cached"])


def set_rng_state(state: dict[str, Any]) -> None:
    from megatron.core import tensor_parallel

    random.setstate(state["python"])
    np.random.set_state(_numpy_state_from_tensors(state["numpy"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])
