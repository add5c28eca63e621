"""``LossConfig.__post_init__``: each check's boundary and what its error says.

Every error names the field, quotes the offending value and says what to do (STYLE.md,
guideline 7); the tests below hold each message to those three parts (the field and its
range, the value, the hint) and each range to its boundary: the first invalid value next to
the last valid one, so a ``<`` read as ``<=`` fails one of them.
"""

from __future__ import annotations

import dataclasses
import math
import re

import pytest

from reco_megatron.algo import LossConfig

# One row per check: the keywords that break it and the message, whole (re.escape'd): the
# range, the quoted value and the hint are all part of what the user reads.
MESSAGES = [
    (
        {"tis_cap": 0.0},
        "tis_cap must be a finite number > 0 or None, got 0.0 (2.0 is the TIS paper's value)",
    ),
    (
        {"tis_cap": 0.5},
        "tis_cap must be >= 1 or None, got 0.5: where the rollout engine sampled from pi_old "
        "the weight is min(1, tis_cap), so a cap below 1 scales every token down (2.0 is the "
        "TIS paper's value)",
    ),
    (
        {"eps_low": 1.0},
        "eps_low must be in (0, 1), got 1.0: the ratio's lower bound is 1 - eps_low "
        "(GRPO/DAPO use 0.2)",
    ),
    (
        {"eps_high": 0.0},
        "eps_high must be > 0, got 0.0: the ratio's upper bound is 1 + eps_high "
        "(GRPO uses 0.2, DAPO 0.28)",
    ),
    ({"dual_clip_c": 1.0}, "dual_clip_c must be > 1 or None, got 1.0 (try 3.0)"),
    ({"cispo_eps_high": 0.0}, "cispo_eps_high must be > 0, got 0.0"),
    ({"cispo_eps_low": 1.5}, "cispo_eps_low must be in (0, 1] or None, got 1.5"),
    ({"advantage_eps": 0.0}, "advantage_eps must be > 0, got 0.0 (try 1e-6)"),
    ({"prob_eps": 0.5}, "prob_eps must be in (0, 0.5), got 0.5 (try 1e-6)"),
    ({"c_max": 0.5}, "c_max must be >= 1, got 0.5: c == 1 at the old policy"),
    (
        {"c_trust_eps": 0.0},
        "c_trust_eps must be a finite number > 0 or None (= eps_high), got 0.0; to turn the "
        "trust region on c off, set c_trust=False",
    ),
    ({"max_log_ratio": 0.0}, "max_log_ratio must be > 0, got 0.0 (try 20.0)"),
    (
        {"geometric_w_min": 0.0},
        "geometric_w_min must be in (0, 1], got 0.0: weights are normalised to mean 1 before "
        "clipping",
    ),
    ({"geometric_w_max": 0.5}, "geometric_w_max must be >= 1, got 0.5"),
    ({"kl_coef": math.inf}, "kl_coef must be finite and >= 0, got inf"),
    (
        {"kl_clamp": -1.0},
        "kl_clamp must be a finite number > 0 or None, got -1.0 (10.0 matches verl and "
        "NeMo-RL; None keeps the KL estimate exact)",
    ),
    ({"entropy_coef": -0.5}, "entropy_coef must be finite and >= 0, got -0.5"),
    (
        {"objective": "ppo_clip", "token_ratio": "bernoulli"},
        "token_ratio='bernoulli' only applies to objective='reco', got objective='ppo_clip': "
        "set token_ratio='importance' or objective='reco'",
    ),
    (
        {"aggregation": "seq_mean_token_sum_norm", "loss_normalizer": 0.0},
        "aggregation='seq_mean_token_sum_norm' needs loss_normalizer > 0, got 0.0: pass the "
        "maximum response length in tokens, e.g. loss_normalizer=4096",
    ),
    ({"loss_normalizer": -2.0}, "loss_normalizer must be > 0 or None, got -2.0"),
]


@pytest.mark.parametrize(("kw", "message"), MESSAGES, ids=[str(kw) for kw, _ in MESSAGES])
def test_each_error_names_the_field_quotes_the_value_and_says_the_fix(
    kw: dict, message: str
) -> None:
    with pytest.raises(ValueError) as err:
        LossConfig(**kw)
    assert str(err.value) == message


