"""Fuzz: random YAML-ish documents and override strings never escape as anything but ConfigError.

A config file or a command line is user input: whatever it holds, the loader answers with a
config or a ConfigError listing the problems, never a TypeError / KeyError / AttributeError
traceback from inside the loader or a section's ``__post_init__``.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reco_megatron.algo.config import LossConfig
from reco_megatron.config import ConfigError, HelpRequested, load_config, parse_cli
from tests.config._sample import OptimSection, RolloutSection, SampleConfig

_NAMES = sorted(
    {
        f.name
        for cls in (SampleConfig, LossConfig, RolloutSection, OptimSection)
        for f in dataclasses.fields(cls)
    }
)
_WORDS = [
    "reco", "cispo", "vllm", "hf", "train", "eval", "yes", "no", "null", "~", "1e-6", "1e3",
    "nan", ".inf", "", " ", "a: b", "[1", "{", "0x1F", "2024-01-01", "true", "3",
]  # fmt: skip

_keys = st.sampled_from(_NAMES) | st.text(max_size=6)
_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(10**20), 10**20)
    | st.integers().map(lambda i: i * 10**400)
    | st.floats()
    | st.sampled_from(_WORDS)
    | st.text(max_size=8)
)
_trees = st.recursive(
    _scalars,
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(_keys | st.integers() | st.none() | st.booleans(), children, max_size=5)
    ),
    max_leaves=25,
)
_documents = st.dictionaries(_keys, _trees, max_size=8)


def _paths(draw: st.DrawFn) -> str:
    parts = draw(st.lists(st.sampled_from(_NAMES) | st.text(max_size=4), min_size=1, max_size=3))
    return ".".join(parts)


@st.composite
def _overrides(draw: st.DrawFn) -> str:
    kind = draw(st.integers(0, 2))
    if kind == 0:  # anything at all
        return draw(st.text(alphabet="abcdelorstx_.=-[]{},:'\" 0123456789#&*!%|>", max_size=20))
    value = draw(_trees)
    if kind == 1:  # a well-formed key with a YAML flow value
        text = yaml.safe_dump(value, default_flow_style=True, width=10**6)
        return f"{_paths(draw)}={text.removesuffix(chr(10) + '...' + chr(10)).strip()}"
    return f"{_paths(draw)}={draw(st.sampled_from(_WORDS))}"


@st.composite
def _yaml_texts(draw: st.DrawFn) -> str:
    text = yaml.safe_dump(draw(_documents), default_flow_style=draw(st.booleans()))
    for _ in range(draw(st.integers(0, 3))):  # corrupt it a little
        i = draw(st.integers(0, len(text)))
        text = text[:i] + draw(st.text(alphabet=":-[]{}&*!|>'\"#\n ?,%@`", max_size=3)) + text[i:]
    return text


def _load(source: Any, overrides: list[str]) -> None:
    try:
        config = load_config(SampleConfig, source, overrides)
    except ConfigError as exc:
        assert exc.problems and all(isinstance(p, str) and p for p in exc.problems)
    else:
        assert isinstance(config, SampleConfig)


@pytest.fixture(scope="module")
def yaml_dir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory() as tmp:
        yield Path(tmp)


_FUZZ = settings(
    max_examples=int(os.environ.get("RECO_FUZZ_EXAMPLES", "150")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


@_FUZZ
@given(document=_documents, overrides=st.lists(_overrides(), max_size=3))
def test_random_mappings_and_overrides(document: dict, overrides: list[str]) -> None:
    _load(document, overrides)


@_FUZZ
@given(text=_yaml_texts() | st.text(max_size=40), overrides=st.lists(_overrides(), max_size=2))
def test_random_yaml_files(yaml_dir: Path, text: str, overrides: list[str]) -> None:
    path = yaml_dir / "fuzz.yaml"
    path.write_text(text, encoding="utf-8", errors="surrogatepass")
    _load(path, overrides)


@_FUZZ
@given(argv=st.lists(_overrides() | st.sampled_from(["c.yaml", "-h", "x"]), max_size=4))
def test_random_command_lines(argv: list[str]) -> None:
    try:
        _, overrides = parse_cli(argv)
    except (ConfigError, HelpRequested):
        return
    _load(None, overrides)


@pytest.mark.parametrize(
    "override",
    ["loss=[1]", "loss.eps_high={a: 1}", "optim=3", "rollout.seeds={}", "extra=!!binary aGk="],
)
def test_shape_mismatches_from_overrides(override: str) -> None:
    _load({"optim": {"lr": 1}}, [override])
