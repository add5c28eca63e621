"""ReCo loss layers in megatron's ``forward_step`` / ``loss_func`` contract.

``get_forward_backward_func()`` calls ``forward_step(data_iterator, model)`` once per
micro-batch on every pipeline stage; on the last stage it then calls the returned
``loss_func(output_tensor)``. What the schedule does with that return value is the whole
story of the gradient's scale, so it is chosen here on purpose:

* a **2-tuple** ``(loss, metrics)`` is divided *in place* by ``num_microbatches`` (and multiplied
  by the CP size); DDP then averages gradients over data-parallel ranks. A loss that is already
  the micro-batch's contribution to the global loss would come out scaled by 1/(M x DP), and a
  detached copy logged from it would be off by M.
* a **3-tuple** ``(loss, num_tokens, metrics)`` with ``TransformerConfig.calculate_per_token_loss
  = True`` (what we use) is **not** divided: the schedule sums ``num_tokens`` over micro-batches,
  DDP *sums* gradients over data-parallel ranks (scaling factor 1), and ``finalize_model_grads``
  all-reduces the token count over DP x CP and divides every gradient by it.

So :func:`policy_loss_func` returns the *numerator* of the globally normalised loss (the sum
of per-token terms for ``token_mean``, the sum of per-sequence terms for the sequence
aggregations: ``algo.policy_loss`` with global counts 1) and the local *denominator share*
(response tokens, or sequences). Megatron then produces exactly the gradient of
``sum(numerators) / sum(denominators)`` over all micro-batches and DP ranks: the
single-process gradient of the globally normalised loss, whatever the split (tested in
``tests/megatron/test_reco_step.py``). Both are integers, as the schedule accumulates the count
in an int tensor.

On pipeline stages other than the last, ``output_tensor`` is a hidden state and no loss
function runs. On the last stage ``output_tensor`` is the vocabulary-sharded logits
``[B, S, V/TP]`` (``parallel_output=True``), fed to :func:`vocab_parallel_stats` with the
tensor-parallel group passed explicitly.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import torch

from reco_megatron.algo import LossConfig, TokenStats, policy_loss
from reco_megatron.megatron.device import check_on_device
from reco_megatron.parallel import vocab_parallel_stats
from reco_megatron.parallel.batch import RolloutBatch
from reco_megatron.parallel.linear_loss import vocab_parallel_linear_loss
from reco_megatron.parallel.linear_stats import vocab_parallel_linear_stats
from reco_megatron.parallel.vocab_stats_kernels import Implementation


@dataclass(frozen=True)
class LossContext:
    """What the loss functions need besides the micro-batch."""

    loss: LossConfig
    vocab_size: int
    tp_group: Any
    stats_implementation: Implementation = "auto"
    fused_output_layer: bool = False
    """The model returns hidden states; the output layer runs here, fused with the op."""
    sequence_parallel: bool = False
    """With the fused layer: the hidden states arrive sharded over the sequence."""
    output_weight: torch.Tensor | None = None
    """With the fused layer: this micro-batch's output weight ``[V/TP, H]``."""
    packed: Any = None
    """With packed sequences (``megatron/step/packing.py``): the packed labels ``[1, T]`` and the
    layout; the statistics run on the packed row and come back as ``[B, S]``."""
    fused_block_tokens: int | None = None
    """With the fused layer: tokens whose logits exist at a time (None: the op's default)."""


def denominator_share(mb: RolloutBatch, loss: LossConfig) -> torch.Tensor:
    """This micro-batch's share of the global normaliser: response tokens or sequences."""
    if loss.aggregation == "token_mean":
        return mb.loss_mask.sum().to(torch.int)
    return torch.tensor(mb.num_sequences, dtype=torch.int, device=mb.tokens.device)


