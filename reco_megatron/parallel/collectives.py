"""Small collectives that need no megatron-core, shared by the adapter and the trainer.

Every function is a no-op (or the single-process answer) without an initialised process group,
so a single-process export, eval or test calls them unchanged.
:func:`collective_device` decides where a tensor handed to ``torch.distributed`` must live: on
the current CUDA device for NCCL, on the CPU for gloo, from the group's backend rather than
from whether CUDA exists (a gloo group on a GPU machine takes CPU tensors).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["all_gather", "barrier", "collective_device", "from_rank0", "rank", "world_size"]


def collective_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """Where a tensor for a collective over ``group`` (default: the world) must live."""
    if dist.is_initialized() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def rank() -> int:
    """This process's global rank (0 without a process group)."""
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    """Ranks of the job (1 without a process group)."""
    return dist.get_world_size() if dist.is_initialized() else 1


def barrier() -> None:
    """Wait for every rank (nothing to wait for without a process group)."""
    if dist.is_initialized():
        dist.barrier()


def all_gather(obj: Any) -> list[Any]:
    """Every rank's ``obj`` (a picklable value), on every rank."""
    if not dist.is_initialized():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def from_rank0(obj: Any) -> Any:
    """Rank 0's ``obj`` (a picklable value) on every rank."""
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]
