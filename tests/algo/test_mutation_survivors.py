"""Tests written for the mutants mutmut found surviving in ``reco_megatron/algo/``.

Each test names the mutation it kills (docs/testing.md has the run, the score and the
survivors that are equivalent). Exact comparisons where the arithmetic is the same op order;
fp64 closed forms otherwise, with rtol 1e-12 (a few roundings of a handful of terms).
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch

from reco_megatron.algo import group_advantages, pass_at_k, response_weights
from reco_megatron.algo.aggregation import aggregate
from reco_megatron.algo.config import LossConfig
from reco_megatron.algo.metrics import merge_metrics, reduction_of
from reco_megatron.algo.passk import diversity_metrics
from reco_megatron.algo.policy_loss import policy_loss
from reco_megatron.algo.ratios import bernoulli_variance, importance_ratio, tis_weights, token_ratio
from reco_megatron.algo.weights import batch_response_weights, weight_logprobs

# ---- advantages -------------------------------------------------------------------------


def test_grpo_default_eps_is_one_in_a_million() -> None:
    """Kills ``eps=1e-6`` -> ``1.000001``: the default eps is what the docstring says."""
    adv, _ = group_advantages(torch.tensor([0.0, 1.0, 1.0, 3.0], dtype=torch.float64), 4)
    r = torch.tensor([0.0, 1.0, 1.0, 3.0], dtype=torch.float64)
    expected = (r - r.mean()) / (r.std() + 1e-6)
    torch.testing.assert_close(adv, expected, rtol=1e-12, atol=0)


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        # std of (0, 1), unbiased: sqrt(1/2); (R - mean) / (std + eps)
        ("grpo", [-0.5 / (math.sqrt(0.5) + 1e-6), 0.5 / (math.sqrt(0.5) + 1e-6)]),
        ("dr_grpo", [-0.5, 0.5]),
        ("rloo", [-1.0, 1.0]),  # R_i - R_j: G / (G - 1) = 2 times the centred reward
    ],
)
def test_groups_of_two(mode: str, expected: list[float]) -> None:
    """Kills ``group_size > 1`` -> ``> 2`` in the std and in RLOO's G / (G - 1) factor."""
    adv, _ = group_advantages(torch.tensor([0.0, 1.0], dtype=torch.float64), 2, mode)
    torch.testing.assert_close(adv, torch.tensor(expected, dtype=torch.float64), rtol=1e-12, atol=0)


def test_advantage_metrics_values() -> None:
    """Kills the metric mutants (values replaced, keys renamed, the empty-case switch flipped)."""
    rewards = torch.tensor([0.0, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 3.0, 0.0])
    _, m = group_advantages(rewards, 4)
    assert set(m) == {
        "num_groups/sum",
        "zero_adv_groups/sum",
        "zero_adv_frac/mean",
        "reward/mean",
        "reward_std/mean",
    }
    r = rewards.double().view(3, 4)
    assert m["num_groups/sum"].item() == 3.0
    assert m["zero_adv_groups/sum"].item() == 1.0
    assert m["zero_adv_frac/mean"].item() == pytest.approx(1 / 3, rel=1e-6)
    assert m["reward/mean"].item() == pytest.approx(r.mean().item(), rel=1e-6)
    assert m["reward_std/mean"].item() == pytest.approx(r.std(dim=1).mean().item(), rel=1e-6)


def test_one_degenerate_group_is_all_zero_advantage_groups() -> None:
    """Kills ``max(num_groups, 1)`` -> ``max(num_groups, 2)``: one group, all equal -> 1.0."""
    _, m = group_advantages(torch.ones(4), 4)
    assert m["zero_adv_frac/mean"].item() == 1.0


@pytest.mark.filterwarnings("ignore::UserWarning")  # torch: std() of no elements
def test_no_rewards_give_zero_metrics() -> None:
    """Kills the empty-batch switch of ``reward/mean`` and ``reward_std/mean`` (nan, or an
    error from ``torch.zeros(None)``)."""
    adv, m = group_advantages(torch.zeros(0), 4)
    assert adv.shape == (0,)
    assert m["reward/mean"].item() == 0.0
    assert m["reward_std/mean"].item() == 0.0


def test_half_precision_rewards_are_computed_in_fp32() -> None:
    """Kills ``dtype = promote_types(...)`` -> ``None`` and ``.to(dtype)`` -> ``.to(None)``."""
    r = torch.tensor([0.1, 0.7, 0.3, 0.9])
    adv, _ = group_advantages(r.bfloat16(), 4)
    ref, _ = group_advantages(r.bfloat16().float(), 4)
    assert adv.dtype == torch.float32
    torch.testing.assert_close(adv, ref, rtol=0, atol=0)


