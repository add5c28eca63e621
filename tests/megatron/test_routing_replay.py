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


def _reference(rank, world_size):
    engine = _moe.build_engine()
    batch = _moe.rollout_batch()
    own = _moe.own_routing(engine, batch)
    perturbed = own.clone()
    mask = batch.loss_mask[0].bool()
    for p in torch.nonzero(mask).flatten().tolist():
        others = [e for e in range(_moe.EXPERTS) if e not in own[0, p, 0].tolist()]
        perturbed[0, p, 0] = torch.tensor(others[:2], dtype=perturbed.dtype)
    return {"weights": _moe.full_params(engine), "own": own, "perturbed": perturbed}


def _train(rank, world_size, ep, weights, routed, mode, measure_unreplayed=False):
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


@pytest.fixture(scope="module")
def reference() -> dict:
    return run_distributed(_reference, 1, timeout=180)[0]


@pytest.fixture(scope="module")
def without_replay(reference) -> dict:
    args = (1, reference["weights"], reference["own"], "off")
    return run_distributed(_train, 1, args=args, timeout=180)[0]


def test_replaying_the_models_own_routing_changes_nothing(reference, without_replay) -> None:
    args = (1, reference["weights"], reference["own"], "replay")
    res = run_distributed(_train, 1, args=args, timeout=180)[0]
    assert torch.equal(res["old"], without_replay["old"])
    assert res["steps"][0]["loss"] == without_replay["steps"][0]["loss"]
    assert res["steps"][0]["grad_norm"] == without_replay["steps"][0]["grad_norm"]
    assert res["prep"]["routing_mismatch"] == 0.0
    assert res["prep"]["routing_mismatch_layer"] == 0.0


def test_replaying_a_perturbed_routing(reference, without_replay) -> None:
    args = (1, reference["weights"], reference["perturbed"], "replay")
    replayed = run_distributed(_train, 1, args=args, kwargs={"measure_unreplayed": True})[0]
    batch = _moe.rollout_batch()
    mask = batch.loss_mask.bool()
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
    args = (1, reference["weights"], reference["perturbed"], "record")
    recorded = run_distributed(_train, 1, args=args, timeout=180)[0]
    assert recorded["prep"]["routing_mismatch"] == replayed["prep"]["routing_mismatch"]
    for name, value in without_replay["params"].items():
        assert torch.equal(recorded["params"][name], value), name


def test_replay_under_expert_parallelism(reference) -> None:
    args = (reference["weights"], reference["perturbed"], "replay")
    want = run_distributed(_train, 1, args=(1, *args), timeout=180)[0]
    got = run_distributed(_train, 2, args=(2, *args), timeout=240)
    for res in got:
        assert res["prep"]["routing_mismatch"] == want["prep"]["routing_mismatch"]
        for name, value in want["params"].items():
            torch.testing.assert_close(res["params"][name], value, atol=2e-5, rtol=0, msg=name)
        for got_step, want_step in zip(res["steps"], want["steps"], strict=True):
            assert got_step["loss"] == pytest.approx(want_step["loss"], abs=1e-5)
