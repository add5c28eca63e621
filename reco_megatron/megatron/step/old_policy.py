"""The old-policy pass of a rollout batch: what the updates of one rollout need before the
first optimizer step.

:func:`prepare_rollout` runs the current weights forward-only over the whole batch (the *old
policy*: ``logp_old``, ``sum_p2_old``), the reference model's log-probs when a KL term is used,
the rollout/trainer log-prob mismatch, and the ReCo response weights **per complete group**,
before :meth:`~reco_megatron.megatron.step.engine.ReCoEngine.train_on_rollout` splits the
batch into mini- and micro-batches. Mixture-of-experts models measure (and may replay) the
rollout's routing here (:mod:`reco_megatron.megatron.model.routing`).
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

import torch

from reco_megatron.algo import batch_response_weights
from reco_megatron.megatron.model.routing import MoERouting
from reco_megatron.megatron.step.metrics import mismatch_sums, reduce_metrics
from reco_megatron.parallel.batch import RolloutBatch


def prepare_rollout(engine: Any, batch: RolloutBatch) -> tuple[RolloutBatch, dict[str, float]]:
    """``engine.prepare`` (:class:`~reco_megatron.megatron.step.engine.ReCoEngine`): the batch
    (this rank's balanced share with a token budget and DP > 1) with ``old_logprobs``,
    ``old_sum_p2``, ``ref_logprobs`` and ``weights`` filled, on the CPU, and the pass's
    metrics (last pipeline stage; elsewhere only the pass's time)."""
    metrics: dict[str, torch.Tensor] = {}
    batch, balance = engine.batcher.balance(batch, engine.model_cfg.hidden_size)
    batch = batch.to(engine.device)
    start = time.perf_counter()
    routing = engine.routing_for(batch)
    stats = engine.statistics_on_device(batch, reference=False, **routing)
    elapsed = time.perf_counter() - start
    if routing.get("measure") and engine.routing is not None:
        metrics.update(engine.routing.mismatch())
    free = None
    if routing.get("replay") and engine.update.measure_unreplayed:
        free = engine.statistics_on_device(batch, reference=False)
    if not stats:
        return batch.to("cpu"), {"time_old_logprob": elapsed}
    counters = {f"old_{k}": torch.tensor(v) for k, v in engine.last_plan.counters().items()}
    metrics.update(counters)
    mask = batch.loss_mask
    old = stats["logprob"]
    ref = None
    if engine.ref_model is not None:
        ref = engine.statistics_on_device(batch, reference=True)["logprob"]
    weights = batch_response_weights(  # [B] per response, [B, S] per token (prefix modes)
        engine.loss_cfg,
        old,
        mask,
        batch.group_size,
        policy=engine.response_weight_policy,
        rollout_logprobs=batch.rollout_logprobs,
        response_ids=batch.labels,
    )
    n_tok = mask.sum()
    metrics["num_response_tokens/sum"] = n_tok
    metrics["old_entropy/wsum"] = (stats["entropy"] * mask).sum()
    if batch.rollout_logprobs is not None:
        free_lp = None if free is None else free["logprob"]
        metrics.update(mismatch_sums(batch.rollout_logprobs, old, mask, free_lp))
    prepared = replace(
        batch,
        old_logprobs=old,
        old_sum_p2=stats["sum_p2"],
        ref_logprobs=ref,
        weights=weights,
    )
    out = MoERouting.mismatch_ratios(reduce_metrics([metrics], "num_response_tokens/sum"))
    out.update(balance)
    out["time_old_logprob"] = elapsed
    return prepared.to("cpu"), out
