"""The Megatron adapter: the only package that imports megatron-core.

One folder per job: ``step/`` (the update engine, its schedule, micro-batches, packing,
data-parallel balance, loss layers, batch format and metric reduction), ``model/`` (model
config and build, MoE, norm, routing replay, optimizer), ``decoding/`` (KV-cached decoding on
the trainer's own model), ``memory/`` (the per-GPU estimate and the meta-device census),
``checkpoint/`` (training checkpoints), ``hf/`` (Hugging Face weights) and ``compat/``
(megatron-core versions and the CPU backend); beside them ``distributed`` (the rank layout)
and ``device`` (where tensors live). What needs no megatron-core lives below, in
:mod:`reco_megatron.parallel`: the batch format (``RolloutBatch`` and its data-parallel split)
and the small collectives (``collective_device``, ``from_rank0``).

Code outside this package imports only the names below, from here (``from
reco_megatron.megatron import ReCoEngine``); ``tests/test_layering.py`` enforces it, so files
can move inside the package without touching anyone outside it. The names load on first use
(PEP 562): importing this package imports neither megatron-core nor torch, so a config error
or ``--help`` stays instant.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS: dict[str, str] = {
    # the rank layout and devices
    "ParallelConfig": "distributed",
    "initialize_parallel": "distributed",
    "rank_layout": "distributed",
    "compute_device": "device",
    # the model
    "ModelConfig": "model.config",
    "build_model": "model.build",
    "transformer_config": "model.build",
    "OptimConfig": "model.optimizer",
    # the update step
    "UpdateConfig": "step.config",
    "ReCoEngine": "step.engine",
    "length_multiple": "step.microbatching",
    "round_up": "step.microbatching",
    # decoding with the trainer's model
    "MegatronDecoder": "decoding.decoder",
    # memory
    "GIB": "memory.estimate",
    "H100_80GB_BYTES": "memory.estimate",
    "ColocationBudget": "memory.estimate",
    "ModelState": "memory.estimate",
    "colocation_budget": "memory.estimate",
    "colocation_table": "memory.estimate",
    "colocation_warnings": "memory.estimate",
    "stage_state": "memory.estimate",
    "measure_rank_state": "memory.census",
    # training checkpoints: save, load, resume
    "CheckpointError": "checkpoint",
    "CheckpointSpaceError": "checkpoint",
    "UnsafeCheckpointError": "checkpoint",
    "latest_checkpoint": "checkpoint",
    "load_checkpoint": "checkpoint",
    "read_meta": "checkpoint",
    "remove_partial_checkpoints": "checkpoint",
    "resume_latest": "checkpoint",
    "save_checkpoint": "checkpoint",
    "sft_checkpoint_name": "checkpoint",
    "verify_checkpoint": "checkpoint",
    "load_model_and_optimizer": "checkpoint.megatron_state",
    "shutdown_async_writer": "checkpoint.megatron_state",
    # Hugging Face weights
    "DEFAULT_MAX_SHARD_SIZE": "hf.checkpoint",
    "check_target": "hf.target",
    "save_hf_checkpoint": "hf.checkpoint",
    "hf_config_from_model_config": "hf.config",
    "model_section_from_hf": "hf.config",
    "model_config_from_hf": "hf.config",
    "architecture_mismatches": "hf.config",
    "HFConfigError": "hf.config",
    "hf_shapes": "hf.convert",
    "choose_converter": "hf.converter",
    "load_hf_into_engine": "hf.converter",
    "policy_hf_weights": "hf.converter",
    "PushRole": "hf.push",
    "push_role": "hf.push",
    "push_tensors": "hf.push",
    "stage_hf_weights": "hf.push",
}
"""Each exported name -> the submodule (relative to this package) that defines it."""

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
