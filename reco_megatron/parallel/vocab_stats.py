"""Per-token log-prob, entropy and sum of squared probabilities from vocabulary-sharded logits.

With tensor parallelism megatron's output layer (``parallel_output=True``) leaves each TP rank
with a shard ``[..., V/TP]`` of the logits. The ReCo loss needs three per-token statistics of
``p = softmax(z)`` over the *true* vocabulary (megatron pads it; padded columns are excluded):

* ``logprob = z_t - logsumexp(z)``   (the policy gradient)
* ``entropy = -sum_v p_v log p_v``     (metrics, the optional entropy bonus)
* ``sum_p2  = sum_v p_v^2``            (ReCo's categorical variance ``1 - sum_p2``)

All three come from four per-token partial sums over the local shard, after one shared max:
with ``e_v = exp(z_v - m)``, ``S = sum e``, ``T = sum e (z - m)``, ``Q = sum e^2`` and the
target logit ``z_t - m``:  ``logprob = (z_t - m) - log S``, ``entropy = log S - T / S``,
``sum_p2 = Q / S^2``. The forward therefore does exactly **one MAX all-reduce** (of ``[N]``)
and **one SUM all-reduce** (of ``[N, 4]``) for the whole input, whatever the chunking. The
backward needs no collective, since each rank's gradient only involves its own columns and
per-token scalars already reduced in the forward:

    d logprob / dz = onehot(t) - p
    d entropy / dz = -p (log p + H)
    d sum_p2  / dz = 2 p (p - sum_p2)

Memory: the op saves the caller's logits (alive anyway in the autograd graph) and four fp32
scalars per token; it never materialises an fp32 copy of the whole shard nor a softmax. Logits
are upcast to fp32 one chunk of ``chunk_size`` tokens at a time, in the forward and again in
the backward (recompute is cheaper than keeping ``p``). The caller's logits are never
modified (megatron's own cross entropy subtracts the max in place on fp32 input).

Targets: ids in ``[0, vocab_size)``; a negative id marks an ignored position (its ``logprob``
is 0 and gets no gradient; ``entropy`` and ``sum_p2`` are still computed). Ids at or above
``vocab_size`` are an error.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from reco_megatron.algo.token_stats import TokenStats
from reco_megatron.parallel.vocab_stats_kernels import Implementation, kernels

DEFAULT_CHUNK_ELEMENTS = 1 << 22
"""Default chunk: this many logits (16 MiB of fp32 per temporary) are upcast at a time."""


def _group_size_and_rank(tp_group: dist.ProcessGroup | None) -> tuple[int, int]:
    if tp_group is None:
        return 1, 0
    return dist.get_world_size(tp_group), dist.get_rank(tp_group)


def _chunk_tokens(chunk_size: int | None, vocab_local: int) -> int:
    if chunk_size is None:
        return max(1, DEFAULT_CHUNK_ELEMENTS // max(1, vocab_local))
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive number of tokens, got {chunk_size}")
    return chunk_size


class _VocabParallelStats(torch.autograd.Function):
    """Autograd wrapper: the two all-reduces live here, the math in the static helpers."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx,
        logits: torch.Tensor,  # [N, V_local]
        target: torch.Tensor,  # [N] global ids, < 0 ignored
        vocab_start: int,
        valid_local: int,
        chunk: int,
        tp_group: dist.ProcessGroup | None,
        distributed: bool,
        implementation: Implementation,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        forward_partials, backward_grad = kernels(implementation, logits.device)
        n_tokens = logits.shape[0]
        compute_dtype = torch.promote_types(logits.dtype, torch.float32)  # fp64 stays fp64
        valid = logits[:, :valid_local]
        local_target = target - vocab_start
        in_shard = (local_target >= 0) & (local_target < valid_local) & (target >= 0)
        safe_target = torch.where(in_shard, local_target, torch.zeros_like(local_target))

        # Max over the valid columns, in the input dtype (exact), then fp32.
        if valid_local > 0:
            logits_max = valid.amax(dim=-1).to(compute_dtype)
        else:
            logits_max = torch.full(
                (n_tokens,), float("-inf"), dtype=compute_dtype, device=logits.device
            )
        if distributed:
            dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=tp_group)

        partials = torch.zeros(n_tokens, 4, dtype=compute_dtype, device=logits.device)
        if valid_local > 0:
            for start in range(0, n_tokens, chunk):
                sl = slice(start, min(start + chunk, n_tokens))
                partials[sl] = forward_partials(
                    valid[sl], logits_max[sl], safe_target[sl], in_shard[sl]
                )
        if distributed:
            dist.all_reduce(partials, op=dist.ReduceOp.SUM, group=tp_group)

        sum_exp, sum_exp_shifted, sum_exp_sq, target_shifted = partials.unbind(-1)
        log_sum_exp = sum_exp.log()
        ignored = target < 0
        logprob = torch.where(ignored, torch.zeros_like(log_sum_exp), target_shifted - log_sum_exp)
        entropy = log_sum_exp - sum_exp_shifted / sum_exp
        sum_p2 = sum_exp_sq / (sum_exp * sum_exp)
        lse = logits_max + log_sum_exp

        ctx.save_for_backward(logits, safe_target, in_shard, ignored, lse, entropy, sum_p2)
        ctx.valid_local = valid_local
        ctx.chunk = chunk
        ctx.backward_grad = backward_grad
        ctx.set_materialize_grads(False)
        return logprob, entropy, sum_p2

    @staticmethod
    def backward(  # type: ignore[override]
        ctx,
        grad_logprob: torch.Tensor | None,
        grad_entropy: torch.Tensor | None,
        grad_sum_p2: torch.Tensor | None,
    ):
        logits, safe_target, in_shard, ignored, lse, entropy, sum_p2 = ctx.saved_tensors
        valid_local, chunk = ctx.valid_local, ctx.chunk
        if grad_logprob is not None:  # an ignored position's logprob is the constant 0
            grad_logprob = grad_logprob.masked_fill(ignored, 0.0)
        grad_logits = torch.zeros_like(logits)
        if valid_local > 0 and not (
            grad_logprob is None and grad_entropy is None and grad_sum_p2 is None
        ):
            n_tokens = logits.shape[0]
            for start in range(0, n_tokens, chunk):
                end = min(start + chunk, n_tokens)
                sl = slice(start, end)
                grad_logits[sl, :valid_local] = ctx.backward_grad(
                    logits[sl, :valid_local],
                    lse[sl],
                    entropy[sl],
                    sum_p2[sl],
                    safe_target[sl],
                    in_shard[sl],
                    None if grad_logprob is None else grad_logprob[sl],
                    None if grad_entropy is None else grad_entropy[sl],
                    None if grad_sum_p2 is None else grad_sum_p2[sl],
                )
        return grad_logits, None, None, None, None, None, None, None


