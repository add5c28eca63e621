"""Stability guards: non-finite gradients and a forced ratio blow-up skip the update, repeated
skips stop the run; the decisions themselves on hand-made metrics."""

from __future__ import annotations

import math

import pytest
import torch

from reco_megatron.testing import run_distributed
from reco_megatron.trainer.lifecycle.guards import (
    DeadRunGuard,
    DeadRunStop,
    StabilityConfig,
    StabilityGuard,
    StabilityStop,
)
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


def test_raw_c_above_c_max_warns(caplog) -> None:
    """Default ``token_ratio_max=None``: the loss's c_max, so the value cap binding warns."""
    guard = StabilityGuard(StabilityConfig(), c_max=10.0)
    assert guard.decide({"loss": 1.0, "token_ratio_max": 9.9}, grads_finite=True) == "ok"
    with caplog.at_level("WARNING"):
        assert guard.decide({"loss": 1.0, "token_ratio_max": 27.0}, grads_finite=True) == "warn"
    assert "token_ratio_max=27.0" in caplog.text and "c_max caps its value" in caplog.text
    explicit = StabilityGuard(StabilityConfig(token_ratio_max=100.0), c_max=10.0)
    assert explicit.decide({"loss": 1.0, "token_ratio_max": 27.0}, grads_finite=True) == "ok"
    with pytest.raises(ValueError, match="token_ratio_max must be >= 1 or None"):
        StabilityConfig(token_ratio_max=0.5)


def _row(step: int, reward: float, unparsable: float = 0.0) -> dict:
    return {
        "step": step,
        "reward_mean": reward,
        "reward_nonzero_frac": 1.0 if reward else 0.0,
        "reward_unparsable_frac": unparsable,
    }


def _checkpoints(root, steps) -> None:
    for k in steps:
        (root / f"step_{k:08d}").mkdir(parents=True)
        (root / f"step_{k:08d}" / "meta.json").write_text("{}")


def test_dead_run_stops_naming_the_last_good_checkpoint(tmp_path) -> None:
    # weights after step k sample step k + 1: dead from step 7 -> step 5 is the last good one
    _checkpoints(tmp_path, [0, 5, 6, 8])
    guard = DeadRunGuard(StabilityConfig(dead_run_steps=3), tmp_path)
    for step, reward in enumerate([0.0, 0.2, 0.0, 0.3, 0.1, 0.2], start=1):
        guard.observe(_row(step, reward))  # an isolated zero step is no streak
    guard.observe(_row(7, 0.0))
    guard.observe(_row(8, 0.0))
    with pytest.raises(DeadRunStop) as exc:
        guard.observe(_row(9, 0.0))
    message = str(exc.value)
    assert "\n" not in message and "steps 7-9" in message
    assert message.endswith(f"last good checkpoint: {tmp_path / 'step_00000005'}")


def test_dead_run_by_unparsable_share_and_streak_reset(tmp_path) -> None:
    guard = DeadRunGuard(StabilityConfig(dead_run_steps=2, dead_run_unparsable_frac=0.25), tmp_path)
    guard.observe(_row(1, 0.1))
    guard.observe(_row(2, 0.1, unparsable=0.3))  # rewards left, but a third unparsable
    guard.observe(_row(3, 0.1, unparsable=0.2))  # resets the streak
    guard.observe(_row(4, 0.1, unparsable=0.3))
    with pytest.raises(DeadRunStop, match=r"steps 4-5 .* last good checkpoint: none"):
        guard.observe(_row(5, 0.0, unparsable=0.0))


def test_dead_run_needs_a_live_step_first_and_can_warn(tmp_path, caplog) -> None:
    never = DeadRunGuard(StabilityConfig(dead_run_steps=2), tmp_path, init="/ckpt/base")
    for step in range(1, 6):  # a run that never earned a reward is not dead
        never.observe(_row(step, 0.0))
    warn = DeadRunGuard(
        StabilityConfig(dead_run_steps=2, dead_run_action="warn"), tmp_path, init="/ckpt/base"
    )
    with caplog.at_level("WARNING"):
        for step, reward in enumerate([0.5, 0.0, 0.0, 0.0, 0.0], start=1):
            warn.observe(_row(step, reward))
    assert caplog.text.count("dead run: steps 2-3") == 1  # once per streak
    assert "last good checkpoint: /ckpt/base (the initial weights" in caplog.text
    off = DeadRunGuard(StabilityConfig(dead_run_steps=0), tmp_path)
    for step, reward in enumerate([0.5, 0.0, 0.0, 0.0], start=1):
        off.observe(_row(step, reward))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(dead_run_steps=-1), "dead_run_steps must be an integer >= 0"),
        (dict(dead_run_unparsable_frac=0.0), r"dead_run_unparsable_frac must be in \(0, 1\]"),
        (dict(dead_run_action="skip"), "dead_run_action must be warn or stop"),
    ],
)
def test_dead_run_config_errors(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        StabilityConfig(**kwargs)


def test_dead_run_warns_when_rotation_would_delete_the_good_checkpoint(tmp_path, caplog) -> None:
    cfg = StabilityConfig(dead_run_steps=5)
    with caplog.at_level("WARNING"):
        DeadRunGuard(cfg, tmp_path, save_interval=2, keep_last=4)  # reaches 6 steps back
        assert "may rotate out" not in caplog.text
        DeadRunGuard(cfg, tmp_path, save_interval=1, keep_last=3)
    assert "keep at least 6 checkpoints" in caplog.text