def _stats(mb: RolloutBatch, ctx: LossContext, logits: torch.Tensor) -> TokenStats:
    if ctx.packed is not None:  # THD: one packed row in, the micro-batch's [B, S] layout out
        flat = _stats(ctx.packed, replace(ctx, packed=None), logits)
        return TokenStats(*(ctx.packed.unpack(x, mb.seq_length) for x in flat))
    if ctx.fused_output_layer:
        return _fused_stats(mb, ctx, logits)
    # In-place backward: the gradient of the logits overwrites them (no second logits-sized
    # buffer). Safe because the model's logits feed only this op: the output layer's backward
    # needs its input and weight, never its output, and each loss function calls _stats once.
    return vocab_parallel_stats(
        logits,
        mb.labels,
        ctx.vocab_size,
        tp_group=ctx.tp_group,
        implementation=ctx.stats_implementation,
        inplace_backward=True,
    )


def _fused_stats(mb: RolloutBatch, ctx: LossContext, hidden: torch.Tensor) -> TokenStats:
    """Output layer + statistics without the logits (forward-only passes): ``hidden
    [B, S(/TP), H]`` is what ``model.fuse_output_layer`` makes the model return, in the
    parameters' dtype (the cast to the weight's dtype is then a no-op; it guards wrappers such
    as megatron's Float16Module, which upcast the last stage's output to fp32: the cast back
    is exact)."""
    weight = _output_weight(ctx)
    stats = vocab_parallel_linear_stats(
        hidden.transpose(0, 1).to(weight.dtype),  # [S(/TP), B, H], megatron's layout
        weight,
        mb.labels.t(),
        ctx.vocab_size,
        tp_group=ctx.tp_group,
        sequence_parallel=ctx.sequence_parallel,
        block_tokens=ctx.fused_block_tokens,
        implementation=ctx.stats_implementation,
    )
    return TokenStats(*(x.t() for x in stats))


def _output_weight(ctx: LossContext) -> torch.Tensor:
    if ctx.output_weight is None:
        raise RuntimeError("fused_output_layer needs the output weight in the LossContext")
    return ctx.output_weight


Objective = Callable[[TokenStats], tuple[torch.Tensor, dict[str, torch.Tensor]]]
"""``objective(stats [B, S]) -> (numerator, metrics)`` of one micro-batch."""