def test_rewards_shape_error_quotes_the_shape() -> None:
    with pytest.raises(ValueError, match=r"rewards must be 1-D \[B\*G\], got shape \(2, 2\)"):
        group_advantages(torch.zeros(2, 2), 2)


# ---- truncated importance sampling -------------------------------------------------------


def test_tis_default_cap_is_two() -> None:
    """Kills ``cap: float = 2.0`` -> ``3.0``."""
    w = tis_weights(torch.tensor([[5.0]]), torch.tensor([[0.0]]), torch.tensor([[True]]))
    assert w.item() == pytest.approx(2.0, rel=1e-6)


@pytest.mark.parametrize("cap", [0, 0.0, -1.0, math.nan, math.inf, "2"])
def test_tis_cap_must_be_a_finite_positive_number(cap: object) -> None:
    """Kills ``cap <= 0`` -> ``cap < 0`` and the ``or`` -> ``and`` mutants of the check."""
    x = torch.zeros(1, 1)
    with pytest.raises(ValueError, match=r"TIS cap must be a finite number > 0, got "):
        tis_weights(x, x, torch.ones(1, 1, dtype=torch.bool), cap=cap)  # type: ignore[arg-type]


def test_tis_shape_error_quotes_every_shape() -> None:
    with pytest.raises(ValueError, match=r"got \(1, 2\), \(1, 3\), \(1, 4\)"):
        tis_weights(torch.zeros(1, 2), torch.zeros(1, 3), torch.ones(1, 4, dtype=torch.bool))


def test_tis_half_precision_is_computed_in_fp32() -> None:
    """Kills the ``dtype`` / ``.to(dtype)`` mutants: bf16 log-probs give fp32 weights."""
    a = torch.tensor([[-1.0, -2.0, -0.5]])
    b = torch.tensor([[-1.3, -1.1, -0.2]])
    m = torch.ones(1, 3, dtype=torch.bool)
    w = tis_weights(a.bfloat16(), b, m)
    assert w.dtype == torch.float32
    torch.testing.assert_close(w, tis_weights(a.bfloat16().float(), b, m), rtol=0, atol=0)
    both_bf16 = tis_weights(a.bfloat16(), b.bfloat16(), m)  # the difference taken in fp32
    assert both_bf16.dtype == torch.float32
    ref = tis_weights(a.bfloat16().float(), b.bfloat16().float(), m)
    torch.testing.assert_close(both_bf16, ref, rtol=0, atol=0)
    # fp64 engine log-probs are cast to the trainer's fp32, not the other way round
    assert tis_weights(a, b.double(), m).dtype == torch.float32


# ---- response weights as the config sets them ---------------------------------------------


def test_batch_weights_use_the_configured_geometric_clip() -> None:
    """Kills ``w_min=cfg.geometric_w_min`` / ``w_max=...`` -> ``None`` or dropped: a clip other
    than the function's defaults must reach :func:`response_weights`."""
    cfg = LossConfig(response_weight="geometric", geometric_w_min=0.9, geometric_w_max=1.05)
    logp = torch.tensor([[-0.1, -0.1], [-3.0, -3.0], [-1.0, -1.0], [-0.5, -0.5]])
    mask = torch.ones(4, 2, dtype=torch.bool)
    w = batch_response_weights(cfg, logp, mask, 4, policy="proximal")
    ref = response_weights(logp, mask, 4, "geometric", w_min=0.9, w_max=1.05)
    torch.testing.assert_close(w, ref, rtol=0, atol=0)
    assert w.min().item() == pytest.approx(0.9) and w.max().item() == pytest.approx(1.05)


# ---- metrics' reductions -------------------------------------------------------------------


def test_reduction_is_the_last_path_component() -> None:
    """Kills ``rsplit("/", 1)`` -> ``split("/", 1)`` / ``rsplit("/", 2)`` / ``rsplit("/")``."""
    assert reduction_of("loss/kl/max") == "max"
    assert reduction_of("a/b/c/sum") == "sum"
    with pytest.raises(ValueError, match=r"must end in one of /sum\|/mean\|/min\|/max"):
        reduction_of("kl/max/other")


def test_merge_takes_the_max_of_max_keys() -> None:
    """Kills ``out[key] = stacked.max()`` -> ``None``."""
    out = merge_metrics([{"c/max": torch.tensor(1.0)}, {"c/max": torch.tensor(4.0)}])
    assert out["c/max"].item() == 4.0


# ---- pass@k and diversity --------------------------------------------------------------------


def test_diversity_order_error_quotes_the_order() -> None:
    with pytest.raises(ValueError, match=r"n-gram order must be >= 1, got 0"):
        diversity_metrics([[1, 2]], orders=(0,))


