"""The RL loop end to end on CPU: 3 steps at TP 1, TP 2 and (token budget) DP 2 give the same
metrics.

The tiny run: countdown prompts, a 2-layer model with no warm-up (rewards are mostly 0, which
still exercises every phase), 4 prompts x 4 responses, 2 mini-batches per rollout.

TP 1 vs TP 2: the rollout engine samples from the exported (TP-gathered) weights with one
seed per prompt, so both runs see the same responses as long as their weights agree;
training differs only by fp32 summation order (~1e-7 relative), so response tokens, rewards
and lengths are equal and losses agree to 1e-4 (the inverse-CDF sampler could in principle
flip a token whose cumulative probability sits within ~1e-7 of the uniform draw; with 3
steps of 16 responses of <= 8 tokens that has probability ~1e-5).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from reco_megatron.testing import run_distributed
from reco_megatron.train import main
from tests.tiny_overrides import TINY_RUN

pytestmark = pytest.mark.dist

TINY = [*TINY_RUN, "sft.steps=0", "trainer.max_steps=3", "checkpoint.save_interval=2"]


def _run(rank, world_size, out: str, extra: list[str]):
    code = main(["examples/tiny_cpu.yaml", *TINY, f"trainer.output_dir={out}", *extra])
    assert code == 0
    return None


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


REQUIRED = [
    "step",
    "loss",
    "reward_mean",
    "entropy_mean",
    "grad_norm",
    "clip_frac",
    "weight_mean",
    "weight_ess",
    "weight_active",
    "response_len_mean",
    "unique_frac",
    "pass@1",
    "pass@4",
    "logprob_mismatch",
    "time_rollout",
    "time_reward",
    "time_old_logprob",
    "time_train",
    "time_sync",
]


@pytest.fixture(scope="module")
def tp1(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tp1")
    run_distributed(_run, 1, args=(str(out), []), timeout=600)
    return out


def test_three_steps_leave_metrics_checkpoint_and_plot(tp1: Path) -> None:
    rows = _rows(tp1)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for row in rows:
        missing = [k for k in REQUIRED if k not in row]
        assert not missing, missing
        assert row["time_rollout"] > 0 and row["time_train"] > 0
    # The embedded engine samples from the trainer's own weights: the mismatch is fp noise.
    assert rows[0]["logprob_mismatch"] < 1e-4
    assert (tp1 / "checkpoints" / "latest").read_text().strip() == "step_00000003"
    assert (tp1 / "config.yaml").exists()
    assert (tp1 / "training_curves.png").stat().st_size > 1000
    assert not (tp1 / "trainer.lock").exists()  # a clean exit removes the run's lock file


def test_tp2_metrics_equal_tp1(tp1: Path, tmp_path: Path) -> None:
    out = tmp_path / "tp2"
    run_distributed(
        _run, 2, args=(str(out), ["parallel.tensor_model_parallel_size=2"]), timeout=600
    )
    for a, b in zip(_rows(tp1), _rows(out), strict=True):
        for key in ("reward_mean", "response_len_mean", "unique_frac", "pass@4"):
            assert a[key] == b[key], key
        for key in ("loss", "entropy_mean", "clip_frac", "weight_mean", "grad_norm"):
            assert a[key] == pytest.approx(b[key], abs=1e-4, rel=1e-4), key
        # The rollout engine received the TP-gathered weights: its log-probs equal the
        # TP 2 trainer's (an off-by-one alignment would show up here as a mismatch ~1).
        assert b["logprob_mismatch"] < 1e-4


def test_token_budget_at_dp2_equals_the_fixed_split(tp1: Path, tmp_path: Path) -> None:
    # Token-budget micro-batches with the groups balanced over 2 data-parallel ranks: the
    # responses are seeded per prompt (layout-independent) and the loss is normalised over the
    # global batch, so the metrics equal the fixed-split TP 1 run's; the micro-batching
    # columns show the padding it saved.
    out = tmp_path / "budget"
    extra = ["update.max_tokens_per_microbatch=96", "update.microbatch_length_multiple=8"]
    run_distributed(_run, 2, args=(str(out), extra), timeout=600)
    for a, b in zip(_rows(tp1), _rows(out), strict=True):
        for key in ("reward_mean", "response_len_mean", "unique_frac", "pass@4"):
            assert a[key] == b[key], key
        for key in ("loss", "entropy_mean", "clip_frac", "weight_mean", "grad_norm"):
            assert a[key] == pytest.approx(b[key], abs=1e-4, rel=1e-4), key
        assert 0 <= b["pad_frac"] < a["pad_frac"]
        assert b["microbatches_per_rank"] >= 1 and a["microbatches_per_rank"] == 2
        assert b["dp_tokens_min"] <= b["dp_tokens_max"] <= 96 * b["microbatches_per_rank"]
        assert b["balance_tokens_min"] <= b["balance_tokens_max"]


def test_init_from_a_megatron_checkpoint(tp1: Path, tmp_path: Path) -> None:
    # A new run (no resume) at TP 2 whose own initialisation would be very different
    # (init std 0.5 instead of 0.02) takes its weights from the TP 1 run's final checkpoint
    # (resharded on load). Same seed, so the same prompts: its first old-policy pass must see
    # the TP 1 run's weights, i.e. the entropy of the TP 1 run's last step's policy... which,
    # with these 3 reward-free steps (all advantages 0), is its initial policy.
    out = tmp_path / "init"
    run_distributed(
        _run,
        2,
        args=(
            str(out),
            [
                "parallel.tensor_model_parallel_size=2",
                "trainer.max_steps=1",
                "model.init_method_std=0.5",
                f"checkpoint.init_megatron={tp1 / 'checkpoints'}",
            ],
        ),
        timeout=600,
    )
    rows, first = _rows(out), _rows(tp1)[0]
    assert len(rows) == 1 and rows[0]["logprob_mismatch"] < 1e-4
    # The premise: no reward in the TP 1 run, so its weights never moved (deterministic).
    assert all(r["reward_mean"] == 0.0 for r in _rows(tp1))
    assert rows[0]["entropy_mean"] == pytest.approx(first["entropy_mean"], abs=1e-4)


def test_config_errors_exit_with_a_message(capsys) -> None:
    assert main(["examples/tiny_cpu.yaml", "rollout.groupsize=4"]) == 2
    err = capsys.readouterr().err
    assert "did you mean 'group_size'" in err
    assert main(["examples/tiny_cpu.yaml", "rollout.prompts_per_step=3"]) == 2
    assert "divisible" in capsys.readouterr().err
