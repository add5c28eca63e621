"""Episode batches (observation tokens inside the response, loss mask 0 there) keep
token-budget micro-batches and packing exact: the packed run equals the padded run with fixed
micro-batches (old-policy statistics, losses, metrics, parameters; the tolerances of
``test_packed_engine``), and the observations are counted nowhere (the loss denominator is
the policy's tokens)."""

from __future__ import annotations

import pytest
import torch

from reco_megatron.testing import run_distributed
from tests.megatron import _reco
from tests.megatron.test_packed_engine import PACKED, _compare
from tests.megatron.test_token_budget import long_tailed_batch

pytestmark = pytest.mark.dist


def episode_batch():
    """``long_tailed_batch`` with observations: inside each response, every position
    ``t`` with ``(row + t) % 4 == 1`` is an environment's token (mask 0), the last response
    token stays the policy's (an episode ends on an action)."""
    batch = long_tailed_batch()
    mask = batch.response_mask.clone()
    for i in range(mask.shape[0]):
        where = mask[i].nonzero().flatten().tolist()
        for t in where[:-1]:
            if (i + t) % 4 == 1:
                mask[i, t] = 0.0
    batch.response_mask = mask
    batch.rollout_logprobs = batch.rollout_logprobs * mask[:, 1:]
    return batch


def _body(rank, world_size, reference, update):
    engine = _reco.build_engine(micro_batch_size=2, **update)
    if reference is None:
        return _reco.full_params(engine)
    _reco.load_full(engine, reference)
    batch = _reco.dp_share(episode_batch())
    prepared, prep = engine.prepare(batch)
    steps = engine.train_on_rollout(prepared)
    return {
        "params": _reco.gather_stages(_reco.full_params(engine)),
        "steps": [engine.broadcast_metrics(m) for m in steps],
        "prep": engine.broadcast_metrics(prep),
        "old_logprobs": prepared.old_logprobs,
        "old_sum_p2": prepared.old_sum_p2,
        "mask": prepared.loss_mask,
        "packed": engine.last_plan.packed,
    }


def test_packed_episode_rows_equal_the_padded_run() -> None:
    holes = int(
        (episode_batch().response_mask == 0).sum() - (long_tailed_batch().response_mask == 0).sum()
    )
    assert holes > 10
    weights = run_distributed(_body, 1, args=(None, {}), timeout=120)[0]
    padded = run_distributed(_body, 1, args=(weights, {}), timeout=120)[0]
    update = {**PACKED, "sequence_packing": True}
    packed = run_distributed(_body, 1, args=(weights, update), timeout=120)[0]
    assert packed["packed"] and not padded["packed"]
    _compare(packed, padded)
    policy_tokens = float(episode_batch().loss_mask.sum())
    assert sum(s["loss_denominator"] for s in padded["steps"]) == policy_tokens
    assert padded["prep"]["num_response_tokens"] == policy_tokens
    assert torch.equal(padded["mask"], episode_batch().loss_mask)
