"""math_reward: answer extraction, equivalent forms, wrong answers, garbage never raises."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reco_megatron.rewards.extract import answer_phrase, extract_final_answer, last_boxed
from reco_megatron.rewards.math_reward import math_reward, math_reward_result
from reco_megatron.rewards.types import GRADER_TIMEOUT, GRADER_TIMEOUT_ENV, RewardResult


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (r"so \boxed{42}.", "42"),
        (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"),
        (r"\boxed{2} no wait \boxed{\sqrt{\frac{3}{4}}}", r"\sqrt{\frac{3}{4}}"),
        (r"first \boxed{7} then broken \boxed{1", "7"),
        (r"\fbox{x^{2}}", "x^{2}"),
        (r"\boxed 5 done", "5"),
        ("The answer is 0.5.", "0.5"),
        ("answer: $x+1$\nmore text", "x+1"),
        ("I think 3 apples and 1,234 pears", "1234"),
        ("ratio 3/4", "3/4"),
        ("no digits here", None),
        ("", None),
    ],
)
def test_extract_final_answer(text: str, expected: str | None) -> None:
    assert extract_final_answer(text) == expected


def test_extract_precedence_boxed_over_phrase_over_number() -> None:
    text = "The answer is 3.\n" + r"Actually \boxed{4}" + " and 5"
    assert last_boxed(text) == "4"
    assert answer_phrase(text) == "3"
    assert extract_final_answer(text) == "4"


@pytest.mark.parametrize(
    ("response", "gold"),
    [
        (r"We get \boxed{\frac{1}{2}}.", "0.5"),
        (r"\boxed{0.5}", r"\frac{1}{2}"),
        ("The answer is 1/2", r"\frac{1}{2}"),
        (r"\boxed{\dfrac{1}{2}}", "1/2"),
        ("so the final answer is 12.", "12"),
        ("first 3, then 10", "10"),
        (r"\boxed{\frac{\sqrt{2}}{2}}", r"\frac{1}{\sqrt{2}}"),
        (r"\boxed{x+1}", "1+x"),
        (r"\boxed{\{1,2\}}", r"\{2,1\}"),
        ("The answer is 42 apples", "42"),
        ("total 1,234", "1234"),
        (r"\boxed{10.0}", "10"),
    ],
)
def test_equivalent_answers_score_one(response: str, gold: str) -> None:
    assert math_reward(response, gold) == 1.0


@pytest.mark.parametrize(
    ("response", "gold", "status"),
    [
        (r"\boxed{0.51}", "0.5", "ok"),
        ("The answer is 7", "8", "ok"),
        (r"\boxed{2} then \boxed{3}", "2", "ok"),  # the last box counts
        (r"\boxed{x+2}", "x+1", "ok"),
        ("I don't know", "3", "no_answer"),
        ("", "3", "no_answer"),
        (r"\boxed{}", "3", "no_answer"),
        (r"\boxed{" + "1" * 600 + "}", "1", "parse_failure"),
    ],
)
def test_wrong_or_missing_answers_score_zero(response: str, gold: str, status: str) -> None:
    result = math_reward_result(response, gold)
    assert result.score == 0.0
    assert result.status == status


def test_non_string_inputs_score_zero() -> None:
    assert math_reward(None, "1") == 0.0  # type: ignore[arg-type]
    assert math_reward("1", 1) == 0.0  # type: ignore[arg-type]


def test_only_the_tail_of_a_huge_response_is_read() -> None:
    response = "x" * 1_000_000 + r" \boxed{3}"
    assert math_reward(response, "3") == 1.0
    assert math_reward(r"\boxed{3}" + "x" * 1_000_000, "3") == 0.0


_latexish = st.text(
    alphabet=st.sampled_from(list("0123456789{}\\^_$()[]+-*/=., abcxyz\n")) | st.characters(),
    max_size=120,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(response=_latexish, boxed=st.booleans(), gold=st.sampled_from(["1", r"\frac{1}{2}", "x"]))
def test_garbage_gives_a_valid_score_without_raising(response: str, boxed: bool, gold: str) -> None:
    text = f"\\boxed{{{response}}}" if boxed else response
    score = math_reward(text, gold)
    assert score in (0.0, 1.0)


def test_a_grader_timeout_is_a_failure_not_a_wrong_answer(monkeypatch) -> None:
    """math_verify answers "no match" when its own timeout fires; before, that scored as a
    wrong answer (status ok) and no failure was counted."""
    monkeypatch.setenv(GRADER_TIMEOUT_ENV, "1")
    # ~13 s to grade without a limit (CPU, 2026-12-01); the 400th power took ~1.4 s, so a
    # warm process sometimes finished within the 1 s alarm and the test failed
    slow = r"\boxed{(x+1)^{1500} - (x-1)^{1500}}"
    result = math_reward_result(slow, "(x+1)^{1500} - (x-1)^{1501}")
    assert result == RewardResult(0.0, GRADER_TIMEOUT)
    assert math_reward_result(r"\boxed{2}", "2") == RewardResult(1.0, "ok")  # fast ones agree


def test_an_alarm_swallowed_inside_the_grader_is_still_a_timeout(monkeypatch) -> None:
    """sympy code that catches every exception can swallow math_verify's alarm, which then
    comes back as "no match" (this made the test above depend on where the alarm landed);
    a comparison that lasted its whole alarm is a timeout all the same."""
    import time

    import math_verify

    def swallowed(gold, pred, timeout_seconds=None, **_):
        time.sleep(timeout_seconds + 0.05)  # the alarm fired and was caught somewhere inside
        return False

    monkeypatch.setenv(GRADER_TIMEOUT_ENV, "1")
    monkeypatch.setattr(math_verify, "verify", swallowed)
    assert math_reward_result(r"\boxed{3}", "2") == RewardResult(0.0, GRADER_TIMEOUT)
