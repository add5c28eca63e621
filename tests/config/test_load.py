"""load_config: every supported annotation, safe coercions, precedence, section merging."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from reco_megatron.algo.config import LossConfig
from reco_megatron.config import ConfigError, load_config
from tests.config._sample import OptimSection, RolloutSection, SampleConfig

FULL_YAML = """\
name: exp-1
seed: 7
debug: true
output_dir: /tmp/run
loss:
  objective: cispo
  token_ratio: importance
  eps_high: 0.28
  dual_clip_c: 3
rollout:
  group_size: 16
  temperature: 0.7
  stop: ["</s>", "<|eot|>"]
  seeds: [1, 2, 3]
  engine: hf
  max_tokens: 4096
optim:
  lr: 1e-6
  betas: [0.8, 0.95]
reward_weights: {math: 1.0, format: 0.5}
tags: [a, b]
extra: {anything: [1, {x: null}]}
mode: 3
budget: unlimited
"""


def _write(tmp_path: Path, text: str, name: str = "cfg.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_defaults_without_source() -> None:
    assert load_config(SampleConfig) == SampleConfig()
    assert load_config(SampleConfig, None, []) == SampleConfig()


def test_every_annotation_from_yaml(tmp_path: Path) -> None:
    cfg = load_config(SampleConfig, _write(tmp_path, FULL_YAML))
    assert (cfg.name, cfg.seed, cfg.debug) == ("exp-1", 7, True)
    assert cfg.output_dir == Path("/tmp/run") and isinstance(cfg.output_dir, Path)
    assert cfg.loss == LossConfig(
        objective="cispo", token_ratio="importance", eps_high=0.28, dual_clip_c=3.0
    )
    assert isinstance(cfg.loss.dual_clip_c, float)
    assert cfg.rollout == RolloutSection(
        group_size=16,
        temperature=0.7,
        stop=["</s>", "<|eot|>"],
        seeds=(1, 2, 3),
        engine="hf",
        max_tokens=4096,
    )
    assert cfg.optim == OptimSection(lr=1e-6, betas=(0.8, 0.95))
    assert isinstance(cfg.optim.lr, float) and isinstance(cfg.optim.betas, tuple)
    assert cfg.reward_weights == {"math": 1.0, "format": 0.5}
    assert cfg.tags == ["a", "b"]
    assert cfg.extra == {"anything": [1, {"x": None}]}
    assert cfg.mode == 3 and cfg.budget == "unlimited"


def test_str_source_is_a_path(tmp_path: Path) -> None:
    path = _write(tmp_path, "seed: 3\n")
    assert load_config(SampleConfig, str(path)).seed == 3


def test_empty_file_means_defaults(tmp_path: Path) -> None:
    assert load_config(SampleConfig, _write(tmp_path, "# nothing\n")) == SampleConfig()


@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [
        pytest.param("loss.eps_high", 1, 1.0, id="int-to-float"),
        pytest.param("loss.eps_high", "1e-1", 0.1, id="exponent-str-to-float"),
        pytest.param("loss.eps_high", "2.5E-1", 0.25, id="upper-exponent"),
        pytest.param("seed", 1000.0, 1000, id="integral-float-to-int"),
        pytest.param("seed", "1e3", 1000, id="exponent-str-to-int"),
        pytest.param("rollout.seeds", [4, 5], (4, 5), id="list-to-tuple"),
        pytest.param("output_dir", "x/y", Path("x/y"), id="str-to-path"),
        pytest.param("optim", None, None, id="optional-section-null"),
        pytest.param("rollout.max_tokens", None, None, id="optional-null"),
        pytest.param("budget", 5, 5, id="union-first-member"),
        pytest.param("budget", "all", "all", id="union-second-member"),
    ],
)
def test_safe_coercions(key: str, value: Any, expected: Any) -> None:
    section, _, leaf = key.rpartition(".")
    source = {section: {leaf: value}} if section else {leaf: value}
    cfg = load_config(SampleConfig, source)
    got = getattr(getattr(cfg, section), leaf) if section else getattr(cfg, leaf)
    assert got == expected and type(got) is type(expected)


def test_yaml_booleans_are_yaml_11(tmp_path: Path) -> None:
    # PyYAML reads unquoted yes/no/on/off as booleans; a quoted "yes" stays a string (rejected).
    assert load_config(SampleConfig, _write(tmp_path, "debug: yes\n")).debug is True
    with pytest.raises(ConfigError, match=r"debug: expected bool, got 'yes' \(str\)"):
        load_config(SampleConfig, _write(tmp_path, 'debug: "yes"\n'))


def test_precedence_defaults_file_overrides(tmp_path: Path) -> None:
    path = _write(tmp_path, "seed: 1\nloss: {eps_high: 0.28, eps_low: 0.1}\n")
    cfg = load_config(SampleConfig, path, ["seed=2", "loss.eps_high=0.3", "seed=3"])
    assert cfg.seed == 3  # the last override wins
    assert cfg.loss.eps_high == 0.3  # override beats file
    assert cfg.loss.eps_low == 0.1  # file beats default
    assert cfg.loss.c_max == 10.0  # default


def test_section_merges_onto_its_default() -> None:
    # The default rollout section has group_size 4 (the class default is 8): a file that sets
    # only the temperature keeps 4.
    cfg = load_config(SampleConfig, {"rollout": {"temperature": 0.5}})
    assert cfg.rollout.group_size == 4 and cfg.rollout.temperature == 0.5
    cfg = load_config(SampleConfig, None, ["rollout.temperature=0.5"])
    assert cfg.rollout.group_size == 4


def test_override_values_are_yaml() -> None:
    cfg = load_config(
        SampleConfig,
        None,
        [
            "loss.advantage_eps=1e-6",
            "debug=true",
            "rollout.seeds=[7, 8]",
            "rollout.stop=['a=b', \"c\"]",
            "name='001'",
            "loss.dual_clip_c=null",
            "tags=[x]",
        ],
    )
    assert cfg.loss.advantage_eps == 1e-6
    assert cfg.debug is True
    assert cfg.rollout.seeds == (7, 8)
    assert cfg.rollout.stop == ["a=b", "c"]
    assert cfg.name == "001"
    assert cfg.loss.dual_clip_c is None
    assert cfg.tags == ["x"]


def test_override_mapping_and_dict_keys() -> None:
    cfg = load_config(
        SampleConfig,
        {"loss": {"eps_low": 0.1}},
        ["loss={eps_high: 0.3}", "reward_weights.format=0.5", "extra.a.b=1"],
    )
    assert cfg.loss.eps_high == 0.3 and cfg.loss.eps_low == 0.2  # replaced, onto the default
    assert cfg.reward_weights == {"math": 1.0, "format": 0.5}
    assert cfg.extra == {"a": {"b": 1}}


def test_override_creates_optional_section_and_nulls_it() -> None:
    assert load_config(SampleConfig, None, ["optim.lr=1e-5"]).optim == OptimSection(lr=1e-5)
    cfg = load_config(SampleConfig, {"optim": {"lr": 1.0}}, ["optim=null"])
    assert cfg.optim is None
    assert load_config(SampleConfig, None, ["optim=null", "optim.lr=2"]).optim.lr == 2.0


def test_mapping_source_is_not_mutated_and_instances_are_accepted() -> None:
    source = {"loss": {"eps_high": 0.28}, "tags": ["a"]}
    snapshot = {"loss": {"eps_high": 0.28}, "tags": ["a"]}
    load_config(SampleConfig, source, ["loss.eps_high=0.3", "tags=[b]"])
    assert source == snapshot
    loss = LossConfig.preset("grpo")
    cfg = load_config(SampleConfig, {"loss": loss}, ["loss.kl_coef=0.0"])
    assert cfg.loss == dataclasses.replace(loss, kl_coef=0.0)
    assert load_config(SampleConfig, cfg) == cfg


def test_loss_config_alone() -> None:
    cfg = load_config(LossConfig, {"objective": "ppo_clip", "token_ratio": "importance"})
    assert cfg == LossConfig(objective="ppo_clip", token_ratio="importance")


@dataclasses.dataclass
class _Unsupported:
    value: set[int] = dataclasses.field(default_factory=set)


def test_programming_errors_are_type_errors() -> None:
    with pytest.raises(TypeError, match="must be dataclasses"):
        load_config(dict, {})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"unsupported annotation set\[int\]"):
        load_config(_Unsupported, {})
    with pytest.raises(TypeError, match="not one string"):
        load_config(SampleConfig, None, "seed=1")
    with pytest.raises(TypeError, match="YAML path, a mapping or None"):
        load_config(SampleConfig, 3)  # type: ignore[arg-type]