@pytest.mark.parametrize(
    ("field", "valid", "invalid"),
    [
        # the last valid value next to the first invalid one, on each side of a range
        ("tis_cap", [1.0, 2.0, None], [0.999, -1.0, math.inf, math.nan]),
        ("eps_low", [1e-9, 0.999], [0.0, 1.0, -0.1]),
        ("eps_high", [1e-9, 5.0], [0.0, -0.1]),
        ("dual_clip_c", [1.0001, None], [1.0, 0.5]),
        ("cispo_eps_high", [1e-9], [0.0]),
        ("cispo_eps_low", [1e-9, 1.0, None], [0.0, 1.0001]),
        ("advantage_eps", [1e-12], [0.0, -1e-6]),
        ("prob_eps", [1e-12, 0.4999], [0.0, 0.5]),
        ("c_max", [1.0], [0.9999]),
        ("c_trust_eps", [1e-9, None], [0.0, -0.1, math.inf, math.nan, "0.2"]),
        ("max_log_ratio", [1e-9], [0.0]),
        ("geometric_w_min", [1e-9, 1.0], [0.0, 1.0001]),
        ("geometric_w_max", [1.0], [0.9999]),
        ("kl_coef", [0.0, 0.04], [-1e-9, math.inf, math.nan]),
        ("kl_clamp", [1e-9, None], [0.0, math.inf, "10"]),
        ("entropy_coef", [0.0], [-1e-9, math.inf]),
        ("loss_normalizer", [1e-9, None], [0.0, -1.0]),
    ],
)
def test_ranges_at_their_boundaries(field: str, valid: list, invalid: list) -> None:
    """Valid values build (and are kept as given); each invalid one raises naming the field."""
    for value in valid:
        assert getattr(LossConfig(**{field: value}), field) == value
    for value in invalid:
        with pytest.raises(ValueError, match=rf"^{field} must be "):
            LossConfig(**{field: value})


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("objective", "ppo"),
        ("advantage_mode", "grpo_std"),
        ("response_weight", "prefix-empirical"),
        ("response_weight_policy", "rollout"),
        ("token_ratio", "gini"),
        ("aggregation", "mean"),
        ("kl_estimator", "k2"),
    ],
)
def test_each_choice_lists_its_valid_values_and_quotes_the_value(field: str, value: str) -> None:
    """Each choice field is checked against its own list (a check moved to another field's
    list would let its typo through, or refuse a valid value)."""
    from reco_megatron.algo import config

    valid = {
        "objective": config.OBJECTIVES,
        "advantage_mode": config.ADVANTAGE_MODES,
        "response_weight": config.WEIGHT_MODES,
        "response_weight_policy": config.WEIGHT_POLICIES,
        "token_ratio": config.RATIO_MODES,
        "aggregation": config.AGGREGATIONS,
        "kl_estimator": config.KL_ESTIMATORS,
    }[field]
    expected = f"{field} must be one of {valid}, got {value!r}"
    with pytest.raises(ValueError, match=f"^{re.escape(expected)}$"):
        LossConfig(**{field: value})
    for good in valid:
        ok = {field: good}
        if field == "objective" and good != "reco":
            ok["token_ratio"] = "importance"  # the other objectives take no variance ratio
        if field == "aggregation" and good == "seq_mean_token_sum_norm":
            ok["loss_normalizer"] = 4096.0
        assert getattr(LossConfig(**ok), field) == good


def test_the_normaliser_is_required_only_by_its_aggregation() -> None:
    """Only ``seq_mean_token_sum_norm`` divides by ``loss_normalizer``: the other modes build
    without one, and that mode refuses ``None`` as it refuses 0."""
    for mode in ("token_mean", "seq_mean_token_mean"):
        assert LossConfig(aggregation=mode).loss_normalizer is None
    with pytest.raises(ValueError, match=r"needs loss_normalizer > 0, got None: pass"):
        LossConfig(aggregation="seq_mean_token_sum_norm")
    assert LossConfig(aggregation="seq_mean_token_sum_norm", loss_normalizer=1.0)


def test_unknown_preset_and_unknown_field_list_the_valid_ones() -> None:
    from reco_megatron.algo import PRESETS

    with pytest.raises(ValueError) as err:
        LossConfig.preset("ppo")
    assert str(err.value) == f"unknown loss preset 'ppo'; valid presets: {sorted(PRESETS)}"
    with pytest.raises(ValueError) as err:
        LossConfig.preset("grpo", eps=0.1, clip=2)
    fields = sorted(f.name for f in dataclasses.fields(LossConfig))
    assert str(err.value) == f"unknown LossConfig field(s) ['clip', 'eps']; valid: {fields}"
