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

Memory: the op saves the caller's logits (alive anyway in the autograd graph) and a few fp32
scalars per token; it never materialises an fp32 copy of the whole shard nor a softmax. The
eager/compiled paths upcast one chunk of ``chunk_size`` tokens at a time, in the forward
(after a first pass for the max) and again in the backward (recompute is cheaper than keeping
``p``). The ``triton`` kernels read each logit once per direction with an online max (each
shard's sums are rescaled to the global max between the two all-reduces) and write the
gradient once. The caller's logits are modified only with ``inplace_backward`` (the gradient
then overwrites them; megatron's own cross entropy always works in place on fp32 input).

Targets: ids in ``[0, vocab_size)``; a negative id marks an ignored position (its ``logprob``
is 0 and gets no gradient; ``entropy`` and ``sum_p2`` are still computed). Ids at or above
``vocab_size`` are an error.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from reco_megatron.algo.token_stats import TokenStats
from reco_megatron.parallel.vocab_stats_kernels import (
    Implementation,
    combine_partials,
    gradient_coefficient,
    kernels,
    resolve,
)

DEFAULT_CHUNK_ELEMENTS = 1 << 22
"""Default chunk of the eager/compiled paths on CPU: this many logits (16 MiB of fp32 per
temporary) are upcast at a time."""
DEFAULT_CHUNK_ELEMENTS_CUDA = 1 << 25
"""Default chunk on CUDA (256 tokens at V = 128K): a GPU measurement (issue 14) found the CPU
default launch-bound there (50x from the bandwidth bound) and 2^25 within 1.3x of one chunk
at 1.09x peak memory. The ``triton`` implementation (the CUDA default) does not chunk."""


def _group_size_and_rank(tp_group: dist.ProcessGroup | None) -> tuple[int, int]:
    if tp_group is None:
        return 1, 0
    return dist.get_world_size(tp_group), dist.get_rank(tp_group)


def _chunk_tokens(chunk_size: int | None, vocab_local: int, device: torch.device) -> int:
    if chunk_size is None:
        elements = DEFAULT_CHUNK_ELEMENTS_CUDA if device.type == "cuda" else DEFAULT_CHUNK_ELEMENTS
        return max(1, elements // max(1, vocab_local))
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive number of tokens, got {chunk_size}")
    return chunk_size


def _local_partials_chunked(
    implementation: str,
    valid: torch.Tensor,
    safe_target: torch.Tensor,
    in_shard: torch.Tensor,
    chunk: int,
    tp_group: dist.ProcessGroup | None,
    distributed: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """eager/compiled: the max (pass 1, MAX all-reduce), then partials chunk by chunk."""
    forward_partials, _ = kernels(implementation)
    n_tokens, valid_local = valid.shape
    compute_dtype = torch.promote_types(valid.dtype, torch.float32)  # fp64 stays fp64
    if valid_local > 0:
        logits_max = valid.amax(dim=-1).to(compute_dtype)  # exact in the input dtype
    else:
        logits_max = torch.full(
            (n_tokens,), float("-inf"), dtype=compute_dtype, device=valid.device
        )
    if distributed:
        dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=tp_group)
    partials = torch.zeros(n_tokens, 4, dtype=compute_dtype, device=valid.device)
    if valid_local > 0:
        for start in range(0, n_tokens, chunk):
            sl = slice(start, min(start + chunk, n_tokens))
            partials[sl] = forward_partials(
                valid[sl], logits_max[sl], safe_target[sl], in_shard[sl]
            )
    return logits_max, partials


def _local_partials_triton(
    logits: torch.Tensor,
    target_local: torch.Tensor,
    in_shard: torch.Tensor,
    valid_local: int,
    tp_group: dist.ProcessGroup | None,
    distributed: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """triton: one read of the shard gives its own max and sums; rescaled after the MAX."""
    from reco_megatron.parallel import vocab_stats_triton as tk

    local_max, local = tk.local_partials(logits, target_local, valid_local)
    logits_max = local_max.clone()
    if distributed:
        dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=tp_group)
    return logits_max, combine_partials(local_max, local, logits_max, in_shard)


def statistics_from_partials(
    partials: torch.Tensor, logits_max: torch.Tensor, target: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``logprob, entropy, sum_p2, lse`` (each ``[N]``) from the all-reduced ``[N, 4]``
    partials relative to the global max ``m``: ``(z_t - m) - log S``, ``log S - T/S``,
    ``Q/S^2`` and ``m + log S``; ignored positions (``target < 0``) get ``logprob = 0``."""
    sum_exp, sum_exp_shifted, sum_exp_sq, target_shifted = partials.unbind(-1)
    log_sum_exp = sum_exp.log()
    logprob = torch.where(target < 0, torch.zeros_like(log_sum_exp), target_shifted - log_sum_exp)
    entropy = log_sum_exp - sum_exp_shifted / sum_exp
    sum_p2 = sum_exp_sq / (sum_exp * sum_exp)
    return logprob, entropy, sum_p2, logits_max + log_sum_exp


class _VocabParallelStats(torch.autograd.Function):
    """Autograd wrapper: the two all-reduces live here, the math in the kernel modules."""

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
        implementation: str,
        inplace_backward: bool,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        local_target = target - vocab_start
        in_shard = (local_target >= 0) & (local_target < valid_local) & (target >= 0)
        safe_target = torch.where(in_shard, local_target, torch.zeros_like(local_target))

        if implementation == "triton":
            target_local = torch.where(in_shard, local_target, torch.full_like(local_target, -1))
            logits_max, partials = _local_partials_triton(
                logits, target_local, in_shard, valid_local, tp_group, distributed
            )
            safe_target = target_local  # the backward kernel takes -1 for "not here"
        else:
            logits_max, partials = _local_partials_chunked(
                implementation,
                logits[:, :valid_local],
                safe_target,
                in_shard,
                chunk,
                tp_group,
                distributed,
            )
        if distributed:
            dist.all_reduce(partials, op=dist.ReduceOp.SUM, group=tp_group)

        logprob, entropy, sum_p2, lse = statistics_from_partials(partials, logits_max, target)
        ignored = target < 0

        ctx.save_for_backward(logits, safe_target, in_shard, ignored, lse, entropy, sum_p2)
        ctx.valid_local = valid_local
        ctx.chunk = chunk
        ctx.implementation = implementation
        ctx.inplace_backward = inplace_backward
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
        grads = (grad_logprob, grad_entropy, grad_sum_p2)
        if ctx.implementation == "triton":
            grad_logits = _backward_triton(ctx, logits, safe_target, lse, entropy, sum_p2, grads)
        else:
            grad_logits = logits.detach() if ctx.inplace_backward else torch.zeros_like(logits)
            if ctx.inplace_backward:
                grad_logits[:, valid_local:] = 0
            if valid_local > 0 and any(g is not None for g in grads):
                _, backward_grad = kernels(ctx.implementation)
                for start in range(0, logits.shape[0], chunk):
                    sl = slice(start, min(start + chunk, logits.shape[0]))
                    # The chunk is read before it is (maybe in place) overwritten.
                    grad_logits[sl, :valid_local] = backward_grad(
                        logits[sl, :valid_local],
                        lse[sl],
                        entropy[sl],
                        sum_p2[sl],
                        safe_target[sl],
                        in_shard[sl],
                        *(None if g is None else g[sl] for g in grads),
                    )
            elif ctx.inplace_backward:
                grad_logits.zero_()
        return grad_logits, None, None, None, None, None, None, None, None


def _backward_triton(ctx, logits, target_local, lse, entropy, sum_p2, grads) -> torch.Tensor:
    from reco_megatron.parallel import vocab_stats_triton as tk

    g_logprob, g_entropy, g_sum_p2 = grads
    if all(g is None for g in grads):
        return logits.detach().zero_() if ctx.inplace_backward else torch.zeros_like(logits)
    coef_a = gradient_coefficient(lse, entropy, sum_p2, g_logprob, g_entropy, g_sum_p2)
    grad = tk.gradient(
        logits,
        target_local,
        lse,
        coef_a,
        *(None if g is None else g.float().contiguous() for g in grads),
        n_valid=ctx.valid_local,
        inplace=ctx.inplace_backward,
    )
    if ctx.inplace_backward:
        # The kernel wrote through a raw pointer: bump the version counter so that any other
        # autograd node that saved these logits fails loudly instead of reading the gradient.
        torch.autograd.graph.increment_version(logits)
    return grad


def vocab_parallel_stats(
    logits: torch.Tensor,
    target: torch.Tensor,
    vocab_size: int,
    tp_group: dist.ProcessGroup | None = None,
    chunk_size: int | None = None,
    implementation: Implementation = "auto",
    inplace_backward: bool = False,
) -> TokenStats:
    """Log-prob of ``target``, entropy and ``sum p^2`` from this rank's vocabulary shard.

    Args:
        logits: ``[..., V/TP]`` local shard (bf16, fp16 or fp32), as produced by megatron's
            output layer with ``parallel_output=True``. Rank ``r`` of ``tp_group`` holds global
            columns ``[r * V/TP, (r + 1) * V/TP)``. Never modified unless ``inplace_backward``.
        target: ``[...]`` global token ids; negative ids mark ignored positions.
        vocab_size: the true vocabulary size; columns at or above it are megatron's padding
            and are excluded from every statistic.
        tp_group: the tensor-parallel group the vocabulary is split over. ``None`` means no
            tensor parallelism (``logits`` holds the whole vocabulary); never read from
            global state.
        chunk_size: ``eager``/``compiled`` only: tokens upcast to fp32 at a time. Default:
            ``2**22 / V_local`` tokens on CPU, ``2**25 / V_local`` on CUDA. The ``triton``
            kernels tile the vocabulary themselves and take no chunk size.
        implementation: ``eager`` PyTorch ops (the reference), ``compiled`` (``torch.compile``
            fuses each chunk into one pass over the logits), ``triton`` (hand-written kernels,
            one read of the logits per pass, no chunking: :mod:`vocab_stats_triton`; CUDA,
            or CPU under ``TRITON_INTERPRET=1``), or ``auto``: ``triton`` on CUDA when Triton
            imports (else ``compiled``), ``eager`` on CPU.
        inplace_backward: write the gradient of the logits into ``logits`` itself (as
            megatron's and Liger's cross entropies do): no second logits-sized buffer. Only
            for callers that do not use ``logits`` after the backward; another autograd node
            that saved the same tensor then fails with PyTorch's in-place error.

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
    resolved = resolve(implementation, logits)
    if resolved == "triton":
        from reco_megatron.parallel import vocab_stats_triton

        if chunk_size is not None:
            raise ValueError(
                f"chunk_size={chunk_size} applies to the eager/compiled implementations; the "
                "triton kernels tile the vocabulary themselves: leave chunk_size unset"
            )
        vocab_stats_triton.check_device(logits)
        if flat_logits.stride(-1) != 1:
            flat_logits = flat_logits.contiguous()
    logprob, entropy, sum_p2 = _VocabParallelStats.apply(
        flat_logits,
        flat_target,
        vocab_start,
        valid_local,
        _chunk_tokens(chunk_size, vocab_local, logits.device),
        tp_group,
        tp_size > 1,
        resolved,
        inplace_backward,
    )
    shape = target.shape
    return TokenStats(logprob.view(shape), entropy.view(shape), sum_p2.view(shape))
