"""Reward specs by import path: every failure names the spec and what is wrong."""

from __future__ import annotations

import math

import numpy as np
import pytest

from reco_megatron.rewards.countdown_reward import countdown_reward_result
from reco_megatron.rewards.registry import (
    BUILTIN_ANSWER_KEYS,
    RewardSpecError,
    coerce_result,
    resolve_reward,
)
from reco_megatron.rewards.types import RewardResult
from tests.rewards import _helpers

H = "tests.rewards._helpers"


def test_builtins_and_paths_resolve() -> None:
    assert resolve_reward("countdown") is countdown_reward_result
    assert resolve_reward(f"{H}:exact") is _helpers.exact


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("", "built-in name"),
        ("no_colon_here", "neither a built-in"),
        ("a:b:c", "neither a built-in"),
        ("tests.rewards.does_not_exist:fn", "cannot be imported"),
        (f"{H}:missing_fn", "has no attribute 'missing_fn'"),
        (f"{H}:NOT_CALLABLE", "is a int, not a callable"),
        (f"{H}:one_arg", "cannot be called as fn\\(response, gold\\)"),
    ],
)
def test_bad_specs_raise_with_the_spec_in_the_message(spec: str, message: str) -> None:
    with pytest.raises(RewardSpecError, match=message) as info:
        resolve_reward(spec)
    assert repr(spec) in str(info.value) or spec == ""


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (1, RewardResult(1.0, "ok")),
        (True, RewardResult(1.0, "ok")),
        (np.float32(0.25), RewardResult(0.25, "ok")),
        (RewardResult(0.5, "no_answer"), RewardResult(0.5, "no_answer")),
        ("1.0", RewardResult(0.0, "invalid")),
        (None, RewardResult(0.0, "none")),
        (math.inf, RewardResult(0.0, "nan")),
        (math.nan, RewardResult(0.0, "nan")),
        (10**400, RewardResult(0.0, "invalid")),
        (RewardResult(1.0, "bogus"), RewardResult(0.0, "invalid")),
    ],
)
def test_coerce_result(value: object, expected: RewardResult) -> None:
    assert coerce_result(value) == expected


def test_answer_keys_resolve_with_their_own_wording() -> None:
    key = resolve_reward("countdown", BUILTIN_ANSWER_KEYS, "answer key")
    assert key("Answer: 3 + 4", "target=7 numbers=3,4") == "3 + 4"
    with pytest.raises(RewardSpecError, match="answer key spec 'nope' is neither a built-in"):
        resolve_reward("nope", BUILTIN_ANSWER_KEYS, "answer key")
