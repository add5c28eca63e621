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
gradient once: one launch per direction without tensor parallelism, no host
synchronisation. The caller's logits are modified only with ``inplace_backward`` (the
gradient then overwrites them; megatron's own cross entropy always works in place on fp32
input). The passes themselves are in :mod:`vocab_stats_passes`.

``-inf`` logits (masked vocabulary entries) contribute nothing to any sum and get a zero
gradient, in every implementation; a shard of nothing but ``-inf`` combines like an empty one.

Targets: ids in ``[0, vocab_size)``; a negative id marks an ignored position (its ``logprob``
is 0 and gets no gradient; ``entropy`` and ``sum_p2`` are still computed). Ids at or above
``vocab_size`` are an error, raised on the host when the targets are on the CPU or
``RECO_CHECK_TARGETS=1``; otherwise (a GPU, where the check would synchronise) their
``logprob`` is NaN.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from reco_megatron.algo.token_stats import TokenStats
from reco_megatron.parallel import vocab_stats_passes as passes
from reco_megatron.parallel.vocab_stats_kernels import Implementation, resolve

DEFAULT_CHUNK_ELEMENTS = 1 << 22
"""Default chunk of the eager/compiled paths on CPU: this many logits (16 MiB of fp32 per
temporary) are upcast at a time."""
DEFAULT_CHUNK_ELEMENTS_CUDA = 1 << 25
"""Default chunk on CUDA (256 tokens at V = 128K): on one H200 the CPU
default is launch-bound (50x from the bandwidth bound) and 2^25 within 1.3x of one chunk at
1.09x peak memory. The ``triton`` implementation (the CUDA default) does not chunk."""


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


class _VocabParallelStats(torch.autograd.Function):
    """Autograd wrapper of :mod:`vocab_stats_passes` (which holds the all-reduces)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx,
        logits: torch.Tensor,  # [N, V_local]
        target: torch.Tensor,  # [N] global ids, < 0 ignored
        shard: passes.Shard,
        inplace_backward: bool,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logprob, entropy, sum_p2, lse = passes.statistics(logits, target, shard)
        ctx.save_for_backward(logits, target, lse, entropy, sum_p2)
        ctx.meta = (shard, inplace_backward)
        ctx.set_materialize_grads(False)
        return logprob, entropy, sum_p2

    @staticmethod
    def backward(  # type: ignore[override]
        ctx,
        grad_logprob: torch.Tensor | None,
        grad_entropy: torch.Tensor | None,
        grad_sum_p2: torch.Tensor | None,
    ):
        shard, inplace = ctx.meta
        logits, target, lse, entropy, sum_p2 = ctx.saved_tensors
        grads = (grad_logprob, grad_entropy, grad_sum_p2)
        grad_logits = passes.gradient(
            logits, target, lse, entropy, sum_p2, grads, shard, inplace=inplace
        )
        return grad_logits, None, None, None


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
            that saved the same tensor then fails with PyTorch's in-place error. Logits whose
            elements share memory (``expand``-ed, stride 0) get a new gradient buffer instead.

    Returns:
        :class:`TokenStats` of fp32 tensors (fp64 for fp64 logits) shaped like ``target``.
        Gradients flow into ``logits`` from any combination of the three; an unused output
        costs nothing. ``-inf`` logits (masked vocabulary entries) contribute nothing and get
        a zero gradient. Target ids at or above ``vocab_size`` raise a ``ValueError`` when
        the targets are on the CPU or ``RECO_CHECK_TARGETS=1`` (a host synchronisation);
        otherwise their ``logprob`` is NaN.
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
    flat_target = target.reshape(-1)
    if flat_target.numel() == 0:
        # Zeros that keep the graph connected, so an empty micro-batch still backpropagates.
        empty = logits.sum(-1).to(torch.promote_types(logits.dtype, torch.float32)) * 0.0
        return TokenStats(empty, empty.clone(), empty.clone())
    passes.check_targets(flat_target, vocab_size)  # the same on every rank: before any collective
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
        if flat_target.dtype not in (torch.int32, torch.int64):
            flat_target = flat_target.long()
    else:
        flat_target = flat_target.long()
    # An expanded (stride-0) or otherwise self-overlapping input cannot take its gradient in
    # place: the gradient then goes to a new buffer (correct, one logits-sized allocation).
    inplace = inplace_backward and passes.can_overwrite(flat_logits)
    shard = passes.Shard(
        implementation=resolved,
        vocab_start=vocab_start,
        valid_local=valid_local,
        vocab_size=vocab_size,
        chunk=_chunk_tokens(chunk_size, vocab_local, logits.device),
        tp_group=tp_group,
        distributed=tp_size > 1,
    )
    logprob, entropy, sum_p2 = _VocabParallelStats.apply(flat_logits, flat_target, shard, inplace)
    shape = target.shape
    return TokenStats(logprob.view(shape), entropy.view(shape), sum_p2.view(shape))
