"""LossConfig validation (errors quote the value) and presets."""

import dataclasses

import pytest

from reco_megatron.algo import PRESETS, LossConfig


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        pytest.param({"eps_low": 1.5}, r"eps_low must be in \(0, 1\), got 1.5", id="eps_low"),
        pytest.param({"eps_high": -0.1}, r"eps_high must be > 0, got -0.1", id="eps_high"),
        pytest.param({"dual_clip_c": 0.5}, r"dual_clip_c must be > 1 or None, got 0.5", id="dual"),
        pytest.param({"c_max": 0.5}, r"c_max must be >= 1, got 0.5", id="c_max"),
        pytest.param({"prob_eps": 0.7}, r"prob_eps must be in \(0, 0.5\), got 0.7", id="prob_eps"),
        pytest.param({"kl_coef": -1.0}, r"kl_coef must be finite and >= 0, got -1.0", id="kl"),
        pytest.param(
            {"kl_clamp": 0.0}, r"kl_clamp must be a finite number > 0 or None, got 0.0", id="kc0"
        ),
        pytest.param(
            {"kl_clamp": float("inf")}, r"kl_clamp must be .* got inf .*10.0", id="kc-inf"
        ),
        pytest.param(
            {"objective": "ppo"}, r"objective must be one of .* got 'ppo'", id="objective"
        ),
        pytest.param(
            {"aggregation": "mean"}, r"aggregation must be one of .* got 'mean'", id="aggregation"
        ),
        pytest.param(
            {"aggregation": "seq_mean_token_sum_norm"},
            r"needs loss_normalizer > 0, got None.*loss_normalizer=4096",
            id="normalizer",
        ),
        pytest.param(
            {"objective": "cispo", "token_ratio": "bernoulli"},
            r"token_ratio='bernoulli' only applies to objective='reco'",
            id="ratio-objective",
        ),
        pytest.param(
            {"response_weight": "prefix-empirical"},
            r"response_weight must be one of .*'prefix', 'prefix_empirical'.* got "
            r"'prefix-empirical'",
            id="weight-mode",
        ),
        pytest.param(
            {"geometric_w_min": 2.0}, r"geometric_w_min must be in \(0, 1\], got 2.0", id="w_min"
        ),
    ],
)
def test_validation_quotes_value(kw: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        LossConfig(**kw)


@pytest.mark.parametrize("mode", ["prefix", "prefix_empirical"])
def test_per_token_weight_modes_are_valid_with_every_objective(mode: str) -> None:
    for preset in PRESETS:
        assert (
            LossConfig.preset(preset, response_weight=mode, loss_normalizer=4.0).response_weight
            == mode
        )


def test_kw_only() -> None:
    with pytest.raises(TypeError):
        LossConfig("reco")  # type: ignore[misc]


def test_every_field_has_a_docstring() -> None:
    import inspect

    from reco_megatron.algo import config

    src = inspect.getsource(config.LossConfig)
    for f in dataclasses.fields(LossConfig):
        after = src.split(f"    {f.name}:", 1)[1].split("\n", 2)[1].strip()
        assert after.startswith('"""'), f"field {f.name} has no docstring"


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_build(name: str) -> None:
    extra = {"loss_normalizer": 1024.0} if name == "dr_grpo" else {}
    cfg = LossConfig.preset(name, **extra)
    assert isinstance(cfg, LossConfig)


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        pytest.param("grpo", dict(objective="ppo_clip", eps_low=0.2, eps_high=0.2, kl_coef=0.04)),
        pytest.param(
            "dapo", dict(eps_low=0.2, eps_high=0.28, kl_coef=0.0, aggregation="token_mean")
        ),
        pytest.param(
            "dr_grpo", dict(advantage_mode="dr_grpo", aggregation="seq_mean_token_sum_norm")
        ),
        pytest.param("cispo", dict(objective="cispo", cispo_eps_high=0.2, cispo_eps_low=None)),
        pytest.param(
            "reco", dict(objective="reco", response_weight="sequence", token_ratio="bernoulli")
        ),
        pytest.param(
            "reco_response_only", dict(response_weight="sequence", token_ratio="importance")
        ),
        pytest.param("reco_token_only", dict(response_weight="none", token_ratio="bernoulli")),
    ],
)
def test_preset_values(name: str, expected: dict) -> None:
    cfg = LossConfig.preset(name, loss_normalizer=1024.0)
    for key, value in expected.items():
        assert getattr(cfg, key) == value, (name, key)


def test_one_reco_default() -> None:
    """``LossConfig()``, the ``reco`` preset and a run config without a ``loss`` section are
    one and the same loss (no KL term)."""
    from reco_megatron.trainer.config import TrainConfig

    assert LossConfig() == LossConfig.preset("reco") == TrainConfig().loss
    assert LossConfig().kl_coef == 0.0
    for name in ("reco_plain", "reco_response_only", "reco_token_only"):
        assert LossConfig.preset(name).kl_coef == 0.0, name


def test_preset_overrides_and_errors() -> None:
    assert LossConfig.preset("reco", eps_high=0.28).eps_high == 0.28
    with pytest.raises(ValueError, match=r"unknown loss preset 'ppo'.*'cispo'.*'reco'"):
        LossConfig.preset("ppo")
    with pytest.raises(ValueError, match=r"unknown LossConfig field\(s\) \['eps'\]"):
        LossConfig.preset("grpo", eps=0.1)
    with pytest.raises(ValueError, match="loss_normalizer"):
        LossConfig.preset("dr_grpo")
