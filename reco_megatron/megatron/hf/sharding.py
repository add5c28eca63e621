"""Where a megatron parameter lives across ranks: global names, TP / expert-TP / EP split.

* **Layers**: ``decoder.layers.i`` of a pipeline stage (or virtual chunk) is renamed with the
  layer's own ``layer_number - 1`` (global), so no offset arithmetic is needed.
* **Tensor parallelism**: column-parallel weights are split on dim 0, row-parallel ones on
  dim 1 (``param.partition_dim``); a gated fc1 ``[gate; up]`` is split per half (rank t holds
  ``[gate_t; up_t]``). Routed experts are split over the *expert* TP group, everything else
  over the TP group.
* **Expert parallelism**: a rank holds ``N / EP`` of the ``N`` routed experts of each layer;
  its local expert ``i`` is global expert ``ep_rank * N / EP + i`` (megatron's numbering).
  :func:`global_names` uses global expert indices; :func:`gather_ep` all-gathers an expert's
  tensor over the EP group so every rank of a stage can see every expert.

Collectives here are over the TP, expert-TP and EP groups only (pipeline stages are the
business of :mod:`reco_megatron.megatron.hf.checkpoint`).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_LOCAL_EXPERT = re.compile(r"(mlp\.experts\.local_experts\.)(\d+)(\.)")


def is_expert(name: str) -> bool:
    """Whether a megatron parameter name belongs to a routed expert."""
    return "mlp.experts." in name


def is_gated(name: str) -> bool:
    """Whether the parameter is a gated SwiGLU fc1 ``[gate; up]`` (dense, expert, shared)."""
    return name.endswith("linear_fc1.weight") and "mlp." in name


def unwrap(chunk: Any) -> Any:
    """The module inside DDP / Float16Module wrappers."""
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def tp_group_of(name: str) -> tuple[int, int, Any]:
    """``(size, rank, group)`` of the tensor-parallel group ``name`` is split over: the
    expert TP group for routed experts, else the TP group."""
    from megatron.core import parallel_state as ps

    if is_expert(name):
        return (
            ps.get_expert_tensor_parallel_world_size(),
            ps.get_expert_tensor_parallel_rank(),
            ps.get_expert_tensor_parallel_group(),
        )
    return (
        ps.get_tensor_model_parallel_world_size(),
        ps.get_tensor_model_parallel_rank(),
        ps.get_tensor_model_parallel_group(),
    )


def ep_group() -> tuple[int, int, Any]:
    """``(size, rank, group)`` of the expert-parallel group (``(1, 0, None)`` before
    megatron's parallel state exists)."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return 1, 0, None
    return (
        ps.get_expert_model_parallel_world_size(),
        ps.get_expert_model_parallel_rank(),
        ps.get_expert_model_parallel_group(),
    )


def experts_per_rank(chunk: Any) -> int:
    """Routed experts of each layer held by this rank (0 for a dense model)."""
    experts = getattr(getattr(unwrap(chunk), "config", None), "num_moe_experts", None)
    return experts // ep_group()[0] if experts else 0


def _renumber_expert(name: str, index: int) -> str:
    return _LOCAL_EXPERT.sub(lambda m: f"{m.group(1)}{index}{m.group(3)}", name, count=1)


def global_names(chunk: Any) -> Iterator[tuple[str, str, torch.nn.Parameter]]:
    """``(local name, global single-rank name, param)`` of one GPTModel chunk.

    DDP's ``module.`` prefix is stripped; ``decoder.layers.i`` is renumbered with the layer's
    global ``layer_number - 1`` and ``local_experts.i`` with the global expert index.
    """
    layers = chunk.decoder.layers if hasattr(chunk, "decoder") else []
    offset = ep_group()[1] * experts_per_rank(chunk)
    for name, param in chunk.named_parameters():
        local = name.removeprefix("module.")
        match = _LAYER.match(local)
        if match is None:
            yield name, local, param
            continue
        index = layers[int(match.group(1))].layer_number - 1
        out = f"decoder.layers.{index}.{match.group(2)}"
        expert = _LOCAL_EXPERT.search(out)
        if expert is not None:
            out = _renumber_expert(out, int(expert.group(2)) + offset)
        yield name, out, param


def shard_tp(full: torch.Tensor, param: torch.Tensor, name: str) -> torch.Tensor:
    """This rank's TP slice of ``full`` for ``param`` (fc1: ``[gate_t; up_t]``)."""
    tp, rank, _ = tp_group_of(name)
    if tp == 1 or not getattr(param, "tensor_model_parallel", False):
        return full
    if is_gated(name):
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp)[rank], up.chunk(tp)[rank]])
    return full.chunk(tp, dim=param.partition_dim)[rank]


def gather_tp(param: torch.Tensor, name: str) -> torch.Tensor:
    """The full tensor of a TP-sharded ``param`` (collective over its TP group).

    Unsharded parameters (norms, routers) are returned detached without a copy.
    """
    tp, _, group = tp_group_of(name)
    local = param.detach()
    if tp == 1 or not getattr(param, "tensor_model_parallel", False):
        return local
    parts = [torch.empty_like(local) for _ in range(tp)]
    dist.all_gather(parts, local.contiguous(), group=group)
    if is_gated(name):
        halves = [p.chunk(2, dim=0) for p in parts]
        return torch.cat([torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])])
    return torch.cat(parts, dim=param.partition_dim)


def gathered_shape(param: torch.Tensor, name: str) -> list[int]:
    """The shape :func:`gather_tp` returns, without communicating."""
    tp = tp_group_of(name)[0]
    shape = list(param.shape)
    if tp > 1 and getattr(param, "tensor_model_parallel", False):
        shape[param.partition_dim] *= tp
    return shape


def ep_names(name: str, per_rank: int) -> list[str]:
    """The global names :func:`gather_ep` yields for ``name`` (global), in order."""
    size, rank, _ = ep_group()
    match = _LOCAL_EXPERT.search(name)
    if size == 1 or match is None:
        return [name]
    local = int(match.group(2)) - rank * per_rank
    return [_renumber_expert(name, r * per_rank + local) for r in range(size)]


def gather_ep(full: torch.Tensor, name: str, per_rank: int) -> Iterator[tuple[str, torch.Tensor]]:
    """``(global name, tensor)`` for one TP-gathered parameter: a routed expert's tensor is
    all-gathered over the EP group (collective) and yielded once per EP rank with that rank's
    global expert index; other parameters pass through. ``per_rank``: experts per rank."""
    names = ep_names(name, per_rank)
    if len(names) == 1:
        yield name, full
        return
    size, _, group = ep_group()
    parts = [torch.empty_like(full) for _ in range(size)]
    dist.all_gather(parts, full.contiguous(), group=group)
    yield from zip(names, parts, strict=True)


def full_tensors(chunk: Any, *, tied_output: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Every parameter of one chunk as a full single-rank megatron tensor ``(global name,
    tensor)``: gathered over TP (expert TP for experts) and, for routed experts, over EP.
    Collective over those groups: every rank of the stage must exhaust it. The last stage's
    copy of a tied embedding (``output_layer.weight``) is left out unless ``tied_output``."""
    tied = getattr(unwrap(chunk), "share_embeddings_and_output_weights", False)
    per_rank = experts_per_rank(chunk)
    for local, name, param in global_names(chunk):
        if tied and not tied_output and name == "output_layer.weight":
            continue
        yield from gather_ep(gather_tp(param, local), name, per_rank)
