"""The output layer and the statistics in one op that never materialises the logits.

``vocab_parallel_linear_stats(hidden, weight, target, vocab_size, tp_group)`` equals megatron's
``ColumnParallelLinear(parallel_output=True)`` (no bias) followed by
:func:`reco_megatron.parallel.vocab_parallel_stats`, but computes the logits block by block:

* forward: for each block of ``b`` tokens, ``z = h_blk W^T`` (``[b, V/TP]`` in the hidden
  dtype: a bf16 matmul accumulates in fp32 and rounds once, as the unfused layer does), then
  the block's partials relative to the shard's own max (``m_local``, ``S``, ``T``, ``Q`` and
  the raw target logit; the Triton kernel or the eager math). After the loop: one MAX
  all-reduce of ``m_local``, each rank rescales its sums to the global max
  (:func:`combine_partials`), one SUM all-reduce of ``[N, 4]``; the statistics follow as in
  the unfused op.
* backward: for each block, recompute ``z``, turn it into ``dz`` in place (same formula and
  kernels as the op), then ``dh_blk = dz W`` and ``dW += dz^T h_blk`` (accumulated in the
  weight's dtype, as Liger's fused linear cross entropy does: a bf16 weight gets one rounding
  per block). ``dh`` is summed over the TP group (all-reduce), or reduce-scattered back to
  the sequence shards with sequence parallelism: what megatron's input mappings do.

Sequence parallelism: ``hidden`` is this rank's sequence shard ``[S/TP, ...]`` and is
all-gathered along dim 0 (and again in backward, instead of being saved gathered), so
``target`` has the gathered leading shape.

Memory beyond inputs, outputs and the weight gradient: one block of logits (``b x V/TP`` in
the hidden dtype, plus the eager path's fp32 temporaries of the same block), the gathered
hidden states under sequence parallelism, and a few fp32 scalars per token; independent of
``N`` for a fixed block.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from reco_megatron.algo.token_stats import TokenStats
from reco_megatron.parallel.vocab_stats import statistics_from_partials
from reco_megatron.parallel.vocab_stats_kernels import (
    Implementation,
    combine_partials,
    gradient_coefficient,
    kernels,
    resolve,
)

DEFAULT_BLOCK_ELEMENTS = {"cpu": 1 << 22, "cuda": 1 << 27}
"""Logits per block: 16 MiB of fp32 on CPU; 256 MiB of bf16 on CUDA (~1K tokens at 128K)."""


def _gather(hidden: torch.Tensor, group, tp_size: int) -> torch.Tensor:
    parts = [torch.empty_like(hidden) for _ in range(tp_size)]
    dist.all_gather(parts, hidden.contiguous(), group=group)
    return torch.cat(parts, dim=0)


def _block_partials(
    implementation: str,
    logits: torch.Tensor,
    target_local: torch.Tensor,
    in_shard: torch.Tensor,
    valid: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``m_local [b]`` and ``[b, 4]`` (S, T, Q relative to it, raw target logit)."""
    if implementation == "triton":
        from reco_megatron.parallel import vocab_stats_triton

        return vocab_stats_triton.local_partials(logits, target_local, valid)
    n = logits.shape[0]
    dtype = torch.promote_types(logits.dtype, torch.float32)
    if valid == 0:
        return torch.full((n,), float("-inf"), dtype=dtype, device=logits.device), torch.zeros(
            n, 4, dtype=dtype, device=logits.device
        )
    z = logits[:, :valid]
    m_local = z.amax(dim=-1).to(dtype)
    safe = target_local.clamp(min=0)
    part = kernels(implementation)[0](z, m_local, safe, in_shard)
    raw = z.gather(-1, safe.unsqueeze(-1)).squeeze(-1).to(dtype)
    part[:, 3] = torch.where(in_shard, raw, torch.zeros_like(raw))
    return m_local, part


