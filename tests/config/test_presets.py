"""``loss.preset: NAME`` in a file or on the command line: the section starts from
``LossConfig.preset(NAME)`` and every other key of the section applies on top of it."""

from __future__ import annotations

from pathlib import Path

import pytest

from reco_megatron.algo.config import LossConfig
from reco_megatron.config import ConfigError, describe_config, load_config
from reco_megatron.trainer.config import TrainConfig

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", ["grpo", "dapo", "cispo", "reco", "reco_token_only"])
def test_override_selects_the_preset(name: str) -> None:
    assert load_config(TrainConfig, None, [f"loss.preset={name}"]).loss == LossConfig.preset(name)
    from_file = load_config(TrainConfig, {"loss": {"preset": name}})
    assert from_file.loss == LossConfig.preset(name)


def test_dr_grpo_needs_its_normaliser_and_says_so() -> None:
    with pytest.raises(ConfigError, match="loss_normalizer"):
        load_config(TrainConfig, None, ["loss.preset=dr_grpo"])
    cfg = load_config(TrainConfig, None, ["loss.preset=dr_grpo", "loss.loss_normalizer=64"])
    assert cfg.loss == LossConfig.preset("dr_grpo", loss_normalizer=64.0)


def test_keys_apply_on_top_of_the_preset_wherever_they_are_written() -> None:
    want = LossConfig.preset("grpo", eps_high=0.28, kl_coef=0.0)
    # keys before the preset on the command line, after it, and in the file under it
    for overrides in (
        ["loss.eps_high=0.28", "loss.kl_coef=0", "loss.preset=grpo"],
        ["loss.preset=grpo", "loss.eps_high=0.28", "loss.kl_coef=0"],
    ):
        assert load_config(TrainConfig, None, overrides).loss == want
    source = {"loss": {"eps_high": 0.28, "kl_coef": 0.0, "preset": "reco"}}
    assert load_config(TrainConfig, source, ["loss.preset=grpo"]).loss == want


def test_the_examples_switch_to_a_baseline_with_one_override() -> None:
    cfg = load_config(TrainConfig, ROOT / "examples/tiny_cpu.yaml", ["loss.preset=grpo"])
    assert cfg.loss == LossConfig.preset("grpo", eps_high=0.28, kl_coef=0.0)
    cfg = load_config(
        TrainConfig, ROOT / "examples/llama3.1-8b-instruct.yaml", ["loss.preset=cispo"]
    )
    assert cfg.loss.objective == "cispo" and cfg.loss.response_weight == "none"


def test_bad_preset_names_the_choices() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(TrainConfig, None, ["loss.preset=grop"])
    text = str(info.value)
    assert text.startswith("loss.preset: expected a preset, one of grpo, dapo, dr_grpo, cispo")
    assert "got 'grop' (str); did you mean 'grpo'" in text
    assert text.endswith("(set by override 'loss.preset=grop')")
    with pytest.raises(ConfigError, match=r"loss.preset: expected a preset, .* got 3 \(int\)"):
        load_config(TrainConfig, {"loss": {"preset": 3}})
    with pytest.raises(ConfigError, match=r"valid keys of 'loss': .*preset"):
        load_config(TrainConfig, None, ["loss.presett=grpo"])


def test_help_lists_the_preset_key_and_its_names() -> None:
    lines = describe_config(TrainConfig).splitlines()
    i = lines.index("loss.preset: str (optional)")
    doc = " ".join(lines[i + 1 : i + 5])
    for name in LossConfig.preset_names():
        assert name in doc