def test_pass_at_k_of_no_problems_is_empty() -> None:
    """Empty arrays give an empty result (kills ``max_n = n.max()`` taken unconditionally)."""
    empty = np.zeros(0, dtype=np.int64)
    got = pass_at_k(empty, empty, 1)
    assert got.shape == (0,)
    assert got.dtype == np.float64


def test_pass_at_k_raises_no_floating_point_warning() -> None:
    """No ``1 - k/i`` with ``i = 0`` (kills ``np.arange`` starting at 0)."""
    n = np.array([2, 4, 16, 64])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with np.errstate(all="raise"):
            for k in (1, 2):
                pass_at_k(n, n // 2, k)


# ---- the behaviour policy's log-probs -------------------------------------------------------


def test_missing_rollout_logprobs_error_says_both_fixes() -> None:
    """The message names the field to fill and the setting to change, verbatim."""
    lp = torch.zeros(2, 3)
    with pytest.raises(ValueError) as err:
        weight_logprobs(lp, None, torch.ones(2, 3), "behaviour", "geometric")
    msg = str(err.value)
    assert "fill RolloutBatch.rollout_logprobs [B, S] with them (the trainer's" in msg
    assert "rollout engines always do), or set loss.response_weight_policy=proximal to" in msg
    assert msg.endswith("weigh responses by the old-policy pass")


def test_rollout_logprobs_shape_error_quotes_both_shapes() -> None:
    with pytest.raises(ValueError, match=r"must match old_logprobs \(2, 3\), got \(2, 4\)$"):
        weight_logprobs(
            torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3), "behaviour", "geometric"
        )


def test_groups_of_one_have_zero_reward_std() -> None:
    """G = 1: no spread, ``reward_std/mean`` is 0, not the NaN of a 1-sample unbiased std."""
    _, metrics = group_advantages(torch.tensor([0.0, 1.0, 1.0]), 1)
    assert metrics["reward_std/mean"].item() == 0.0


def test_preset_names_are_the_presets_each_builds() -> None:
    """``preset_names()`` lists what ``preset()`` accepts (the config loader offers these)."""
    names = LossConfig.preset_names()
    assert {"grpo", "dapo", "dr_grpo", "cispo", "reco"} <= set(names)
    for name in names:  # dr_grpo's aggregation needs the normaliser; the others ignore it
        assert isinstance(LossConfig.preset(name, loss_normalizer=4096), LossConfig)


# ---- policy_loss's input checks ---------------------------------------------------------------


def test_policy_loss_input_errors_quote_the_shapes_and_name_the_tensor() -> None:
    cfg = LossConfig.preset("grpo", kl_coef=0.0)
    logp, adv = torch.zeros(2, 3), torch.zeros(2)
    with pytest.raises(ValueError, match=r"^logp must be \[B, T\], got shape \(2, 3, 1\)$"):
        policy_loss(logp[..., None], logp[..., None], adv, torch.ones(2, 3, 1), cfg)
    with pytest.raises(ValueError, match=r"^logp_old must match logp \(2, 3\), got \(2, 4\)$"):
        policy_loss(logp, torch.zeros(2, 4), adv, torch.ones(2, 3), cfg)


# ---- the second run's survivors (2026-12-05) -------------------------------------------------


