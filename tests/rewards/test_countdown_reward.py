"""countdown_reward: every enumerated solution verifies; cheats and garbage score 0."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reco_megatron.data.countdown import generate, solution_key
from reco_megatron.rewards.countdown_reward import (
    countdown_answer_key,
    countdown_reward,
    countdown_reward_result,
    countdown_worked_reward,
    countdown_worked_reward_result,
    extract_expression,
)
from reco_megatron.rewards.types import NO_ANSWER, OK, RewardResult

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


def test_worked_reward_accepts_every_generated_worked_solution() -> None:
    for problem in generate(20, seed=4, style="worked", n_numbers=4, max_number=6,
                            target_range=(5, 16), min_solutions=4):  # fmt: skip
        for solution in problem.solutions:
            response = problem.response(solution)
            assert countdown_worked_reward_result(response, problem.gold) == RewardResult(1.0, OK)
            assert countdown_answer_key(response, problem.gold) == solution_key(solution)


WORKED_GOLD = "target=25 numbers=2,3,4,5"
WORKED = (
    "[2, 3, 4, 5] 4 + 5 = 9 [2, 3, 9] 3 * 9 = 27 [2, 27] 27 - 2 = 25 [25]. Answer: 3*(4 + 5) - 2"
)


@pytest.mark.parametrize(
    ("response", "score"),
    [
        (WORKED, 1.0),
        (WORKED.replace("[2, 27]", "[7]"), 1.0),  # the lists of what remains are not graded
        (WORKED.replace("3 * 9 = 27", "3 * 9 = 28").replace("28 - 2", "27 - 2"), 0.0),  # false
        (WORKED.replace("4 + 5 = 9", "4 + 5 = 9 5 + 4 = 9"), 0.0),  # 5 and 4 used twice
        (WORKED.replace("27 - 2 = 25", "27 - 2 = 25 25 * 1 = 25"), 0.0),  # 1 not available
        (WORKED.replace("27 - 2 = 25", "27 - 3 = 24"), 0.0),  # steps stop short of the target
        ("Answer: 3*(4 + 5) - 2", 0.0),  # no steps: not a worked solution
        (WORKED.replace("Answer: 3*(4 + 5) - 2", "Answer: 3*(4 + 5) - 3"), 0.0),  # wrong answer
        ("[2, 3, 4, 5] 2 - 5 = -3 [-3, 3, 4] -3 * -3 = 9 . Answer: 2*3*4 + 5 - 4", 0.0),
    ],
)
def test_worked_reward_refuses_wrong_steps(response: str, score: float) -> None:
    assert countdown_worked_reward(response, WORKED_GOLD) == score
    # the answer-style reward grades only the final answer
    answer_only = countdown_reward(response, WORKED_GOLD)
    assert answer_only >= score


def test_worked_reward_keeps_the_answer_rewards_statuses() -> None:
    assert countdown_worked_reward_result("no answer here", WORKED_GOLD).status == NO_ANSWER
    assert countdown_worked_reward_result("4 + 5 = 9 Answer: 3*(", WORKED_GOLD).status == (
        countdown_reward_result("Answer: 3*(", WORKED_GOLD).status
    )


def test_worked_reward_and_its_answer_key_are_built_in() -> None:
    from reco_megatron.rewards.registry import BUILTIN_ANSWER_KEYS, resolve_reward

    assert resolve_reward("countdown_worked") is countdown_worked_reward_result
    key = resolve_reward("countdown_worked", BUILTIN_ANSWER_KEYS, "answer key")
    assert key(WORKED, WORKED_GOLD) == solution_key("3*(4 + 5) - 2")
