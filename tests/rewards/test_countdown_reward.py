"""countdown_reward: every enumerated solution verifies; cheats and garbage score 0."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reco_megatron.data.countdown import generate
from reco_megatron.rewards.countdown_reward import (
    countdown_answer_key,
    countdown_reward,
    countdown_reward_result,
    extract_expression,
)

GOLD = "target=24 numbers=3,5,7,9"


def test_every_solution_of_generated_problems_scores_one() -> None:
    for problem in generate(20, seed=3, min_solutions=3):
        assert len(problem.solutions) >= 3
        for solution in problem.solutions:
            assert countdown_reward(f"Let me try.\nAnswer: {solution}", problem.gold) == 1.0


@pytest.mark.parametrize(
    "response",
    [
        "Answer: 9 + 3*5",
        "Answer: (7 - 5)*(3 + 9)",
        "work...\n(7 - 5)*(3 + 9) = 24",
        r"so \boxed{3 + 5 + 7 + 9}",
        "**Answer:** `5*9 - 3*7`.",
    ],
)
def test_correct_expressions(response: str) -> None:
    assert countdown_reward(response, GOLD) == 1.0


@pytest.mark.parametrize(
    ("response", "status"),
    [
        ("Answer: 3*3 + 15", "ok"),  # 3 used twice, 15 not given
        ("Answer: 24", "ok"),  # the target itself is not a given number
        ("Answer: 9 + 3*5 + 1", "ok"),  # wrong value
        ("Answer: 9 + 9 + 3 + 3", "ok"),  # reuse
        ("Answer: 9**2", "parse_failure"),
        ("Answer: __import__('os').system('true')", "parse_failure"),
        ("Answer: 48/2", "parse_failure"),
        ("no idea", "no_answer"),
    ],
)
def test_wrong_or_unfair_expressions_score_zero(response: str, status: str) -> None:
    result = countdown_reward_result(response, GOLD)
    assert (result.score, result.status) == (0.0, status)


def test_extract_expression_strips_trailing_target() -> None:
    assert extract_expression("Answer: 9 + 3*5 = 24.") == "9 + 3*5"


def test_malformed_gold_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="target=24 numbers=3,5,7,9"):
        countdown_reward("Answer: 1", "24")


@settings(max_examples=150, deadline=None)
@given(st.text(max_size=300))
def test_garbage_scores_zero_without_raising(response: str) -> None:
    assert countdown_reward(response, GOLD) in (0.0, 1.0)


def test_answer_key_names_the_solution_whatever_the_wording() -> None:
    a = countdown_answer_key("I try 9 + 3*5.\nAnswer: 9 + 3*5", GOLD)
    b = countdown_answer_key("Answer: 5*3+9 = 24", GOLD)
    assert a == b == "9 + 3*5"
    assert countdown_answer_key("Answer: (7 - 5)*(3 + 9)", GOLD) != a
    assert countdown_answer_key("no answer here", GOLD) is None
    assert countdown_answer_key(None, GOLD) is None  # type: ignore[arg-type]
