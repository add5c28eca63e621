"""Routing replay: the old-policy pass and the updates use the rollout's experts.

The tiny Qwen3-MoE of ``tests/megatron/_moe.py`` (8 experts, top-2, 2 layers). The rollout's
routing is the model's own (recorded by one forward of the batch), or that routing perturbed:
sequence 0's response positions sent to two experts the router did not choose in layer 0.

* Replaying the model's own routing changes nothing: the old-policy log-probs and the first
  update (theta == theta_old, so the router would choose the same experts) are bit-identical
  to training without replay, and the routing mismatch is 0.
* Replaying the perturbed routing changes exactly what it should: sequence 0's log-probs from
  its first perturbed position on, nothing in the other 15 sequences (bit-identical), and the
  mismatch metrics count exactly the perturbed tokens (``routing_mismatch``) and decisions
  (``routing_mismatch_layer``: one layer of two). ``record`` measures the same mismatch and
  trains exactly as without replay.
* Under expert parallelism (EP 2, each rank holding its data-parallel share of the batch and
  of the routing) the replayed update equals the one-process replayed update.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from reco_megatron.testing import run_distributed
from tests.megatron import _moe, _reco

pytestmark = pytest.mark.dist


def _train(ep, weights, routed, mode, measure_unreplayed=False):
    engine = _moe.build_engine(ep=ep, routing_replay=mode)
    engine.update.measure_unreplayed = measure_unreplayed
    _moe.load_full(engine, weights)
    batch = _reco.dp_share(replace(_moe.rollout_batch(), routed_experts=routed))
    prepared, prep = engine.prepare(batch)
    steps = engine.train_on_rollout(prepared)
    return {
        "old": prepared.old_logprobs,
        "prep": engine.broadcast_metrics(prep),
        "steps": [engine.broadcast_metrics(m) for m in steps],
        "params": _moe.full_params(engine),
    }


def _one_process(rank, world_size):
    """The model's own routing and a perturbed one, then four runs from the same weights:
    without replay, replaying the own routing, replaying and recording the perturbed one."""
    engine = _moe.build_engine()
    weights = _moe.full_params(engine)
    batch = _moe.rollout_batch()
    own = _moe.own_routing(engine, batch)
    perturbed = own.clone()
    for p in torch.nonzero(batch.loss_mask[0].bool()).flatten().tolist():
        others = [e for e in range(_moe.EXPERTS) if e not in own[0, p, 0].tolist()]
        perturbed[0, p, 0] = torch.tensor(others[:2], dtype=perturbed.dtype)
    return {
        "weights": weights,
        "perturbed": perturbed,
        "off": _train(1, weights, own, "off"),
        "own": _train(1, weights, own, "replay"),
        "replayed": _train(1, weights, perturbed, "replay", measure_unreplayed=True),
        "recorded": _train(1, weights, perturbed, "record"),
    }


def _expert_parallel(rank, world_size, weights, routed):
    return _train(2, weights, routed, "replay")


@pytest.fixture(scope="module")
def runs() -> dict:
    return run_distributed(_one_process, 1, timeout=300)[0]


def test_replaying_the_models_own_routing_changes_nothing(runs) -> None:
    res, without_replay = runs["own"], runs["off"]
    assert torch.equal(res["old"], without_replay["old"])
    assert res["steps"][0]["loss"] == without_replay["steps"][0]["loss"]
    assert res["steps"][0]["grad_norm"] == without_replay["steps"][0]["grad_norm"]
    assert res["prep"]["routing_mismatch"] == 0.0
    assert res["prep"]["routing_mismatch_layer"] == 0.0


def test_replaying_a_perturbed_routing(runs) -> None:
    replayed, without_replay = runs["replayed"], runs["off"]
    mask = _moe.rollout_batch().loss_mask.bool()
    first = int(torch.nonzero(mask[0]).min())
    # sequence 0 changes from its first replayed position on; the other sequences do not
    assert torch.equal(replayed["old"][1:], without_replay["old"][1:])
    assert torch.equal(replayed["old"][0, :first], without_replay["old"][0, :first])
    assert not torch.equal(replayed["old"][0, first:], without_replay["old"][0, first:])
    # the metrics count the perturbed tokens exactly (one layer of two)
    share = mask[0].sum().item() / mask.sum().item()
    assert replayed["prep"]["routing_mismatch"] == pytest.approx(share, abs=1e-12)
    assert replayed["prep"]["routing_mismatch_layer"] == pytest.approx(share / 2, abs=1e-12)
    # without replay the trainer's log-probs are those of the model's own routing
    assert replayed["prep"]["logprob_mismatch_free"] == pytest.approx(
        without_replay["prep"]["logprob_mismatch"], abs=1e-12
    )
    assert replayed["prep"]["logprob_mismatch"] != without_replay["prep"]["logprob_mismatch"]
    # the update follows the replayed routing: other parameters than without replay
    diff = max(
        float((replayed["params"][k] - v).abs().max()) for k, v in without_replay["params"].items()
    )
    assert diff > 1e-4
    # record: the same measurement, the training of 'off'
    recorded = runs["recorded"]
    assert recorded["prep"]["routing_mismatch"] == replayed["prep"]["routing_mismatch"]
    for name, value in without_replay["params"].items():
        assert torch.equal(recorded["params"][name], value), name


def test_replay_under_expert_parallelism(runs) -> None:
    want = runs["replayed"]
    args = (runs["weights"], runs["perturbed"])
    for res in run_distributed(_expert_parallel, 2, args=args, timeout=240):
        assert res["prep"]["routing_mismatch"] == want["prep"]["routing_mismatch"]
        for name, value in want["params"].items():
            torch.testing.assert_close(res["params"][name], value, atol=2e-5, rtol=0, msg=name)
        for got_step, want_step in zip(res["steps"], want["steps"], strict=True):
            assert got_step["loss"] == pytest.approx(want_step["loss"], abs=1e-5)