def vocab_parallel_stats(
    logits: torch.Tensor,
    target: torch.Tensor,
    vocab_size: int,
    tp_group: dist.ProcessGroup | None = None,
    chunk_size: int | None = None,
    implementation: Implementation = "auto",
) -> TokenStats:
    """Log-prob of ``target``, entropy and ``sum p^2`` from this rank's vocabulary shard.

    Args:
        logits: ``[..., V/TP]`` local shard (bf16, fp16 or fp32), as produced by megatron's
            output layer with ``parallel_output=True``. Rank ``r`` of ``tp_group`` holds global
            columns ``[r * V/TP, (r + 1) * V/TP)``. Never modified.
        target: ``[...]`` global token ids; negative ids mark ignored positions.
        vocab_size: the true vocabulary size; columns at or above it are megatron's padding
            and are excluded from every statistic.
        tp_group: the tensor-parallel group the vocabulary is split over. ``None`` means no
            tensor parallelism (``logits`` holds the whole vocabulary); never read from
            global state.
        chunk_size: tokens upcast to fp32 at a time. Default: ``2**22 / V_local`` tokens.
        implementation: ``eager`` PyTorch ops, ``compiled`` (``torch.compile`` fuses each
            chunk into one pass over the logits), or ``auto`` (compiled on CUDA, eager on CPU).

    Returns:
        :class:`TokenStats` of fp32 tensors (fp64 for fp64 logits) shaped like ``target``.
        Gradients flow into ``logits`` from any combination of the three; an unused output
        costs nothing.
    """
    if logits.dim() < 1 or logits.shape[:-1] != target.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} must be target {tuple(target.shape)} plus a "
            "trailing vocabulary dimension"
        )
    if logits.is_floating_point() is False:
        raise TypeError(f"logits must be floating point, got {logits.dtype}")
    if target.is_floating_point():
        raise TypeError(f"target must hold integer token ids, got {target.dtype}")
    tp_size, tp_rank = _group_size_and_rank(tp_group)
    vocab_local = logits.shape[-1]
    if not 0 < vocab_size <= vocab_local * tp_size:
        raise ValueError(
            f"vocab_size={vocab_size} does not fit {tp_size} shard(s) of {vocab_local} "
            f"columns (padded vocabulary {vocab_local * tp_size}); pass the true vocabulary "
            "size and the tensor-parallel group the logits are split over"
        )
    flat_target = target.reshape(-1).long()
    if flat_target.numel() == 0:
        # Zeros that keep the graph connected, so an empty micro-batch still backpropagates.
        empty = logits.sum(-1).to(torch.promote_types(logits.dtype, torch.float32)) * 0.0
        return TokenStats(empty, empty.clone(), empty.clone())
    # Checked before any communication; the targets are identical on every TP rank.
    largest = int(flat_target.max())
    if largest >= vocab_size:
        raise ValueError(
            f"target contains token id {largest} >= vocab_size={vocab_size}; targets must "
            "be true-vocabulary ids (use a negative id to ignore a position)"
        )
    vocab_start = tp_rank * vocab_local
    valid_local = max(0, min(vocab_local, vocab_size - vocab_start))
    flat_logits = logits.reshape(-1, vocab_local)
    logprob, entropy, sum_p2 = _VocabParallelStats.apply(
        flat_logits,
        flat_target,
        vocab_start,
        valid_local,
        _chunk_tokens(chunk_size, vocab_local),
        tp_group,
        tp_size > 1,
        implementation,
    )
    shape = target.shape
    return TokenStats(logprob.view(shape), entropy.view(shape), sum_p2.view(shape))
