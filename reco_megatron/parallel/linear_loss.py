"""Output layer, statistics and a token-separable loss in one op: 3 matmuls, no logits.

``vocab_parallel_linear_loss(hidden, weight, target, loss_fn, vocab_size, tp_group)`` returns
``loss_fn`` of the per-token statistics of ``softmax(hidden @ weight^T)`` (log p of the target,
entropy, sum p^2, as :func:`vocab_parallel_linear_stats` computes them) and the statistics
themselves, detached. Because the loss is the last op, its whole backward can run inside the
forward, block of ``b`` tokens by block:

1. ``z = h_blk W^T`` (matmul 1, ``[b, V/TP]`` in the hidden dtype) and the block's statistics
   (:func:`vocab_stats_passes.statistics`, with the MAX and SUM all-reduces of ``[b]`` and
   ``[b, 4]`` under tensor parallelism);
2. the upstream gradients ``gL, gH, gQ`` of the block's tokens: autograd of ``loss_fn`` on
   ``[N]`` statistics whose block entries are fresh leaves (the others hold the values of the
   blocks before and ``fill`` after, detached);
3. ``dz`` written over ``z`` (the same kernels as the op's backward);
4. ``dh_blk = dz W`` (matmul 2, written once) and ``dW += dz^T h_blk`` (matmul 3, accumulated
   in the weight's dtype as Liger's fused linear cross entropy does).

After the blocks, ``dh`` is summed over the TP group (under sequence parallelism each rank
keeps its shard of the sum) and the loss value is ``loss_fn`` of all statistics (no grad).
The returned loss's backward only scales the stored ``dh`` and ``dW`` by ``grad_output``:
3 matmuls in all, against 4 for :func:`vocab_parallel_linear_stats` followed by a loss (its
backward recomputes ``z``) and 3 plus a logits-sized buffer for the unfused layer.

**The loss must be token-separable**: a sum over tokens of terms that each depend on their
own token's statistics only (per-token data and global constants are fine: every policy loss
of :func:`reco_megatron.algo.policy_loss`, whatever the aggregation, since the global token /
sequence counts are passed in). Then step 2 gives each token's exact gradient whatever the
other entries hold. A loss that normalises by a statistic of other tokens (a batch mean of
the entropy, say) is not, and needs :func:`vocab_parallel_linear_stats`.

Memory beyond inputs, outputs and the gradients of ``hidden`` and ``weight`` (which this op
computes in its forward and keeps until its backward, where megatron calls it immediately):
one block of logits (``b x V/TP`` in the hidden dtype; plus fp32 temporaries of a block on the
eager path), the gathered hidden states under sequence parallelism, and a few fp32 ``[N]``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from reco_megatron.algo.token_stats import TokenStats
from reco_megatron.parallel.linear_stats import Layout, prepare
from reco_megatron.parallel.vocab_stats_kernels import Implementation

LossFn = Callable[[TokenStats], torch.Tensor]
"""``loss_fn(stats) -> 0-d tensor``, ``stats`` of shape ``[N]`` (the flattened target)."""


def _block_upstream(
    loss_fn: LossFn, known: list[torch.Tensor], block: list[torch.Tensor], sl: slice
) -> tuple[torch.Tensor | None, ...]:
    """``d loss / d (logprob, entropy, sum_p2)`` of the block's tokens (``None``: unused)."""
    leaves = [b.detach().requires_grad_() for b in block]
    with torch.enable_grad():
        live = [
            torch.cat((k[: sl.start], leaf, k[sl.stop :]))
            for k, leaf in zip(known, leaves, strict=True)
        ]
        loss = loss_fn(TokenStats(*live))
        if not loss.requires_grad:  # nothing in the loss depends on the statistics
            return (None, None, None)
        grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    return tuple(
        None if g is None else g.to(b.dtype).contiguous() for g, b in zip(grads, block, strict=True)
    )


