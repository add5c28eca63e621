"""What the algo functions say when an input is missing or has the wrong shape.

Each error is read by someone who passed the wrong thing: it names the tensor, quotes the
shapes or value it got and says how to fix it. The tests compare the whole one-line message,
so a message that names the wrong tensor, drops the fix or loses its shape fails here.
"""

from __future__ import annotations

import pytest
import torch

from reco_megatron.algo import LossConfig, TokenStats, policy_loss
from reco_megatron.algo.advantages import check_groups
from reco_megatron.algo.aggregation import aggregate
from reco_megatron.algo.policy_loss import c_growth
from reco_megatron.algo.ratios import token_ratio
from reco_megatron.algo.weights import empirical_counts, prefix_counts, response_weights

GRPO = LossConfig.preset("grpo", kl_coef=0.0)


def _message(fn, *args, **kwargs) -> str:
    with pytest.raises(ValueError) as err:
        fn(*args, **kwargs)
    return str(err.value)


def _stats(b: int, t: int) -> TokenStats:
    z = torch.zeros(b, t)
    return TokenStats(logprob=z, entropy=z, sum_p2=z + 0.5)


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("logp_old", "logp_old must match logp (2, 3), got (2, 4)"),
        ("mask", "mask must match logp (2, 3), got (2, 4)"),
        ("ref_logp", "ref_logp must match logp (2, 3), got (2, 4)"),
    ],
)
def test_a_mismatched_tensor_is_named_with_both_shapes(name: str, message: str) -> None:
    """Each [B, T] input is checked under its own name, through policy_loss itself."""
    inputs = {"logp_old": torch.zeros(2, 3), "mask": torch.ones(2, 3), "ref_logp": None}
    inputs[name] = torch.zeros(2, 4)
    cfg = GRPO if name != "ref_logp" else LossConfig.preset("grpo")  # kl_coef 0.04
    got = _message(
        policy_loss,
        torch.zeros(2, 3),
        inputs["logp_old"],
        torch.zeros(2),
        inputs["mask"],
        cfg,
        ref_logp=inputs["ref_logp"],
    )
    assert got == message


def test_advantages_must_be_one_per_row() -> None:
    """[B] = [2] from logp's first axis (T = 3 is not B), and the shape that came."""
    got = _message(
        policy_loss, torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(3), torch.ones(2, 3), GRPO
    )
    assert got == "advantages must be [B] = [2], got (3,)"


def test_weights_must_be_per_response_or_per_token() -> None:
    cfg = LossConfig.preset("reco")
    x = torch.zeros(2, 3)
    got = _message(policy_loss, x, x, torch.zeros(2), torch.ones(2, 3), cfg, weights=torch.ones(3))
    assert got == (
        "weights must be [B] = [2] (per response) or [B, T] = [2, 3] (per token, the prefix "
        "modes), got (3,)"
    )


@pytest.mark.parametrize(
    ("cfg", "message"),
    [
        (
            LossConfig.preset("reco"),
            "cfg.response_weight='sequence' needs weights= [B]: compute them with "
            "response_weights(logp_old, mask, group_size, mode) on complete groups before "
            "splitting the batch, or set response_weight='none'",
        ),
        (
            LossConfig.preset("grpo", kl_coef=0.0, entropy_coef=0.01),
            "entropy_coef=0.01 needs stats= (TokenStats of the current policy, with entropy); "
            "pass it or set entropy_coef=0",
        ),
        (
            LossConfig.preset("grpo"),
            "kl_coef=0.04 needs ref_logp= [B, T] from the reference policy; pass it or set "
            "kl_coef=0",
        ),
        (
            LossConfig.preset("grpo", kl_coef=0.0, tis_cap=2.0),
            "tis_cap=2.0 needs rollout_logp= [B, T] (the inference engine's log-probs); pass it "
            "or set tis_cap=None",
        ),
    ],
    ids=["weights", "stats", "ref_logp", "rollout_logp"],
)
def test_a_missing_input_is_named_with_both_fixes(cfg: LossConfig, message: str) -> None:
    x = torch.zeros(2, 3)
    assert _message(policy_loss, x, x, torch.zeros(2), torch.ones(2, 3), cfg) == message


@pytest.mark.parametrize("given", ["stats", "stats_old", "neither"])
def test_the_categorical_ratio_needs_both_policies_stats(given: str) -> None:
    """Either one missing is an error, not only both: the ratio divides one by the other."""
    cfg = LossConfig.preset("reco", response_weight="none", token_ratio="categorical")
    x = torch.zeros(2, 3)
    kw = {given: _stats(2, 3)} if given != "neither" else {}
    got = _message(policy_loss, x, x, torch.zeros(2), torch.ones(2, 3), cfg, **kw)
    assert got == (
        "token_ratio='categorical' needs stats= and stats_old= (TokenStats with sum_p2 of the "
        "current and the old policy)"
    )


def test_token_ratio_errors() -> None:
    x = torch.zeros(2, 3)
    assert _message(token_ratio, x, x, "gini") == (
        "token ratio mode must be one of ('importance', 'bernoulli', 'categorical'), got 'gini'"
    )
    assert _message(token_ratio, x, x, "categorical", sum_p2=x) == (
        "token ratio mode 'categorical' needs sum_p2 and sum_p2_old (TokenStats.sum_p2 of the "
        "current and the old policy); pass stats= and stats_old= to policy_loss"
    )


def test_c_growth_errors() -> None:
    x = torch.zeros(2, 3)
    assert _message(c_growth, x, "categorical") == (
        "c_growth for token_ratio='categorical' needs sum_p2 [B, T]"
    )
    assert _message(c_growth, x, "importance") == (
        "c_growth is defined for the variance ratios 'bernoulli' and 'categorical', got "
        "'importance'"
    )


def test_group_errors_say_what_was_counted_and_why_groups_must_be_whole() -> None:
    assert _message(check_groups, 4, 0) == "group_size must be >= 1, got 0"
    assert _message(check_groups, 5, 2) == (
        "5 rows is not a multiple of group_size=2: statistics are computed per complete group, "
        "so pass whole groups (before any split into micro-batches or ranks)"
    )
    ids, mask = torch.zeros(5, 2, dtype=torch.long), torch.ones(5, 2)
    # the counting functions are public too, and count "responses" themselves
    for fn in (empirical_counts, prefix_counts):
        assert _message(fn, ids, mask, 2).startswith(
            "5 responses is not a multiple of group_size=2: "
        ), fn.__name__


def test_unknown_modes_list_the_valid_ones() -> None:
    x = torch.zeros(2, 3)
    assert _message(response_weights, x, torch.ones(2, 3), 2, "uniform") == (
        "response weight mode must be one of ('sequence', 'geometric', 'empirical', 'prefix', "
        "'prefix_empirical', 'none'), got 'uniform'"
    )
    assert _message(aggregate, x, torch.ones(2, 3), "mean") == (
        "aggregation must be one of ('token_mean', 'seq_mean_token_mean', "
        "'seq_mean_token_sum_norm'), got 'mean'"
    )
