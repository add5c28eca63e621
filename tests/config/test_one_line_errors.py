"""The one-line errors word by word: each test states a property of the message a user reads
(written for the survivors of a mutation run over ``reco_megatron/config/``, see
``docs/mutation_survivors.md``, "config: the one-line-error paths")."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import pytest

from reco_megatron.config import (
    USAGE,
    ConfigError,
    load_config,
    parse_cli,
    parse_override,
    read_yaml,
)
from reco_megatron.config.bounded_yaml import load_bounded
from reco_megatron.config.errors import Problems, describe_value, did_you_mean, unknown_key_message
from reco_megatron.config.overrides import parse_value
from tests.config._sample import SampleConfig


def test_describe_value_keeps_a_repr_of_60_characters_and_cuts_a_longer_one_to_60() -> None:
    assert describe_value("x" * 58) == "'" + "x" * 58 + "' (str)"  # repr: exactly 60
    assert describe_value("x" * 59) == "'" + "x" * 56 + "... (str)"  # 61 -> 57 + "..."


def test_did_you_mean_names_at_most_three_joined_by_or_and_nothing_when_none_is_close() -> None:
    assert did_you_mean("seed", ["seeds", "zzz"]) == "did you mean 'seeds'? "
    assert did_you_mean("eps_high", ["eps_hi", "eps_hig"]) == "did you mean 'eps_hig' or 'eps_hi'? "
    assert did_you_mean("ab", ["abc", "abd", "abe", "abf"]).count("'") == 6  # three names
    assert did_you_mean("seed", ["zzzz"]) == ""


def test_unknown_key_of_a_section_without_keys_says_none() -> None:
    assert (
        unknown_key_message("x", [], ()) == "unknown key 'x'; valid keys of the top level: (none)"
    )


def test_problems_is_true_only_once_something_is_recorded() -> None:
    problems = Problems()
    assert not problems
    problems.add(("seed",), "bad")
    assert problems


def test_a_later_override_of_a_section_takes_over_the_origin_of_its_keys() -> None:
    problems = Problems()
    problems.set_origin(("loss", "eps_high"), "loss.eps_high=x")
    problems.set_origin(("loss",), "loss={eps_high: y}")
    problems.add(("loss", "eps_high"), "bad")
    assert problems.items == ["loss.eps_high: bad (set by override 'loss={eps_high: y}')"]


def test_a_value_no_override_set_names_no_override() -> None:
    problems = Problems({("loss", "eps_high"): "loss.eps_high=x"})
    problems.add(("seed",), "bad")
    assert problems.items == ["seed: bad"]


def test_parse_cli_reads_sys_argv_after_the_program_name(monkeypatch) -> None:
    monkeypatch.setattr(sys, "argv", ["train", "seed=1", "debug=true"])
    assert parse_cli() == (None, ["seed=1", "debug=true"])


def test_a_first_argument_with_an_equals_sign_is_an_override_even_if_it_ends_in_yaml() -> None:
    assert parse_cli(["name=run.yaml"]) == (None, ["name=run.yaml"])


@pytest.mark.parametrize("argv", [["--cfg.yaml"], ["seed=1", "--cfg.yaml"]])
def test_a_dashed_yaml_name_is_an_option_not_a_config_file(argv: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        parse_cli(argv)
    assert info.value.problems == (
        "override '--cfg.yaml': options are not overrides; drop the dashes: loss.eps_high=0.28",
        USAGE,
    )


def test_every_argument_after_a_misplaced_config_file_is_still_checked() -> None:
    with pytest.raises(ConfigError) as info:
        parse_cli(["seed=1", "b.yaml", "x"])
    assert info.value.problems == (
        "config file 'b.yaml' must come first, before the overrides",
        "override 'x' has no '=': write dotted.key=value, e.g. loss.eps_high=0.28",
        USAGE,
    )


def test_several_problems_get_a_counted_header_and_one_with_a_file_names_it() -> None:
    assert str(ConfigError(["a", "b"])) == "invalid configuration (2 problems):\n  - a\n  - b"
    assert str(ConfigError(["a"], "f.yaml")) == "invalid configuration f.yaml (1 problem):\n  - a"


# overrides.py


def test_an_override_value_over_the_node_cap_is_quoted_to_80_characters(monkeypatch) -> None:
    monkeypatch.setenv("RECO_CONFIG_MAX_NODES", "5")
    value = "[" + ", ".join(["1"] * 40) + "]"
    with pytest.raises(ConfigError) as info:
        parse_value(value)
    (text,) = info.value.problems
    assert text.startswith(f"override value {value[:80]!r}: the YAML expands to more than 5 ")


def test_a_yaml_error_in_an_override_is_one_line_with_the_parser_s_reason() -> None:
    with pytest.raises(ConfigError) as info:
        parse_override("tags=[a, b")
    (text,) = info.value.problems
    assert text.startswith("override 'tags=[a, b': cannot parse '[a, b' as a YAML value (while ")
    assert "\n" not in text and "  " not in text and "expected ',' or ']'" in text


def test_an_override_that_is_not_a_string_is_one_line() -> None:
    with pytest.raises(ConfigError) as info:
        parse_override(5)  # type: ignore[arg-type]
    assert info.value.problems == ("override 5: expected a string such as loss.eps_high=0.28",)


def test_an_unknown_key_next_to_a_preset_key_suggests_the_preset() -> None:
    from reco_megatron.trainer.config import TrainConfig

    with pytest.raises(ConfigError) as info:
        load_config(TrainConfig, None, ["loss.presett=grpo"])
    (text,) = info.value.problems
    assert text.startswith("loss.presett: unknown key 'presett'; did you mean 'preset'? ")


def test_a_key_inside_a_scalar_leaf_is_told_to_set_it_whole() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(SampleConfig, None, ["seed.x=1"])
    assert info.value.problems == (
        "seed: has type int, not a section, so override 'seed.x=1' cannot set a key inside it; "
        "set it whole, e.g. seed=...",
    )


def test_a_key_of_a_dict_the_file_set_edits_the_file_s_dict() -> None:
    config = load_config(SampleConfig, {"reward_weights": {"code": 2.0}}, ["reward_weights.f=0.5"])
    assert config.reward_weights == {"code": 2.0, "f": 0.5}


@dataclass
class _Inner:
    weights: dict[str, float] = field(default_factory=lambda: {"a": 1.0})


@dataclass
class _Outer:
    inner: _Inner = field(default_factory=lambda: _Inner(weights={"b": 2.0}))


def test_a_key_of_a_dict_edits_the_section_s_default_instance_not_the_class_default() -> None:
    assert load_config(_Outer, None, ["inner.weights.c=3"]).inner.weights == {"b": 2.0, "c": 3.0}


@dataclass
class _Required:
    inner: _Inner


def test_a_key_of_a_dict_in_a_required_section_edits_the_class_default() -> None:
    config = load_config(_Required, {"inner": {}}, ["inner.weights.c=3"])
    assert config.inner.weights == {"a": 1.0, "c": 3.0}


# loader.py


def test_an_undecodable_file_is_one_problem_under_the_file_s_name(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_bytes(b"\xffseed: 1\n")
    with pytest.raises(ConfigError) as info:
        read_yaml(path)
    assert str(info.value) == (
        f"invalid configuration {path} (1 problem):\n  - cannot read config file: 'utf-8' codec "
        "can't decode byte 0xff in position 0: invalid start byte"
    )


def test_an_unreadable_file_is_one_problem_under_the_file_s_name(monkeypatch, tmp_path) -> None:
    path = tmp_path / "cfg.yaml"
    path.write_text("seed: 1\n")

    def refuse(self, *args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(Path, "open", refuse)
    with pytest.raises(ConfigError) as info:
        read_yaml(path)
    assert str(info.value) == (
        f"invalid configuration {path} (1 problem):\n"
        "  - cannot read config file: [Errno 13] Permission denied"
    )


def test_a_file_of_exactly_the_size_cap_is_read_and_one_byte_more_is_not(
    monkeypatch, tmp_path
) -> None:
    monkeypatch.setenv("RECO_CONFIG_MAX_BYTES", "10")
    path = tmp_path / "cfg.yaml"
    path.write_text("seed: 1234")  # 10 bytes
    assert read_yaml(path) == {"seed": 1234}
    path.write_text("seed: 12345")
    with pytest.raises(ConfigError) as info:
        read_yaml(path)
    assert str(info.value).startswith(
        f"invalid configuration {path} (1 problem):\n  - the config file is larger than 10 bytes"
    )


def test_a_repeated_key_in_a_file_is_one_problem_under_the_file_s_name(tmp_path: Path) -> None:
    path = tmp_path / "dup.yaml"
    path.write_text("seed: 1\nseed: 2\n")
    with pytest.raises(ConfigError) as info:
        read_yaml(path)
    assert str(info.value).startswith(
        f"invalid configuration {path} (1 problem):\n  - key 'seed' appears twice"
    )


def test_a_config_instance_as_source_names_no_file() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(SampleConfig, SampleConfig(), ["seed=x"])
    assert str(info.value) == "seed: expected int, got 'x' (str) (set by override 'seed=x')"


def test_a_source_of_the_wrong_type_names_its_type() -> None:
    with pytest.raises(TypeError) as info:
        load_config(SampleConfig, 5)  # type: ignore[arg-type]
    assert str(info.value) == "config source must be a YAML path, a mapping or None, got int"


def test_a_mapping_that_contains_itself_is_one_line() -> None:
    source: dict = {"seed": 1}
    source["extra"] = source
    with pytest.raises(ConfigError) as info:
        load_config(SampleConfig, source)
    assert str(info.value) == "the config refers to itself (a recursive YAML alias)"


@dataclass
class _Completed:
    seed: int = 0
    name: str = ""
    calls: ClassVar[list[dict]] = []

    @classmethod
    def complete_raw(cls, raw: dict, problems: Problems) -> None:
        cls.calls.append(dict(raw))
        raw.setdefault("name", f"seed-{raw.get('seed')}")
        if raw.get("seed", 0) < 0:
            problems.add(("seed",), "must be >= 0 to name the run")


def test_complete_raw_fills_what_the_user_left_out_and_is_skipped_after_a_problem() -> None:
    _Completed.calls.clear()
    assert load_config(_Completed, {"seed": 3}).name == "seed-3"
    assert _Completed.calls == [{"seed": 3}]
    with pytest.raises(ConfigError):
        load_config(_Completed, {"seed": 3}, ["nope=1"])
    assert len(_Completed.calls) == 1
    with pytest.raises(ConfigError) as info:  # what it finds is reported like any problem
        load_config(_Completed, {"seed": -1})
    assert info.value.problems == ("seed: must be >= 0 to name the run",)


# bounded_yaml.py


@pytest.mark.parametrize(
    ("text", "nodes"),
    [("5", 1), ("[1, 2, 3]", 4), ("{a: 1}", 3), ("{a: 1, b: [1, 2]}", 7), ("[{a: 1}, [2]]", 6)],
)
def test_the_node_cap_counts_every_value_and_key_exactly(text: str, nodes: int) -> None:
    load_bounded(text, max_nodes=nodes)
    for cap in range(1, nodes):
        with pytest.raises(ConfigError) as info:
            load_bounded(text, max_nodes=cap)
        assert info.value.problems == (
            f"the YAML expands to more than {cap} values (aliases counted as copies; near line "
            "1): is it an alias bomb? Raise the limit with the environment variable "
            "RECO_CONFIG_MAX_NODES=N if the config is meant to be this large",
        )


def test_a_limit_of_one_is_allowed_and_zero_is_not(monkeypatch) -> None:
    monkeypatch.setenv("RECO_CONFIG_MAX_NODES", "1")
    assert load_bounded("5") == 5
    monkeypatch.setenv("RECO_CONFIG_MAX_NODES", "0")
    with pytest.raises(ConfigError) as info:
        load_bounded("5")
    assert info.value.problems == (
        "RECO_CONFIG_MAX_NODES='0' must be a positive whole number (or unset)",
    )


def test_a_repeated_key_is_one_line_naming_both_lines() -> None:
    with pytest.raises(ConfigError) as info:
        load_bounded("a: 1\nb: 2\na: 3\n")
    assert info.value.problems == (
        "key 'a' appears twice in one mapping (line 1 and line 3): the second would silently "
        "replace the first; merge them into one",
    )


def test_two_merge_keys_are_not_a_repeated_key_but_a_later_repeat_is() -> None:
    text = "a: &a {x: 1}\nb: &b {y: 2}\nc:\n  <<: *a\n  <<: *b\n"
    assert load_bounded(text)["c"] == {"x": 1, "y": 2}
    with pytest.raises(ConfigError, match="key 'z' appears twice"):
        load_bounded("a: &a {x: 1}\nc: {<<: *a, z: 1, z: 2}\n")
    with pytest.raises(ConfigError, match="key 'z' appears twice"):
        load_bounded("c: {[1]: 0, z: 1, z: 2}\n")
