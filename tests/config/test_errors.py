"""Every kind of ConfigError, with its message: path, offending value, suggestion."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from reco_megatron.config import ConfigError, load_config, parse_override
from tests.config._sample import SampleConfig


def _error(source: Any = None, overrides: tuple[str, ...] = ()) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_config(SampleConfig, source, overrides)
    return info.value


def _one(source: Any = None, overrides: tuple[str, ...] = ()) -> str:
    error = _error(source, overrides)
    assert len(error.problems) == 1, error.problems
    return error.problems[0]


@pytest.mark.parametrize(
    ("source", "message"),
    [
        pytest.param(
            {"loss": {"eps_high": "abc"}},
            "loss.eps_high: expected float, got 'abc' (str)",
            id="float",
        ),
        pytest.param({"seed": 1.5}, "seed: expected int, got 1.5 (float)", id="int"),
        pytest.param({"seed": True}, "seed: expected int, got True (bool)", id="bool-not-int"),
        pytest.param(
            {"loss": {"eps_high": False}},
            "loss.eps_high: expected float, got False (bool)",
            id="bool-not-float",
        ),
        pytest.param(
            {"debug": "yes"},
            "debug: expected bool, got 'yes' (str); write true or false",
            id="bool",
        ),
        pytest.param(
            {"name": 2024},
            "name: expected str, got 2024 (int); quote it to pass a string, e.g. '2024'",
            id="str",
        ),
        pytest.param(
            {"rollout": {"seeds": [1, "x"]}},
            "rollout.seeds[1]: expected int, got 'x' (str)",
            id="list-item-path",
        ),
        pytest.param(
            {"optim": {"lr": 1.0, "betas": [0.9]}},
            "optim.betas: expected 2 items (tuple[float, float]), got [0.9] (list)",
            id="tuple-length",
        ),
        pytest.param({"tags": "a"}, "tags: expected a list (list[str]), got 'a' (str)", id="list"),
        pytest.param(
            {"reward_weights": {"math": "high"}},
            "reward_weights.math: expected float, got 'high' (str)",
            id="dict-value-path",
        ),
        pytest.param(
            {"reward_weights": {1: 1.0}},
            "reward_weights: key 1 (int) is not a string; quote it: '1'",
            id="dict-key",
        ),
        pytest.param(
            {"loss": 0.2},
            "loss: expected a mapping (section LossConfig), got 0.2 (float)",
            id="section",
        ),
        pytest.param(
            {"rollout": {"engine": "vlm"}},
            "rollout.engine: expected one of 'vllm', 'hf', got 'vlm' (str); did you mean 'vllm'?",
            id="literal",
        ),
        pytest.param(
            {"mode": "3"},
            "mode: expected one of 'train', 'eval', 3, got '3' (str)",
            id="literal-type",
        ),
        pytest.param({"budget": 1.5}, "budget: expected int | str, got 1.5 (float)", id="union"),
        pytest.param(
            {"seed": 10**400 if False else None},
            "seed: expected int, got None (NoneType)",
            id="null",
        ),
        pytest.param(
            {"loss": {"eps_high": 10**400}},
            "loss.eps_high: expected float, got 1000",
            id="huge-int",
        ),
    ],
)
def test_type_errors_quote_path_and_value(source: dict, message: str) -> None:
    assert _one(source).startswith(message)


def test_unknown_key_suggests_and_lists_section_keys() -> None:
    text = _one({"loss": {"eps_hgh": 0.3}})
    assert text.startswith("loss.eps_hgh: unknown key 'eps_hgh'; did you mean 'eps_high'")
    assert "valid keys of 'loss': advantage_eps, advantage_mode, aggregation," in text
    top = _one({"sede": 1})
    assert "did you mean 'seed'?" in top and "valid keys of the top level: budget, debug," in top
    nothing_close = _one({"rollout": {"zzzz": 1}})
    assert "did you mean" not in nothing_close
    assert "valid keys of 'rollout': engine, group_size, max_tokens, seeds, stop, temperature" in (
        nothing_close
    )


def test_unknown_override_key_gets_the_same_suggestion() -> None:
    text = _one(None, ("loss.eps_hgh=0.3",))
    assert text.startswith("loss.eps_hgh: unknown key 'eps_hgh'; did you mean 'eps_high'")
    assert text.endswith("(in override 'loss.eps_hgh=0.3')")
    assert "did you mean 'rollout'?" in _one(None, ("rolout.group_size=2",))


def test_a_replaced_key_says_what_replaced_it() -> None:
    """A key older configs had (``REPLACED_KEYS`` of its section) is refused with the key that
    replaced it, in a file and in an override alike, instead of a plain "unknown key"."""
    from reco_megatron.trainer.config import TrainConfig

    for source, overrides in (
        ({"trainer": {"tensorboard": False}}, ()),
        (None, ("trainer.tensorboard=false",)),
    ):
        with pytest.raises(ConfigError) as info:
            load_config(TrainConfig, source, overrides)
        (text,) = info.value.problems
        assert text.startswith("trainer.tensorboard: key 'tensorboard' is no longer read: ")
        assert "trainer.loggers=[] for none" in text and "unknown key" not in text


def test_bad_override_value_names_the_override() -> None:
    text = _one(None, ("loss.eps_high=abc",))
    assert text == (
        "loss.eps_high: expected float, got 'abc' (str) (set by override 'loss.eps_high=abc')"
    )


@pytest.mark.parametrize(
    ("override", "pattern"),
    [
        ("loss.eps_high", r"override 'loss.eps_high' has no '=': write dotted.key=value, e\.g\."),
        ("--loss.eps_high=1", r"options are not overrides; drop the dashes"),
        ("loss..eps_high=1", r"malformed key 'loss..eps_high'"),
        ("=1", r"malformed key ''"),
        ("loss.eps high=1", r"malformed key 'loss.eps high'"),
        ("loss.eps_high=", r"empty value; write loss.eps_high=null for None"),
        ("tags=[a, b", r"override 'tags=\[a, b': cannot parse '\[a, b' as a YAML value"),
        ("name=2024-13-45", r"cannot parse '2024-13-45' as a YAML value"),
    ],
)
def test_malformed_overrides(override: str, pattern: str) -> None:
    assert re.search(pattern, _one(None, (override,)))
    with pytest.raises(ConfigError, match=pattern):
        parse_override(override)


def test_override_through_a_leaf() -> None:
    text = _one(None, ("rollout.stop.x=1",))
    assert text.startswith("rollout.stop: has type list[str], not a section")
    assert "set it whole, e.g. rollout.stop=[...]" in text
    assert _one(None, ("seed.x=1",)).startswith("seed: has type int, not a section")


def test_missing_required_field() -> None:
    assert _one({"optim": {"weight_decay": 0.1}}) == "optim.lr: missing required field (float)"


def test_post_init_errors_are_prefixed_with_the_section() -> None:
    assert _one({"loss": {"eps_low": 1.5}}).startswith(
        "loss: eps_low must be in (0, 1), got 1.5: the ratio's lower bound is 1 - eps_low"
    )
    assert _one(None, ("rollout.group_size=1",)).startswith(
        "rollout: group_size must be >= 2, got 1: GRPO needs groups"
    )
    with pytest.raises(ConfigError, match=r"^LossConfig: eps_high must be > 0, got -1.0"):
        load_config(type(SampleConfig().loss), {"eps_high": -1.0})


def test_all_problems_are_collected(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(
        "loss: {eps_hgh: 1, eps_low: abc}\noptim: {}\nrollout: {engine: vlm, group_size: 1}\n"
    )
    error = _error(path, ("seed=abc", "loss.aggregaton=x", "nope"))
    assert len(error.problems) == 7, error.problems
    rendered = str(error)
    assert rendered.startswith(f"invalid configuration {path} (7 problems):\n  - ")
    for fragment in (
        "override 'nope' has no '='",
        "loss.aggregaton: unknown key",
        "loss.eps_hgh: unknown key",
        "loss.eps_low: expected float, got 'abc' (str)",
        "optim.lr: missing required field",
        "rollout.engine: expected one of",
        "seed: expected int, got 'abc' (str)",
    ):
        assert fragment in rendered
    # rollout's own post-init does not run while its engine is wrong
    assert "group_size must be" not in rendered
    assert isinstance(error, ValueError)


@pytest.mark.parametrize(
    ("text", "pattern"),
    [
        ("loss: [1, 2\n", r"invalid YAML: while parsing a flow sequence"),
        ("- 1\n- 2\n", r"the top level must be a mapping of keys to values, got \[1, 2\] \(list\)"),
        ("a: &x [*x]\n", r"refers to itself \(a recursive YAML alias\)"),
        ("a: !!python/object:os.system {}\n", r"invalid YAML: could not determine a constructor"),
        ("seed: 2024-13-45\n", r"invalid YAML: month must be in 1..12"),
    ],
)
def test_bad_files(tmp_path: Path, text: str, pattern: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=pattern) as info:
        load_config(SampleConfig, path)
    assert str(path) in str(info.value) or "itself" in str(info.value)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"config file not found: '.*nope.yaml'"):
        load_config(SampleConfig, tmp_path / "nope.yaml")
