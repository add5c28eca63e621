"""Stability guards: non-finite gradients and a forced ratio blow-up skip the update, repeated
skips stop the run; the decisions themselves on hand-made metrics."""

from __future__ import annotations

import math

import pytest
import torch

from reco_megatron.testing import run_distributed
from reco_megatron.trainer.guards import StabilityConfig, StabilityGuard, StabilityStop
from tests.megatron import _reco


def test_decisions_on_hand_made_metrics() -> None:
    guard = StabilityGuard(
        StabilityConfig(
            ratio_max=2.0,
            ratio_action="skip",
            kl_old_new_max=0.1,
            kl_action="warn",
            max_consecutive_skips=2,
        )
    )
    assert guard.decide({"loss": 1.0, "ratio_max": 1.5}, grads_finite=True) == "ok"
    assert guard.decide({"loss": 1.0, "kl_old_new": 0.5}, grads_finite=True) == "warn"
    assert guard.decide({"loss": 1.0, "ratio_max": 3.0}, grads_finite=True) == "skip"
    assert guard.decide({"loss": 1.0}, grads_finite=True) == "ok"  # resets the streak
    assert guard.decide({"loss": math.nan}, grads_finite=True) == "skip"
    with pytest.raises(StabilityStop, match="2 consecutive optimizer steps skipped"):
        guard.decide({"loss": 1.0}, grads_finite=False)
    stop = StabilityGuard(StabilityConfig(entropy_min=0.5, entropy_action="stop"))
    with pytest.raises(StabilityStop, match="entropy"):
        stop.decide({"loss": 1.0, "entropy": 0.1}, grads_finite=True)


def test_bad_action_is_rejected() -> None:
    with pytest.raises(ValueError, match="ratio_action must be warn, skip or stop"):
        StabilityConfig(ratio_action="ignore")


def _nan_body(rank, world_size, mode):
    engine = _reco.build_engine(lr=0.5)
    before = _reco.full_params(engine)
    batch = _reco.rollout_batch()
    if mode == "nan":
        batch.advantages[3] = float("nan")
        guard = StabilityGuard(StabilityConfig(max_consecutive_skips=3))
    else:  # a huge learning rate makes the second mini-batch's ratio explode
        guard = StabilityGuard(StabilityConfig(ratio_max=1.5, ratio_action="skip"))
    prepared, _ = engine.prepare(batch)
    steps = engine.train_on_rollout(prepared, guard.decide)
    after = _reco.full_params(engine)
    moved = max(float((after[k] - before[k]).abs().max()) for k in before)
    return [s["update_skipped"] for s in steps], moved, guard.total_skips


def test_nan_gradients_skip_the_update() -> None:
    skipped, moved, total = run_distributed(_nan_body, 1, args=("nan",), timeout=120)[0]
    # Row 3 (advantage NaN) is in mini-batch 0: its loss and gradients are NaN, the update is
    # dropped; mini-batch 1 is clean and trains.
    assert skipped == [1.0, 0.0] and total == 1
    assert moved > 0 and torch.isfinite(torch.tensor(moved))


def test_ratio_blow_up_skips_the_second_step() -> None:
    skipped, moved, total = run_distributed(_nan_body, 1, args=("ratio",), timeout=120)[0]
    assert skipped == [0.0, 1.0] and total == 1
    assert moved > 0  # the first step went through
    assert torch.isfinite(torch.tensor(moved))
