"""The output layer and the statistics in one op that never materialises the logits.

``vocab_parallel_linear_stats(hidden, weight, target, vocab_size, tp_group)`` equals megatron's
``ColumnParallelLinear(parallel_output=True)`` (no bias) followed by
:func:`reco_megatron.parallel.vocab_parallel_stats`, but computes the logits block by block:

* forward: for each block of ``b`` tokens, ``z = h_blk W^T`` (``[b, V/TP]`` in the hidden
  dtype: a bf16 matmul accumulates in fp32 and rounds once, as the unfused layer does), then
  the block's statistics (:func:`vocab_stats_passes.statistics`: the Triton kernels or the
  eager math, with the MAX and SUM all-reduces of the block's ``[b]`` / ``[b, 4]``).
* backward: for each block, recompute ``z``, turn it into ``dz`` in place (same formula and
  kernels as the op), then ``dh_blk = dz W`` and ``dW += dz^T h_blk`` (accumulated in the
  weight's dtype, as Liger's fused linear cross entropy does: a bf16 weight gets one rounding
  per block). ``dh`` is summed over the TP group (all-reduce), and under sequence parallelism
  each rank keeps its shard of the sum (all-reduce + slice: megatron reduce-scatters, which
  gloo lacks).

That is 4 matmuls (the forward one twice). When the statistics feed a loss computed right
away, :mod:`linear_loss` does the backward inside the forward: 3 matmuls.

Sequence parallelism: ``hidden`` is this rank's sequence shard ``[S/TP, ...]`` and is
all-gathered along dim 0 (and again in backward, instead of being saved gathered), so
``target`` has the gathered leading shape.

Memory beyond inputs, outputs and the weight gradient: one block of logits (``b x V/TP`` in
the hidden dtype, plus the eager path's fp32 temporaries of the same block), the gathered
hidden states under sequence parallelism, and a few fp32 scalars per token; independent of
``N`` for a fixed block.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from reco_megatron.algo.token_stats import TokenStats
from reco_megatron.parallel import vocab_stats_passes as passes
from reco_megatron.parallel.vocab_stats_kernels import Implementation, resolve

DEFAULT_BLOCK_ELEMENTS = {"cpu": 1 << 22, "cuda": 1 << 27}
"""Logits per block: 16 MiB of fp32 on CPU; 256 MiB of bf16 on CUDA (~1K tokens at 128K)."""


@dataclass(frozen=True)
class Layout:
    """Where this rank's shard sits and how the tokens are blocked (checked inputs)."""

    vocab_start: int
    valid: int
    vocab_size: int
    block: int
    group: Any
    tp_size: int
    sequence_parallel: bool
    implementation: str

    def gather(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[n, H]`` -> ``[N, H]``: all sequence shards, along dim 0 (identity without SP)."""
        if not self.sequence_parallel:
            return hidden
        parts = [torch.empty_like(hidden) for _ in range(self.tp_size)]
        dist.all_gather(parts, hidden.contiguous(), group=self.group)
        return torch.cat(parts, dim=0)

    def reduce_hidden_grad(self, grad_full: torch.Tensor, n_local: int) -> torch.Tensor:
        """Sum ``dh [N, H]`` over the TP group; under SP keep this rank's rows."""
        if self.tp_size > 1:
            dist.all_reduce(grad_full, group=self.group)
        if self.sequence_parallel:
            rank = dist.get_rank(self.group)
            grad_full = grad_full.narrow(0, rank * n_local, n_local).clone()
        return grad_full

    def shard(self, n_tokens: int) -> passes.Shard:
        """The statistics' view of this shard for a block of ``n_tokens`` (one chunk)."""
        return passes.Shard(
            implementation=self.implementation,
            vocab_start=self.vocab_start,
            valid_local=self.valid,
            vocab_size=self.vocab_size,
            chunk=n_tokens,
            tp_group=self.group,
            distributed=self.tp_size > 1,
        )

    def block_statistics(self, logits: torch.Tensor, target: torch.Tensor):
        """``logprob, entropy, sum_p2, lse`` of one block's logits ``[b, V/TP]``."""
        return passes.statistics(logits, target, self.shard(logits.shape[0]))

    def block_gradient(self, logits, target, lse, entropy, sum_p2, grads) -> torch.Tensor:
        """``dz`` of one block, written over ``logits`` (a temporary)."""
        shard = self.shard(logits.shape[0])
        return passes.gradient(logits, target, lse, entropy, sum_p2, grads, shard, inplace=True)

    def blocks(self, n_tokens: int):
        """Slices of ``block`` tokens covering ``[0, n_tokens)``."""
        for start in range(0, n_tokens, self.block):
            yield slice(start, min(start + self.block, n_tokens))


def prepare(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    vocab_size: int,
    tp_group: Any,
    sequence_parallel: bool,
    block_tokens: int | None,
    implementation: Implementation,
) -> tuple[Layout, torch.Tensor, torch.Tensor]:
    """Check the inputs of a fused output layer; ``(layout, hidden [n, H], target [N])``."""
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
    if target.is_floating_point():
        raise TypeError(f"target must hold integer token ids, got {target.dtype}")
    flat_target = target.reshape(-1).long()
    passes.check_targets(flat_target, vocab_size)
    vocab_start = tp_rank * vocab_local
    resolved = resolve(implementation, hidden)
    if resolved == "triton":
        from reco_megatron.parallel import vocab_stats_triton

        vocab_stats_triton.check_device(hidden)
    if block_tokens is None:
        elements = DEFAULT_BLOCK_ELEMENTS["cuda" if hidden.is_cuda else "cpu"]
        block_tokens = max(1, elements // max(1, vocab_local))
    if block_tokens < 1:
        raise ValueError(f"block_tokens must be positive, got {block_tokens}")
    layout = Layout(
        vocab_start=vocab_start,
        valid=max(0, min(vocab_local, vocab_size - vocab_start)),
        vocab_size=vocab_size,
        block=block_tokens,
        group=tp_group,
        tp_size=tp_size,
        sequence_parallel=sequence_parallel,
        implementation=resolved,
    )
    return layout, hidden.reshape(-1, hidden.shape[-1]), flat_target


class _LinearStats(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, target, layout: Layout):  # type: ignore[override]
        full = layout.gather(hidden)
        n_tokens = full.shape[0]
        dtype = torch.promote_types(full.dtype, torch.float32)
        out = [torch.empty(n_tokens, dtype=dtype, device=full.device) for _ in range(4)]
        for sl in layout.blocks(n_tokens):
            logits = torch.matmul(full[sl], weight.t())
            for row, value in zip(out, layout.block_statistics(logits, target[sl]), strict=True):
                row[sl] = value
            del logits
        logprob, entropy, sum_p2, lse = out
        ctx.save_for_backward(hidden, weight, target, lse, entropy, sum_p2)
        ctx.layout = layout
        ctx.set_materialize_grads(False)
        return logprob, entropy, sum_p2

    @staticmethod
    def backward(ctx, g_logprob, g_entropy, g_sum_p2):  # type: ignore[override]
        hidden, weight, target, lse, entropy, sum_p2 = ctx.saved_tensors
        layout: Layout = ctx.layout
        full = layout.gather(hidden)
        grad_full = torch.zeros_like(full)
        grad_weight = torch.zeros_like(weight)
        grads = tuple(
            None if g is None else g.to(lse.dtype) for g in (g_logprob, g_entropy, g_sum_p2)
        )
        if any(g is not None for g in grads):
            for sl in layout.blocks(full.shape[0]):
                logits = torch.matmul(full[sl], weight.t())
                block_grads = tuple(None if g is None else g[sl].contiguous() for g in grads)
                dz = layout.block_gradient(
                    logits, target[sl], lse[sl], entropy[sl], sum_p2[sl], block_grads
                )
                torch.matmul(dz, weight, out=grad_full[sl])
                torch.addmm(grad_weight, dz.t(), full[sl], out=grad_weight)
                del logits, dz
        return layout.reduce_hidden_grad(grad_full, hidden.shape[0]), grad_weight, None, None


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
    layout, flat_hidden, flat_target = prepare(
        hidden,
        weight,
        target,
        vocab_size,
        tp_group,
        sequence_parallel,
        block_tokens,
        implementation,
    )
    logprob, entropy, sum_p2 = _LinearStats.apply(flat_hidden, weight, flat_target, layout)
    shape = target.shape
    return TokenStats(logprob.view(shape), entropy.view(shape), sum_p2.view(shape))
