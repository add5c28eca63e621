"""config_to_dict / dump_config / load_config round trip, and the dumped YAML's shape."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from reco_megatron.algo.config import PRESETS, LossConfig
from reco_megatron.config import config_to_dict, dump_config, dumps_config, load_config
from tests.config._sample import OptimSection, RolloutSection, SampleConfig

CUSTOM = SampleConfig(
    name="true",  # a string that YAML would read as a bool unless quoted
    seed=-3,
    debug=True,
    output_dir=Path("/data/runs/x y"),
    loss=LossConfig.preset("dr_grpo", loss_normalizer=4096.0),
    rollout=RolloutSection(stop=["</s>", "1e-6", ""], seeds=(5,), engine="hf", max_tokens=7),
    optim=OptimSection(lr=3e-7, betas=(0.5, 0.25)),
    reward_weights={"math": 0.5, "format-check": 2.0},
    tags=["null", "a: b", "#c"],
    extra={"nested": {"list": [1, [2.5, None]], "flag": False}},
    mode=3,
    budget="100",
)


def test_dict_round_trip() -> None:
    assert load_config(SampleConfig, config_to_dict(CUSTOM)) == CUSTOM


def test_file_round_trip(tmp_path: Path) -> None:
    path = dump_config(CUSTOM, tmp_path / "run" / "config.yaml", header="resolved config")
    assert path.read_text().startswith("# resolved config\nname: 'true'\n")
    assert load_config(SampleConfig, path) == CUSTOM
    assert sorted(p.name for p in path.parent.iterdir()) == ["config.yaml"]  # no temp left


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_presets_round_trip(tmp_path: Path, preset: str) -> None:
    kw = {"loss_normalizer": 1024.0} if preset == "dr_grpo" else {}
    config = SampleConfig(loss=LossConfig.preset(preset, **kw))
    assert load_config(SampleConfig, dump_config(config, tmp_path / "c.yaml")) == config


def test_dump_is_stable_and_in_field_order() -> None:
    text = dumps_config(CUSTOM)
    assert text == dumps_config(load_config(SampleConfig, yaml.safe_load(text)))
    top_keys = [line.split(":")[0] for line in text.splitlines() if not line.startswith(" ")]
    assert top_keys == list(config_to_dict(CUSTOM))
    assert top_keys[:4] == ["name", "seed", "debug", "output_dir"]
    assert "  seeds: [5]\n" in text and "  betas: [0.5, 0.25]\n" in text
    assert "&" not in text and "*" not in text  # no YAML aliases


def test_config_to_dict_is_plain() -> None:
    plain = config_to_dict(CUSTOM)
    assert plain["output_dir"] == "/data/runs/x y"
    assert plain["rollout"]["seeds"] == [5] and plain["optim"]["betas"] == [0.5, 0.25]
    assert plain["loss"]["aggregation"] == "seq_mean_token_sum_norm"
    with pytest.raises(TypeError, match="dataclass instance"):
        config_to_dict(SampleConfig)


_floats = st.floats(min_value=1e-9, max_value=1e9, allow_nan=False, allow_infinity=False)
_text = st.text(max_size=12)


@st.composite
def _configs(draw: st.DrawFn) -> SampleConfig:
    return SampleConfig(
        name=draw(_text),
        seed=draw(st.integers(-(2**63), 2**63)),
        debug=draw(st.booleans()),
        output_dir=Path(draw(st.sampled_from(["a", "/b/c", "d e/f"]))),
        loss=LossConfig(
            eps_low=draw(st.floats(0.01, 0.99)),
            eps_high=draw(_floats),
            dual_clip_c=draw(st.none() | st.floats(1.01, 100.0)),
            kl_coef=draw(st.floats(0.0, 10.0)),
        ),
        rollout=RolloutSection(
            group_size=draw(st.integers(2, 1024)),
            temperature=draw(_floats),
            stop=draw(st.lists(_text, max_size=3)),
            seeds=tuple(draw(st.lists(st.integers(), max_size=3))),
            max_tokens=draw(st.none() | st.integers(1, 10**6)),
        ),
        optim=draw(st.none() | st.builds(OptimSection, lr=_floats)),
        reward_weights=draw(st.dictionaries(_text, _floats, max_size=3)),
        tags=draw(st.lists(_text, max_size=3)),
        mode=draw(st.sampled_from(["train", "eval", 3])),
        budget=draw(st.integers() | st.text(max_size=5)),
    )


@settings(max_examples=60, deadline=None)
@given(config=_configs())
def test_round_trip_property(config: SampleConfig) -> None:
    text = dumps_config(config)
    assert load_config(SampleConfig, yaml.safe_load(text)) == config