class _LinearLoss(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx,
        hidden: torch.Tensor,  # [n_local, H]
        weight: torch.Tensor,  # [V_local, H]
        target: torch.Tensor,  # [N] global ids
        loss_fn: LossFn,
        fill: list[torch.Tensor],  # 3 x [N] fp32
        layout: Layout,
        with_grad: bool,
    ):
        full = layout.gather(hidden)
        n_tokens = full.shape[0]
        known = [f.clone() for f in fill]  # filled in block by block
        grad_full = torch.empty_like(full) if with_grad else None
        grad_weight = torch.zeros_like(weight) if with_grad else None
        for sl in layout.blocks(n_tokens):
            logits = torch.matmul(full[sl], weight.t())  # matmul 1
            *block, lse = layout.block_statistics(logits, target[sl])
            if with_grad:
                grads = _block_upstream(loss_fn, known, block, sl)
                dz = layout.block_gradient(logits, target[sl], lse, block[1], block[2], grads)
                torch.mm(dz, weight, out=grad_full[sl])  # matmul 2
                torch.addmm(grad_weight, dz.t(), full[sl], out=grad_weight)  # matmul 3
            for k, b in zip(known, block, strict=True):
                k[sl] = b
            del logits
        with torch.no_grad():
            loss = loss_fn(TokenStats(*known)).detach()
            loss = loss.to(torch.promote_types(loss.dtype, torch.float32))
        # The gradients are intermediates handed out once: kept on ctx, not saved tensors.
        ctx.grads = None
        if with_grad:
            ctx.grads = (layout.reduce_hidden_grad(grad_full, hidden.shape[0]), grad_weight)
        ctx.mark_non_differentiable(*known)
        return (loss, *known)

    @staticmethod
    def backward(ctx, grad_loss, *_):  # type: ignore[override]
        if ctx.grads is None:
            raise RuntimeError(
                "vocab_parallel_linear_loss computes its gradients in the forward and hands "
                "them out once: it does not support a second backward (retain_graph)"
            )
        grad_hidden, grad_weight = ctx.grads
        ctx.grads = None  # the same buffers are handed out, scaled in place
        if grad_loss is None:
            return (None,) * 7
        scale = grad_loss.to(grad_hidden.dtype)
        return grad_hidden.mul_(scale), grad_weight.mul_(scale.to(grad_weight.dtype)), *(None,) * 5


def vocab_parallel_linear_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    loss_fn: LossFn,
    vocab_size: int,
    tp_group: dist.ProcessGroup | None = None,
    sequence_parallel: bool = False,
    block_tokens: int | None = None,
    implementation: Implementation = "auto",
    fill: TokenStats | None = None,
) -> tuple[torch.Tensor, TokenStats]:
    """``loss_fn`` of the statistics of ``softmax(hidden @ weight^T)``, with 3 matmuls.

    Args:
        hidden, weight, target, vocab_size, tp_group, sequence_parallel, block_tokens,
            implementation: as in :func:`vocab_parallel_linear_stats` (``target [...]`` has
            the gathered leading shape of ``hidden`` under sequence parallelism).
        loss_fn: ``loss_fn(TokenStats) -> 0-d tensor`` on statistics of shape ``[N]`` (the
            flattened ``target``), **token-separable** (see the module docstring). Called
            once per block with gradients enabled, then once on all statistics for the value.
            Must give the same value on every rank of ``tp_group``.
        fill: ``[N]`` values the not-yet-computed entries hold while a block's gradients are
            taken (the loss must stay finite there; default 0 for all three). For a policy
            loss the old log-probs are a natural choice.

    Returns:
        ``(loss, stats)``: the 0-d fp32 loss (gradients flow into ``hidden`` and ``weight``)
        and the statistics shaped like ``target``, detached.
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
    n_tokens = flat_target.numel()
    if fill is None:
        zeros = torch.zeros(n_tokens, dtype=torch.float32, device=hidden.device)
        fill_list = [zeros, zeros, zeros]
    else:
        fill_list = [f.detach().reshape(-1).float() for f in fill]
        if any(f.numel() != n_tokens for f in fill_list):
            raise ValueError(
                f"fill must hold {n_tokens} values per statistic (the target's shape "
                f"{tuple(target.shape)}), got {[f.numel() for f in fill_list]}"
            )
    if hidden.dtype == torch.float64:
        fill_list = [f.double() for f in fill_list]
    with_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    loss, *stats = _LinearLoss.apply(
        flat_hidden, weight, flat_target, loss_fn, fill_list, layout, with_grad
    )
    shape = target.shape
    return loss, TokenStats(*(s.view(shape) for s in stats))