def _fused_objective(
    mb: RolloutBatch, ctx: LossContext, hidden: torch.Tensor, objective: Objective
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Output layer + statistics + loss in one op with 3 matmuls
    (:func:`vocab_parallel_linear_loss`): the numerator's gradient is computed block by block
    in the forward. Every objective here is token-separable (a sum of per-token terms with
    global normalisers), which that op needs. The metrics come from a second evaluation on
    the detached statistics."""
    weight = _output_weight(ctx)
    labels = mb.labels.t()  # [S, B]: megatron's layout, in which the op flattens the tokens
    seq, batch = labels.shape

    def numerator(flat: TokenStats) -> torch.Tensor:
        return objective(TokenStats(*(x.view(seq, batch).t() for x in flat)))[0]

    zeros = torch.zeros(seq * batch, device=labels.device)
    old_sum_p2 = zeros if mb.old_sum_p2 is None else mb.old_sum_p2.t().reshape(-1)
    old_logprob = zeros if mb.old_logprobs is None else mb.old_logprobs.t().reshape(-1)
    loss, stats = vocab_parallel_linear_loss(
        hidden.transpose(0, 1).to(weight.dtype),  # [S(/TP), B, H]
        weight,
        labels,
        numerator,
        ctx.vocab_size,
        tp_group=ctx.tp_group,
        sequence_parallel=ctx.sequence_parallel,
        block_tokens=ctx.fused_block_tokens,
        implementation=ctx.stats_implementation,
        fill=TokenStats(old_logprob, zeros, old_sum_p2),  # finite stand-ins
    )
    _, metrics = objective(TokenStats(*(x.t() for x in stats)))
    return loss, metrics


def _objective(
    mb: RolloutBatch, ctx: LossContext, output: torch.Tensor, objective: Objective
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``objective`` of this micro-batch's statistics: from the logits, or, with the fused
    output layer, from the hidden states in one op. Packed rows (THD) with the fused layer
    take the statistics op with autograd (4 matmuls): the one-op loss evaluates the objective
    in the packed row's token order, which the unpacking to ``[B, S]`` would have to follow."""
    if ctx.fused_output_layer and ctx.packed is None:
        return _fused_objective(mb, ctx, output, objective)
    return objective(_stats(mb, ctx, output))


def _policy_objective(
    mb: RolloutBatch, ctx: LossContext, stats: TokenStats
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    stats_old = None
    if mb.old_sum_p2 is not None:
        stats_old = TokenStats(mb.old_logprobs, torch.zeros_like(mb.old_logprobs), mb.old_sum_p2)
    return policy_loss(
        stats.logprob,
        mb.old_logprobs,
        mb.advantages,
        mb.loss_mask,
        ctx.loss,
        weights=mb.weights if ctx.loss.response_weight != "none" else None,
        stats=stats,
        stats_old=stats_old,
        ref_logp=mb.ref_logprobs,
        global_num_tokens=1.0,
        global_num_seqs=1.0,
        rollout_logp=mb.rollout_logprobs if ctx.loss.tis_cap is not None else None,
    )


def policy_loss_func(
    mb: RolloutBatch, ctx: LossContext, output: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Megatron 3-tuple ``(numerator, denominator share, metrics)`` of one micro-batch.

    ``output``: ``[B, S, V/TP]`` this rank's vocabulary shard of the logits, or with the
    fused output layer the hidden states ``[B, S(/TP), H]``.
    """
    if mb.old_logprobs is None:
        raise RuntimeError("the old-policy pass must fill old_logprobs before training")
    numerator, metrics = _objective(mb, ctx, output, partial(_policy_objective, mb, ctx))
    count = denominator_share(mb, ctx.loss)
    metrics = dict(metrics)
    metrics["loss_numerator/sum"] = numerator.detach().float()
    metrics["loss_denominator/sum"] = count.float()
    return numerator, count, metrics


def statistics_func(
    mb: RolloutBatch, ctx: LossContext, logits: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Forward-only: the per-token statistics of the current weights, ``[B, S]`` each."""
    stats = _stats(mb, ctx, logits)
    out = {
        "logprob": stats.logprob.detach(),
        "sum_p2": stats.sum_p2.detach(),
        "entropy": stats.entropy.detach(),
    }
    zero = torch.zeros((), device=logits.device)
    return zero, torch.zeros((), dtype=torch.int, device=logits.device), out


def _sft_objective(mb: RolloutBatch, stats: TokenStats):
    mask = mb.loss_mask
    numerator = -(stats.logprob * mask).sum()
    count = mask.sum()
    return numerator, {
        "loss_numerator/sum": numerator.detach().float(),
        "loss_denominator/sum": count.float(),
        "num_tokens/sum": count.float(),
    }


def sft_loss_func(
    mb: RolloutBatch, ctx: LossContext, output: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Supervised warm-up: token-mean negative log-likelihood of the response tokens, in the
    same per-token contract (numerator, token count) as :func:`policy_loss_func`."""
    numerator, metrics = _objective(mb, ctx, output, partial(_sft_objective, mb))
    return numerator, mb.loss_mask.sum().to(torch.int), metrics


def make_forward_step(
    loss_func: Callable[..., Any], ctx: LossContext, device: torch.device
) -> Callable[[Iterator[RolloutBatch], Any], tuple[torch.Tensor, Callable[..., Any]]]:
    """A ``forward_step_func`` for megatron's schedules running ``loss_func`` per micro-batch.

    Every tensor of the micro-batch (the model's input and the loss's) must already be on
    ``device``, the engine's: checked here, so a misplaced batch fails with its name."""

    def forward_step(data_iterator: Iterator[RolloutBatch], model: Any):
        mb = next(data_iterator)
        check_on_device(vars(mb), device, "micro-batch entering the model")
        s = mb.seq_length
        position_ids = (
            torch.arange(s, device=mb.tokens.device).unsqueeze(0).expand(mb.num_sequences, s)
        )
        # Causal attention needs no mask tensor; right padding is after every real token and
        # excluded by the loss mask.
        output = model(mb.input_ids, position_ids, None)
        if ctx.fused_output_layer:
            from reco_megatron.megatron.model.build import output_weight

            return output, partial(loss_func, mb, replace(ctx, output_weight=output_weight(model)))
        return output, partial(loss_func, mb, ctx)

    return forward_step