def _block_gradient(
    implementation: str,
    logits: torch.Tensor,
    target_local: torch.Tensor,
    in_shard: torch.Tensor,
    valid: int,
    lse: torch.Tensor,
    entropy: torch.Tensor,
    sum_p2: torch.Tensor,
    grads: tuple[torch.Tensor | None, ...],
) -> torch.Tensor:
    """``dz`` of one block, written over ``logits`` (a temporary here)."""
    if implementation == "triton":
        from reco_megatron.parallel import vocab_stats_triton

        coef = gradient_coefficient(lse, entropy, sum_p2, *grads)
        return vocab_stats_triton.gradient(
            logits, target_local, lse, coef, *grads, n_valid=valid, inplace=True
        )
    if valid > 0:
        safe = target_local.clamp(min=0)
        logits[:, :valid] = kernels(implementation)[1](
            logits[:, :valid], lse, entropy, sum_p2, safe, in_shard, *grads
        )
    logits[:, valid:] = 0
    return logits


class _LinearStats(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx,
        hidden: torch.Tensor,  # [n_local, H]
        weight: torch.Tensor,  # [V_local, H]
        target: torch.Tensor,  # [N] global ids
        vocab_start: int,
        valid: int,
        block: int,
        group,
        tp_size: int,
        sequence_parallel: bool,
        implementation: str,
    ):
        full = _gather(hidden, group, tp_size) if sequence_parallel else hidden
        n_tokens = full.shape[0]
        local_target = target - vocab_start
        in_shard = (local_target >= 0) & (local_target < valid) & (target >= 0)
        target_local = torch.where(in_shard, local_target, torch.full_like(local_target, -1))
        dtype = torch.promote_types(full.dtype, torch.float32)
        local_max = torch.empty(n_tokens, dtype=dtype, device=full.device)
        local = torch.empty(n_tokens, 4, dtype=dtype, device=full.device)
        for start in range(0, n_tokens, block):
            sl = slice(start, min(start + block, n_tokens))
            logits = torch.matmul(full[sl], weight.t())
            local_max[sl], local[sl] = _block_partials(
                implementation, logits, target_local[sl], in_shard[sl], valid
            )
            del logits
        global_max = local_max.clone()
        if tp_size > 1:
            dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=group)
        partials = combine_partials(local_max, local, global_max, in_shard)
        if tp_size > 1:
            dist.all_reduce(partials, op=dist.ReduceOp.SUM, group=group)
        logprob, entropy, sum_p2, lse = statistics_from_partials(partials, global_max, target)
        ignored = target < 0
        ctx.save_for_backward(hidden, weight, target_local, in_shard, ignored, lse, entropy, sum_p2)
        ctx.meta = (valid, block, group, tp_size, sequence_parallel, implementation)
        ctx.set_materialize_grads(False)
        return logprob, entropy, sum_p2

    @staticmethod
    def backward(ctx, g_logprob, g_entropy, g_sum_p2):  # type: ignore[override]
        hidden, weight, target_local, in_shard, ignored, lse, entropy, sum_p2 = ctx.saved_tensors
        valid, block, group, tp_size, sequence_parallel, implementation = ctx.meta
        if g_logprob is not None:  # an ignored position's logprob is the constant 0
            g_logprob = g_logprob.masked_fill(ignored, 0.0)
        full = _gather(hidden, group, tp_size) if sequence_parallel else hidden
        grad_full = torch.zeros_like(full)
        grad_weight = torch.zeros_like(weight)
        grads = tuple(
            None if g is None else g.to(lse.dtype) for g in (g_logprob, g_entropy, g_sum_p2)
        )
        if any(g is not None for g in grads):
            for start in range(0, full.shape[0], block):
                sl = slice(start, min(start + block, full.shape[0]))
                logits = torch.matmul(full[sl], weight.t())
                dz = _block_gradient(
                    implementation,
                    logits,
                    target_local[sl],
                    in_shard[sl],
                    valid,
                    lse[sl],
                    entropy[sl],
                    sum_p2[sl],
                    tuple(None if g is None else g[sl].contiguous() for g in grads),
                )
                torch.matmul(dz, weight, out=grad_full[sl])
                grad_weight.addmm_(dz.t(), full[sl])
                del logits, dz
        if tp_size > 1:
            dist.all_reduce(grad_full, group=group)
        if sequence_parallel:
            rank = dist.get_rank(group)
            grad_full = grad_full.narrow(0, rank * hidden.shape[0], hidden.shape[0]).clone()
        return grad_full, grad_weight, *(None,) * 8