def test_kl_old_new_metric_is_the_k3_estimator() -> None:
    """``exp(d) - d - 1`` of ``d = logp - logp_old`` over response tokens (fp64 closed form)."""
    logp = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.5, -4.0]], dtype=torch.float64)
    logp_old = torch.tensor([[-1.2, -1.0, -0.5], [-0.9, -1.4, -9.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    _, metrics = policy_loss(
        logp, logp_old, torch.tensor([1.0, -1.0]), mask, LossConfig.preset("grpo", kl_coef=0.0)
    )
    d = (logp - logp_old)[mask.bool()]
    expected = (torch.exp(d) - d - 1.0).mean().item()
    # metrics are reported in fp32: rel 1e-6 is a few fp32 roundings; the mutants move it by > 1 %
    assert metrics["kl_old_new/mean"].item() == pytest.approx(expected, rel=1e-6)
    big = torch.tensor([[30.0]], dtype=torch.float64)  # clamped at 20 both ways
    for sign in (1.0, -1.0):
        _, m = policy_loss(
            sign * big,
            torch.zeros(1, 1, dtype=torch.float64),
            torch.tensor([1.0]),
            torch.ones(1, 1),
            LossConfig.preset("grpo", kl_coef=0.0),
        )
        expected = math.exp(sign * 20.0) - sign * 20.0 - 1.0
        assert m["kl_old_new/mean"].item() == pytest.approx(expected, rel=1e-6)


def test_importance_ratio_is_clamped_at_twenty_both_ways() -> None:
    d = torch.tensor([25.0, -25.0, 3.0], dtype=torch.float64)
    r = importance_ratio(d, torch.zeros(3, dtype=torch.float64))
    expected = torch.exp(torch.tensor([20.0, -20.0, 3.0], dtype=torch.float64))
    torch.testing.assert_close(
        r, expected, rtol=1e-12, atol=0
    )  # exp(-20) is below the default atol
    tr = token_ratio(d, torch.zeros(3, dtype=torch.float64), "importance")
    torch.testing.assert_close(tr.ratio, r)
    torch.testing.assert_close(tr.raw, r)  # raw is the ratio itself in this mode


def test_token_ratio_defaults_cap_at_ten_and_keep_the_raw_value() -> None:
    # Bernoulli variance ratio p(1-p) / p_old(1-p_old): 0.25 / (0.01 * 0.99) ~ 25.3, capped at 10
    lp = torch.tensor([math.log(0.5)], dtype=torch.float64)
    lp_old = torch.tensor([math.log(0.01)], dtype=torch.float64)
    tr = token_ratio(lp, lp_old, "bernoulli")
    assert tr.raw.item() == pytest.approx(0.25 / (0.01 * 0.99), rel=1e-9)
    assert tr.ratio.item() == 10.0


def test_bernoulli_variance_of_a_certain_token_stays_positive() -> None:
    """p = 1: the clamp keeps ``1 - p >= prob_eps`` so the ratio stays finite."""
    v = bernoulli_variance(torch.zeros(1, dtype=torch.float64), 1e-6)
    assert v.item() == pytest.approx(1e-6 * (1 - 1e-6), rel=1e-9)


def test_categorical_ratio_needs_both_sums() -> None:
    lp = torch.zeros(1, 2)
    with pytest.raises(ValueError):
        token_ratio(lp, lp, "categorical", sum_p2=torch.full((1, 2), 0.5))
    with pytest.raises(ValueError):
        token_ratio(lp, lp, "categorical", sum_p2_old=torch.full((1, 2), 0.5))


def test_response_weight_errors_quote_the_shapes() -> None:
    with pytest.raises(ValueError, match=r"must both be \[B\*G, T\], got \(4, 3\) and \(4, 2\)"):
        response_weights(torch.zeros(4, 3), torch.ones(4, 2), 2)
    with pytest.raises(ValueError, match=r"response_ids must match mask \(4, 3\), got \(4, 2\)"):
        response_weights(
            torch.zeros(4, 3), torch.ones(4, 3), 2, "empirical", response_ids=torch.zeros(4, 2)
        )


def test_sequence_weights_default_to_the_clip_range_a_tenth_to_ten() -> None:
    """A certain response (log p = 0) at G = 4 gives 1/4, clipped up to ``w_min`` = 0.1 only
    when smaller; a very unlikely one would exceed 1 only through ``w_max`` = 10."""
    lp = torch.zeros(4, 2, dtype=torch.float64)
    lp[1] = -50.0
    w = response_weights(lp, torch.ones(4, 2), 4, "sequence")
    assert w[0].item() == pytest.approx(0.25)
    # geometric at G = 16 with one very unlikely response: it takes (almost) all the mass,
    # clipped to w_max = 10; the others fall to w_min = 0.1
    lp16 = torch.zeros(16, 2, dtype=torch.float64)
    lp16[0] = -50.0
    g = response_weights(lp16, torch.ones(16, 2), 16, "geometric")
    assert g[0].item() == pytest.approx(10.0, rel=1e-6)
    torch.testing.assert_close(g[1:], torch.full((15,), 0.1), rtol=1e-6, atol=0)


def test_sequence_mean_aggregations_divide_by_the_local_row_count() -> None:
    per_token = torch.arange(15, dtype=torch.float64).view(3, 5)
    mask = torch.tensor([[1, 1, 0, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
    rows = [per_token[i][mask[i].bool()] for i in range(3)]
    got = aggregate(per_token, mask, "seq_mean_token_mean")
    assert got.item() == pytest.approx(sum(float(r.mean()) for r in rows) / 3, rel=1e-12)
    got = aggregate(per_token, mask, "seq_mean_token_sum_norm", loss_normalizer=0.5)
    assert got.item() == pytest.approx(sum(float(r.sum()) / 0.5 for r in rows) / 3, rel=1e-12)
    for bad in (0, -1.0, None):
        with pytest.raises(ValueError, match=r"needs loss_normalizer > 0, got .*: pass the max"):
            aggregate(per_token, mask, "seq_mean_token_sum_norm", loss_normalizer=bad)
