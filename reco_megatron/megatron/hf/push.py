"""The policy's weights for separate rollout workers, from the ranks that hold them.

A push to the workers does not gather the model anywhere: each pipeline stage exports its own
tensors (:func:`~reco_megatron.megatron.hf.convert.export_hf_weights`, full tensors from the
TP all-gather) on the ranks of the first data-parallel replica (context-parallel rank 0), and
the stage's first tensor-parallel rank sends them. :func:`push_role` says what this rank does,
:func:`push_tensors` lists the whole stream in order with each tensor's sending stage (the
plan every worker receives once), :func:`stage_hf_weights` is this stage's part of one push.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from reco_megatron.megatron.hf.checkpoint import stage_plans
from reco_megatron.megatron.hf.convert import export_hf_weights
from reco_megatron.megatron.model.config import ModelConfig


@dataclass(frozen=True)
class PushRole:
    """This rank's part in a push."""

    exporter: bool
    """Runs its stage's export (collective over its TP group)."""
    sender: int | None
    """Its stage's index when it sends the stage's tensors, else None."""
    senders: int
    """Number of sending ranks (pipeline stages)."""


def push_role() -> PushRole:
    from megatron.core import parallel_state as ps

    exporter = ps.get_data_parallel_rank() == 0 and ps.get_context_parallel_rank() == 0
    stage = ps.get_pipeline_model_parallel_rank()
    sends = exporter and ps.get_tensor_model_parallel_rank() == 0
    return PushRole(exporter, stage if sends else None, ps.get_pipeline_model_parallel_world_size())


def push_tensors(
    model_chunks: list[Any], model_cfg: ModelConfig
) -> list[tuple[str, tuple[int, ...], torch.dtype, int]]:
    """``(hf_name, shape, dtype, stage)`` of every tensor a push carries, stage by stage in
    export order (collective over the pipeline group; the same list on every rank)."""
    out = []
    for stage, plan in enumerate(stage_plans(model_chunks, model_cfg)):
        out.extend((name, tuple(shape), dtype, stage) for name, shape, dtype in plan)
    return out


def stage_hf_weights(
    model_chunks: list[Any], model_cfg: ModelConfig
) -> Iterator[tuple[str, torch.Tensor]]:
    """This pipeline stage's ``(hf_name, tensor)`` pairs (collective over its TP group)."""
    return export_hf_weights(model_chunks, model_cfg)
