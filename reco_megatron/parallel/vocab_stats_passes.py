"""The forward and backward passes of the statistics over one shard ``[N, V/TP]``.

Shared by the op (:mod:`vocab_stats`) and the fused output layers (:mod:`linear_stats`,
:mod:`linear_loss`), for each implementation:

* :func:`statistics`: ``logprob, entropy, sum_p2, lse`` per token, with the forward's two
  all-reduces over ``tp_group`` (MAX of ``[N]``, SUM of ``[N, 4]``);
* :func:`gradient`: ``d loss / d logits`` of the shard from the upstream gradients of the
  three statistics; no collective.

``eager``/``compiled`` work chunk by chunk with the functions of :mod:`vocab_stats_kernels`;
``triton`` launches the kernels of :mod:`vocab_stats_triton` (one launch per pass without
tensor parallelism, three forward launches with it).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from reco_megatron.parallel.vocab_stats_kernels import kernels


def check_targets_on_host(target: torch.Tensor) -> bool:
    """Whether to check target ids on the host (an error naming the bad id): by default for
    CPU targets, where it is free; on a GPU it costs a synchronisation, so there only with
    ``RECO_CHECK_TARGETS=1``, and out-of-range ids give a NaN log-prob instead.
    ``RECO_CHECK_TARGETS=0`` turns the check off everywhere."""
    setting = os.environ.get("RECO_CHECK_TARGETS", "")
    if setting in ("0", "1"):
        return setting == "1"
    return target.device.type == "cpu"


def check_targets(target: torch.Tensor, vocab_size: int) -> None:
    """Raise if an id is at or above ``vocab_size`` (see :func:`check_targets_on_host`)."""
    if target.numel() and check_targets_on_host(target):
        largest = int(target.max())
        if largest >= vocab_size:
            raise ValueError(
                f"target contains token id {largest} >= vocab_size={vocab_size}; targets must "
                "be true-vocabulary ids (use a negative id to ignore a position)"
            )


def can_overwrite(tensor: torch.Tensor) -> bool:
    """Whether a gradient may be written into ``tensor``: no two elements share memory
    (an ``expand``-ed, stride-0 tensor does; 2 = "cannot tell" counts as sharing)."""
    return torch._debug_has_internal_overlap(tensor) == 0


def _target_columns(target: torch.Tensor, vocab_start: int, valid_local: int):
    """``safe_target`` (local column, 0 off-shard) and ``in_shard`` of global ids ``[N]``."""
    local = target - vocab_start
    in_shard = (local >= 0) & (local < valid_local) & (target >= 0)
    return torch.where(in_shard, local, torch.zeros_like(local)), in_shard


def statistics_from_partials(
    partials: torch.Tensor, logits_max: torch.Tensor, target: torch.Tensor, vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``logprob, entropy, sum_p2, lse`` (each ``[N]``) from the all-reduced ``[N, 4]``
    partials relative to the global max ``m``: ``(z_t - m) - log S``, ``log S - T/S``,
    ``Q/S^2`` and ``m + log S``; ignored positions (``target < 0``) get ``logprob = 0``, ids at
    or above ``vocab_size`` NaN (the signal when the host check is off)."""
    sum_exp, sum_exp_shifted, sum_exp_sq, target_shifted = partials.unbind(-1)
    log_sum_exp = sum_exp.log()
    logprob = torch.where(target < 0, torch.zeros_like(log_sum_exp), target_shifted - log_sum_exp)
    logprob = logprob.masked_fill(target >= vocab_size, float("nan"))
    entropy = log_sum_exp - sum_exp_shifted / sum_exp
    sum_p2 = sum_exp_sq / (sum_exp * sum_exp)
    return logprob, entropy, sum_p2, logits_max + log_sum_exp


def _eager_statistics(
    implementation,
    logits,
    target,
    vocab_start,
    valid_local,
    vocab_size,
    chunk,
    tp_group,
    distributed,
):
    """eager/compiled: the max (pass 1, MAX all-reduce), then partials chunk by chunk."""
    forward_partials, _ = kernels(implementation)
    safe_target, in_shard = _target_columns(target, vocab_start, valid_local)
    valid = logits[:, :valid_local]
    n_tokens = logits.shape[0]
    compute_dtype = torch.promote_types(logits.dtype, torch.float32)  # fp64 stays fp64
    if valid_local > 0:
        logits_max = valid.amax(dim=-1).to(compute_dtype)  # exact in the input dtype
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
    return statistics_from_partials(partials, logits_max, target, vocab_size)


