"""field_docs (docstrings under fields, read with ast) and describe_config."""

from __future__ import annotations

import dataclasses

import pytest

from reco_megatron.algo.config import LossConfig
from reco_megatron.config import describe_config, field_docs
from tests.config._sample import RolloutSection, SampleConfig


@dataclasses.dataclass(kw_only=True)
class _Base:
    a: int = 1
    """Doc of a."""

    b: int = 2
    # b has a comment, not a doc

    c: int = 3
    """Doc of c in the base."""


@dataclasses.dataclass(kw_only=True)
class _Child(_Base):
    c: int = 4
    """Doc of c in the child."""

    d: str = "x"
    """Multi-line doc
        of d, indented."""


def test_every_loss_config_field_is_documented() -> None:
    docs = field_docs(LossConfig)
    names = [f.name for f in dataclasses.fields(LossConfig)]
    assert list(docs) == names
    assert all(len(doc) > 10 for doc in docs.values())
    assert docs["eps_high"].startswith("PPO clip above: the ratio r may rise to")


def test_string_annotations_and_other_modules() -> None:
    docs = field_docs(SampleConfig)
    assert set(docs) == {f.name for f in dataclasses.fields(SampleConfig)}
    assert docs["optim"] == "Optimizer; null keeps the trainer's default."
    assert field_docs(RolloutSection)["group_size"] == "Responses per prompt (>= 2)."


def test_inheritance_and_cleanup() -> None:
    docs = field_docs(_Child)
    assert docs == {
        "a": "Doc of a.",
        "c": "Doc of c in the child.",
        "d": "Multi-line doc\nof d, indented.",
    }
    assert field_docs(_Base)["c"] == "Doc of c in the base."


def test_local_class_and_class_without_source() -> None:
    @dataclasses.dataclass
    class Local:
        x: int = 0
        """Doc of a local class's field."""

    assert field_docs(Local) == {"x": "Doc of a local class's field."}
    made = dataclasses.make_dataclass("Made", [("x", int, dataclasses.field(default=0))])
    assert field_docs(made) == {}
    with pytest.raises(TypeError, match="expects a dataclass"):
        field_docs(int)


def test_describe_config_lists_dotted_keys_types_defaults_docs() -> None:
    text = describe_config(SampleConfig)
    lines = text.splitlines()
    assert lines[0] == "SampleConfig: A trainer-like config for the loader's tests."
    assert "seed: int = 0" in lines
    assert "output_dir: path = runs/default" in lines
    assert "loss.eps_high: float = 0.2" in lines
    assert "loss.objective: 'ppo_clip' | 'reco' | 'cispo' = reco" in lines
    assert "loss.dual_clip_c: float | None = null" in lines
    assert "rollout.group_size: int = 4" in lines  # the section default's value, not 8
    assert "rollout.seeds: tuple[int, ...] = [1, 2]" in lines
    assert "optim:  (OptimSection | None; optional section, default null)" in lines
    assert "optim.lr: float (required)" in lines
    assert "reward_weights: dict[str, float] = {math: 1.0}" in lines
    i = lines.index("loss.eps_high: float = 0.2")
    assert lines[i + 1].startswith("    PPO clip above")
    for name in field_docs(LossConfig):
        assert any(line.startswith(f"loss.{name}: ") for line in lines), name
