"""Collectives of the checkpoint code, no-ops without an initialised process group (a
single-process export or eval reads checkpoints too)."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

__all__ = ["all_gather", "barrier", "from_rank0", "rank", "world_size"]


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def barrier() -> None:
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
    """Rank 0's ``obj`` on every rank."""
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]