def _triton_statistics(logits, target, vocab_start, valid_local, vocab_size, tp_group, distributed):
    """One launch without tensor parallelism; else partials, MAX all-reduce, rescale, SUM
    all-reduce, finish."""
    from reco_megatron.parallel import vocab_stats_triton as tk

    if not distributed:
        return tk.forward(logits, target, vocab_start, valid_local, vocab_size, finish=True)
    local_max, logits_max, part = tk.forward(
        logits, target, vocab_start, valid_local, vocab_size, finish=False
    )
    dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=tp_group)
    tk.combine(local_max, logits_max, part, target, vocab_start, valid_local)
    dist.all_reduce(part, op=dist.ReduceOp.SUM, group=tp_group)
    return tk.finish(part, logits_max, target)


@dataclass(frozen=True)
class Shard:
    """This rank's slice of the vocabulary and how its statistics are computed."""

    implementation: str
    """``eager``, ``compiled`` or ``triton`` (resolved)."""
    vocab_start: int
    """Global id of local column 0."""
    valid_local: int
    """Real (not padding) columns of the shard."""
    vocab_size: int
    """The true vocabulary size."""
    chunk: int
    """Tokens per eager/compiled chunk."""
    tp_group: dist.ProcessGroup | None
    """The group the vocabulary is split over (None: no tensor parallelism)."""
    distributed: bool
    """Whether that group has more than one rank (the all-reduces run)."""


def statistics(
    logits: torch.Tensor, target: torch.Tensor, shard: Shard
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``logprob, entropy, sum_p2, lse`` ``[N]`` of this shard's rows (no autograd).

    Args:
        logits: ``[N, V_local]`` (last dimension contiguous for ``triton``).
        target: ``[N]`` global ids (int64; int32 also for ``triton``), ``< 0`` ignored.
        shard: where the columns sit in the vocabulary and how to reduce over it.
    """
    s = shard
    if s.implementation == "triton":
        return _triton_statistics(
            logits, target, s.vocab_start, s.valid_local, s.vocab_size, s.tp_group, s.distributed
        )
    return _eager_statistics(
        s.implementation,
        logits,
        target,
        s.vocab_start,
        s.valid_local,
        s.vocab_size,
        s.chunk,
        s.tp_group,
        s.distributed,
    )


def gradient(
    logits: torch.Tensor,
    target: torch.Tensor,
    lse: torch.Tensor,
    entropy: torch.Tensor,
    sum_p2: torch.Tensor,
    grads: tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None],
    shard: Shard,
    *,
    inplace: bool,
) -> torch.Tensor:
    """``d loss / d logits [N, V_local]`` in the logits' dtype (padded columns 0) from the
    upstream gradients ``(g_logprob, g_entropy, g_sum_p2)`` (``None``: no term; each ``[N]``,
    like ``lse``, ``entropy`` and ``sum_p2``). With ``inplace`` it overwrites ``logits``
    (whose elements must not share memory). No collective."""
    implementation, chunk = shard.implementation, shard.chunk
    vocab_start, valid_local = shard.vocab_start, shard.valid_local
    if all(g is None for g in grads):
        return logits.detach().zero_() if inplace else torch.zeros_like(logits)
    if implementation == "triton":
        from reco_megatron.parallel import vocab_stats_triton as tk

        grad = tk.gradient(
            logits,
            target,
            vocab_start,
            valid_local,
            lse,
            entropy,
            sum_p2,
            *(None if g is None else g.float().contiguous() for g in grads),
            inplace=inplace,
        )
        if inplace:
            # The kernel wrote through a raw pointer: bump the version counter so that any
            # other autograd node that saved these logits fails loudly instead of reading it.
            torch.autograd.graph.increment_version(logits)
        return grad
    safe_target, in_shard = _target_columns(target, vocab_start, valid_local)
    g_logprob, g_entropy, g_sum_p2 = grads
    if g_logprob is not None:  # an ignored position's logprob is the constant 0
        g_logprob = g_logprob.masked_fill(target < 0, 0.0)
    grad_logits = logits.detach() if inplace else torch.zeros_like(logits)
    if inplace:
        grad_logits[:, valid_local:] = 0
    if valid_local == 0:
        return grad_logits
    _, backward_grad = kernels(implementation)
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
            *(None if g is None else g[sl] for g in (g_logprob, g_entropy, g_sum_p2)),
        )
    return grad_logits
