"""Run the real megatron-core on CPU (gloo): the embedded CPU default of reco-megatron.

megatron-core assumes CUDA in a handful of places that are not about computation: it asks
``torch.cuda.current_device()`` where to allocate buffers, hard-codes ``device="cuda"`` for a
few scalars, calls ``torch.cuda.synchronize()`` / ``torch.cuda.current_stream()`` around
communication, checks ``param.type() == 'torch.cuda.FloatTensor'`` in the distributed
optimizer and keeps its model-parallel RNG states as CUDA generator states. On a machine
without CUDA each of these raises. :func:`enable_cpu_backend` redirects exactly these, and
nothing that can already work:

* it replaces the module-level name ``torch`` *inside the listed megatron modules* by a thin
  proxy whose ``torch.cuda.current_device / synchronize / current_stream`` answer for the CPU
  and whose tensor factories map ``device="cuda"`` to the CPU; ``torch`` itself, and every
  other module, is untouched;
* it wraps ``DistributedOptimizer._build_model_and_main_param_groups`` so that, for the
  duration of that call only, a CPU float32 parameter reports the type name the check expects;
* it installs :class:`CpuRNGStatesTracker` as megatron's model-parallel RNG tracker.

Every patch is recorded (:func:`applied_patches`); ``docs/cpu-backend.md`` lists them with the
megatron-core versions that need them, and a test checks the two agree. When CUDA is
available, :func:`enable_cpu_backend` logs one line and changes nothing (unless ``force``).

Usage::

    from reco_megatron.megatron.compat.cpu_backend import enable_cpu_backend, model_parallel_seed
    enable_cpu_backend()                 # no-op on a GPU machine
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    model_parallel_seed(1234)            # CPU tracker here, megatron's CUDA seeding on GPU
"""

from __future__ import annotations

from typing import Any

import torch

from reco_megatron.megatron.compat.cpu_moe import patch_moe_modules
from reco_megatron.megatron.compat.cpu_patches import (
    Patch,
    patch_tied_embedding_setup,
    patch_type_checks,
    proxy_modules,
)
from reco_megatron.megatron.compat.cpu_rng import CpuRNGStatesTracker, install_cpu_rng_tracker
from reco_megatron.utils.logging import get_logger

__all__ = [
    "CpuRNGStatesTracker",
    "Patch",
    "applied_patches",
    "cpu_backend_enabled",
    "enable_cpu_backend",
    "model_parallel_seed",
    "validate_cpu_config",
]

logger = get_logger(__name__)


_patches: list[Patch] = []
_state: dict[str, bool] = {"enabled": False, "decided": False}


def enable_cpu_backend(force: bool = False) -> bool:
    """Make megatron-core run on CPU with gloo; returns whether the backend is active.

    Idempotent: the first call decides and logs once, later calls return the same answer.
    With CUDA available (and ``force`` false) it changes nothing and logs that. ``force=True``
    applies the patches even where CUDA is available (tests of the CPU path on a GPU box).
    """
    if _state["enabled"] or (_state["decided"] and not force):
        return _state["enabled"]
    _state["decided"] = True
    if torch.cuda.is_available() and not force:
        logger.info("CUDA is available: megatron-core runs on GPU, CPU backend not enabled")
        return False
    _patches.extend(proxy_modules())
    _patches.extend(patch_moe_modules())
    _patches.extend(patch_type_checks())
    _patches.extend(patch_tied_embedding_setup())
    install_cpu_rng_tracker()
    _patches.append(
        Patch(
            "megatron.core.tensor_parallel.random._CUDA_RNG_STATE_TRACKER",
            "megatron keeps model-parallel RNG states as CUDA generator states; replaced by "
            "CpuRNGStatesTracker (forks torch's CPU generator)",
        )
    )
    _state["enabled"] = True
    import megatron.core

    logger.info(
        "CPU backend enabled for megatron-core %s: %d patches (see docs/cpu-backend.md)",
        getattr(megatron.core, "__version__", "?"),
        len(_patches),
    )
    return True


def cpu_backend_enabled() -> bool:
    """Whether :func:`enable_cpu_backend` has applied its patches in this process."""
    return _state["enabled"]


def applied_patches() -> list[Patch]:
    """The patches applied in this process, in order (empty when the backend is off)."""
    return list(_patches)


def model_parallel_seed(seed: int) -> None:
    """Seed the default and model-parallel RNG states on CPU or GPU.

    On GPU (backend off) this is megatron's ``model_parallel_cuda_manual_seed(seed)``. On CPU it
    mirrors it on torch's CPU generator: the default generator gets ``seed`` (data-parallel
    state), and the tracker gets ``seed + 2718 + tp_rank`` (model-parallel state, differs across
    TP ranks) and ``seed + 1024 + 100 * ep_rank + etp_rank`` (expert state). Call it after
    ``initialize_model_parallel``.
    """
    if not _state["enabled"]:
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(seed)
        return
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import random as mrandom

    tracker = install_cpu_rng_tracker()
    tracker.reset()
    torch.manual_seed(seed)
    tracker.add(mrandom._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(
        mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME,
        seed + 2718 + ps.get_tensor_model_parallel_rank(),
    )
    expert_seed = (
        seed
        + 1024
        + 100 * ps.get_expert_model_parallel_rank()
        + ps.get_expert_tensor_parallel_rank()
    )
    tracker.add(mrandom._EXPERT_PARALLEL_RNG_TRACKER_NAME, expert_seed)


def validate_cpu_config(config: Any) -> None:
    """Reject TransformerConfig options the CPU backend cannot run, saying what to change.

    Raises ``ValueError`` when the backend is active and ``config`` asks for something that
    needs CUDA-only kernels. Does nothing when the backend is off.
    """
    if not _state["enabled"]:
        return
    problems = []
    if getattr(config, "fp16", False):
        problems.append(
            "fp16=True: fp16 loss scaling keeps its scale on CUDA; use fp32 or bf16=True on CPU"
        )
    if problems:
        raise ValueError("CPU backend cannot run this config:\n- " + "\n- ".join(problems))
