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

With expert tensor parallelism (the dispatcher's TP group larger than 1) the dispatcher
gathers and reduce-scatters *uneven* token counts over the expert-TP group
(``tensor_parallel.mappings._gather_along_first_dim`` / ``_reduce_scatter_along_first_dim``
with split sizes): NCCL takes tensors of different sizes there, gloo does not. On CPU the
uneven gather pads every part to the largest and cuts the result, and the uneven
reduce-scatter is an all-reduce of which each rank keeps its slice (the same sums); the even
cases are untouched.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist

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


def _uneven_gather(original: Any) -> Any:
    @functools.wraps(original)
    def gather(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or group is None or group.size() == 1:
            return original(input_, group, output_split_sizes, use_global_buffer)
        sizes = [int(n) for n in output_split_sizes]
        padded = input_.new_zeros((max(sizes), *input_.shape[1:]))
        padded[: input_.shape[0]] = input_
        parts = [torch.empty_like(padded) for _ in sizes]
        dist.all_gather(parts, padded, group=group)
        return torch.cat([part[:n] for part, n in zip(parts, sizes, strict=True)])

    return gather


def _uneven_reduce_scatter(original: Any) -> Any:
    @functools.wraps(original)
    def reduce_scatter(input_, group, input_split_sizes=None, use_global_buffer=False):
        if input_split_sizes is None or group is None or group.size() == 1:
            return original(input_, group, input_split_sizes, use_global_buffer)
        total = input_.contiguous().clone()
        dist.all_reduce(total, group=group)
        sizes = [int(n) for n in input_split_sizes]
        return torch.split(total, sizes, dim=0)[group.rank()].contiguous()

    return reduce_scatter


def patch_moe_modules() -> list[Patch]:
    """Apply the proxies of :data:`MOE_PROXIED_MODULES` and the split-size conversion;
    returns the patches made."""
    out = proxy_modules(MOE_PROXIED_MODULES)
    from megatron.core.tensor_parallel import mappings

    for name, wrap, what in (
        ("_gather_along_first_dim", _uneven_gather, "all-gather"),
        ("_reduce_scatter_along_first_dim", _uneven_reduce_scatter, "reduce-scatter"),
    ):
        setattr(mappings, name, wrap(getattr(mappings, name)))
        out.append(
            Patch(
                f"{mappings.__name__}.{name}",
                f"the MoE dispatcher's uneven {what} over the expert-TP group (split sizes): "
                "gloo needs equal sizes; padded gather / all-reduce and slice on CPU",
            )
        )
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
