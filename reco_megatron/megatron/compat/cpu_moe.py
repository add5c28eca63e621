"""The CPU backend's redirections for megatron-core's mixture-of-experts layer.

The MoE layer (router, token dispatcher, local experts, shared experts) asks CUDA for the
same non-computational things as the dense model, plus streams: the all-to-all dispatcher
copies its split sizes to the host on a side ``torch.cuda.Stream`` and synchronises on an
event of it, and overlapped shared experts run on another stream. The module-level ``torch``
of each module below becomes the CPU proxy of :mod:`.cpu_patches`, whose ``torch.cuda``
answers device queries with the CPU and whose streams and events are synchronous stand-ins
(every CPU op and gloo collective has completed when it returns). Computation is untouched:
routing, permutation, all-to-all / all-gather dispatch and the experts' matmuls run as
megatron wrote them. A module missing from the installed megatron-core is skipped.

One function is wrapped: the all-to-all dispatcher passes its split sizes through
``maybe_move_tensor_to_cpu(t, as_numpy=True)``, which converts *CUDA* tensors to host numpy
arrays and returns anything else unchanged; a CPU tensor then reaches
``all_to_all_single(output_split_sizes=...)``, which takes a sequence of ints, not a tensor.
The wrapper gives host tensors the conversion CUDA tensors get.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from reco_megatron.megatron.compat.cpu_patches import Patch, proxy_modules

MOE_PROXIED_MODULES: dict[str, str] = {
    "megatron.core.transformer.moe.router": "the gate moves its weight to "
    "torch.cuda.current_device() on every forward; expert-bias and global aux-loss buffers "
    "are created there",
    "megatron.core.transformer.moe.token_dispatcher": "the all-to-all dispatcher creates a "
    "torch.cuda.Stream for device-to-host copies of its split sizes and synchronises on an "
    "event of it; a budget flag is created with device='cuda'",
    "megatron.core.transformer.moe.experts": "local experts' buffers on "
    "torch.cuda.current_device() (0.16)",
    "megatron.core.transformer.moe.moe_utils": "the aux-loss tracker's values created with "
    "device='cuda' (0.16); record_stream on torch.cuda.current_stream()",
    "megatron.core.transformer.moe.shared_experts": "overlapped shared experts run on a "
    "torch.cuda.Stream",
}
"""Megatron MoE modules whose module-level ``torch`` is the CPU proxy, with the reason."""


def _split_sizes_to_host(original: Any) -> Any:
    @functools.wraps(original)
    def move(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    return move


def patch_moe_modules() -> list[Patch]:
    """Apply the proxies of :data:`MOE_PROXIED_MODULES` and the split-size conversion;
    returns the patches made."""
    out = proxy_modules(MOE_PROXIED_MODULES)
    try:
        from megatron.core.transformer.moe import token_dispatcher
    except ImportError:  # a megatron-core without MoE
        return out
    original = getattr(token_dispatcher, "maybe_move_tensor_to_cpu", None)
    if original is not None:
        token_dispatcher.maybe_move_tensor_to_cpu = _split_sizes_to_host(original)
        out.append(
            Patch(
                f"{token_dispatcher.__name__}.maybe_move_tensor_to_cpu",
                "the all-to-all dispatcher's split sizes become host numpy arrays only when "
                "they were CUDA tensors; on CPU the tensors reach all_to_all_single, which "
                "wants a sequence of ints: host tensors are converted too",
            )
        )
    return out