def vocab_parallel_linear_stats(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    vocab_size: int,
    tp_group: dist.ProcessGroup | None = None,
    sequence_parallel: bool = False,
    block_tokens: int | None = None,
    implementation: Implementation = "auto",
) -> TokenStats:
    """log p, entropy and sum p^2 of ``softmax(hidden @ weight^T)`` over the vocabulary shards.

    Args:
        hidden: ``[..., H]`` the output layer's input (with ``sequence_parallel``, this rank's
            shard of dim 0, which is all-gathered).
        weight: ``[V/TP, H]`` this rank's rows of the output layer (``ColumnParallelLinear``
            weight, or the tied embedding's), rank ``r`` holding global rows
            ``[r V/TP, (r+1) V/TP)``; rows at or above ``vocab_size`` are padding.
        target: ``[...]`` global token ids (gathered leading shape under sequence
            parallelism); negative ids are ignored positions.
        vocab_size: the true vocabulary size.
        tp_group: the tensor-parallel group (``None``: no tensor parallelism).
        sequence_parallel: ``hidden`` is sharded over dim 0 across ``tp_group``.
        block_tokens: tokens whose logits exist at a time. Default: ``2^22`` (CPU) or
            ``2^27`` (CUDA) logits per block.
        implementation: the statistics kernels, as in :func:`vocab_parallel_stats`.

    Returns:
        :class:`TokenStats` shaped like ``target``; gradients flow into ``hidden`` and
        ``weight``.
    """
    tp_size = 1 if tp_group is None else dist.get_world_size(tp_group)
    tp_rank = 0 if tp_group is None else dist.get_rank(tp_group)
    if hidden.shape[-1] != weight.shape[-1] or weight.dim() != 2:
        raise ValueError(
            f"hidden {tuple(hidden.shape)} and weight {tuple(weight.shape)} must share the "
            "hidden size: weight is [V/TP, H], hidden [..., H]"
        )
    if hidden.dtype != weight.dtype:
        raise TypeError(
            f"hidden is {hidden.dtype} but weight is {weight.dtype}: cast hidden to the "
            "weight's dtype (wrappers such as megatron's Float16Module upcast the model output)"
        )
    if sequence_parallel and tp_size == 1:
        raise ValueError("sequence_parallel=True needs a tensor-parallel group of size > 1")
    lead = (hidden.shape[0] * (tp_size if sequence_parallel else 1), *hidden.shape[1:-1])
    if tuple(target.shape) != lead:
        raise ValueError(
            f"target {tuple(target.shape)} must have the (gathered) leading shape {lead} of "
            f"hidden {tuple(hidden.shape)}"
        )
    vocab_local = weight.shape[0]
    if not 0 < vocab_size <= vocab_local * tp_size:
        raise ValueError(
            f"vocab_size={vocab_size} does not fit {tp_size} shard(s) of {vocab_local} rows"
        )
    flat_target = target.reshape(-1).long()
    if flat_target.numel() and int(flat_target.max()) >= vocab_size:
        raise ValueError(f"target contains an id >= vocab_size={vocab_size}")
    vocab_start = tp_rank * vocab_local
    valid = max(0, min(vocab_local, vocab_size - vocab_start))
    resolved = resolve(implementation, hidden)
    if resolved == "triton":
        from reco_megatron.parallel import vocab_stats_triton

        vocab_stats_triton.check_device(hidden)
    if block_tokens is None:
        elements = DEFAULT_BLOCK_ELEMENTS["cuda" if hidden.is_cuda else "cpu"]
        block_tokens = max(1, elements // max(1, vocab_local))
    if block_tokens < 1:
        raise ValueError(f"block_tokens must be positive, got {block_tokens}")
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    logprob, entropy, sum_p2 = _LinearStats.apply(
        flat_hidden,
        weight,
        flat_target,
        vocab_start,
        valid,
        block_tokens,
        tp_group,
        tp_size,
        sequence_parallel,
        resolved,
    )
    shape = target.shape
    return TokenStats(logprob.view(shape), entropy.view(shape), sum_p2.view(shape))
