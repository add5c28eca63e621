"""A second device on a CPU-only machine, for tests of where the engine's tensors live.

On a GPU box the trainer's batches are CPU tensors and the engine computes on CUDA: any op
mixing the two (an embedding lookup with CPU token ids, a CPU loss mask times CUDA
log-probs) raises ``Expected all tensors to be on the same device``. On CPU both sides are
the same device, so such a bug passes every CPU test. :class:`HostTensor` gives it back: a
CPU tensor that stands for "memory the engine's device cannot read". An op that mixes a
:class:`HostTensor` with a plain tensor of one or more dimensions raises the same error CUDA
raises (0-dim plain tensors are allowed, as CPU scalars are with CUDA tensors); ops on host
tensors alone stay on the host; ``.to(device)`` is the crossing and returns a plain tensor.

The engine runs unchanged and does not know about this class, so the check holds by
construction for any device it is given: every tensor it takes from the trainer must cross
with ``.to(...)`` before it meets the model or the engine's own tensors. Limitation: a
tensor the engine itself creates without ``device=`` counts as on the engine's device here.
"""

from __future__ import annotations

from dataclasses import fields, replace
from typing import Any

import torch
from torch.utils._pytree import tree_leaves


def _is_device_move(func: Any, args: tuple, kwargs: dict) -> bool:
    if func is torch.Tensor.cuda:
        return True
    if func is not torch.Tensor.to:
        return False
    if "device" in kwargs:
        return True
    return any(isinstance(a, (torch.device, str, torch.Tensor)) for a in args[1:])


class HostTensor(torch.Tensor):
    """A CPU tensor standing for host memory the engine's device cannot read (see above)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        with torch._C.DisableTorchFunctionSubclass():
            if _is_device_move(func, args, kwargs):
                # A plain tensor: it crossed (``.to`` may return the very same object).
                return func(*args, **kwargs).as_subclass(torch.Tensor)
            leaves = [x for x in tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
            host = [x for x in leaves if isinstance(x, HostTensor) and x.dim() > 0]
            device = [x for x in leaves if not isinstance(x, HostTensor) and x.dim() > 0]
        if host and device:
            name = getattr(func, "__name__", str(func))
            raise RuntimeError(
                f"Expected all tensors to be on the same device, but found a host tensor "
                f"{tuple(host[0].shape)} and a device tensor {tuple(device[0].shape)} in {name}"
            )
        return super().__torch_function__(func, types, args, kwargs)


def host(tensor: torch.Tensor) -> HostTensor:
    """``tensor`` as a :class:`HostTensor` (same storage)."""
    return tensor.as_subclass(HostTensor)


def host_batch(batch: Any) -> Any:
    """A ``RolloutBatch`` whose every tensor is a :class:`HostTensor`."""
    out = {
        f.name: host(getattr(batch, f.name))
        for f in fields(batch)
        if isinstance(getattr(batch, f.name), torch.Tensor)
    }
    return replace(batch, **out)


def is_host(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is still a host tensor (it never crossed)."""
    return isinstance(tensor, HostTensor)
