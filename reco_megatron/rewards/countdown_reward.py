"""Reward for the synthetic countdown task (:mod:`reco_megatron.data.countdown`).

The response's final expression is taken from, in order: the last ``Answer: ...`` line, the
last ``\\boxed{...}``, else the last line made only of digits, ``+ - *``, parentheses and
spaces. A trailing ``= T`` is dropped. The expression is parsed by the safe recursive-descent
parser of :mod:`reco_megatron.data.arith` (no ``eval``); it scores 1.0 when it equals the
target and uses each given number at most once, else 0.0.

``countdown_worked`` grades the ``worked`` style
(:func:`reco_megatron.data.countdown.worked_response`): the final answer as above, and the
steps ``a op b = c`` written before ``Answer:`` must be true and use only numbers then
available (each given number and each earlier result once), with at least one step and the
last one reaching the target; otherwise 0.0 (status ``ok``).
The bracketed lists of remaining numbers are not graded (they restate the steps).
"""

from __future__ import annotations

import re
from collections import Counter

from reco_megatron.data.arith import ArithmeticParseError, parse_arithmetic
from reco_megatron.data.countdown import parse_gold, solution_key
from reco_megatron.rewards.extract import last_boxed
from reco_megatron.rewards.types import NO_ANSWER, OK, PARSE_FAILURE, RewardResult

MAX_RESPONSE_CHARS = 4096
_ANSWER_RE = re.compile(r"answer\s*:\s*(.*)", re.IGNORECASE)
_EXPR_LINE_RE = re.compile(r"[\d\s+\-*()]+(?:=\s*-?\d+)?")
_TRAILING_EQ_RE = re.compile(r"\s*=\s*-?\d+\s*$")
_STEP_RE = re.compile(r"(-?\d+)\s*([+*-])\s*(-?\d+)\s*=\s*(-?\d+)")
_ANSWER_AT_RE = re.compile(r"answer\s*:", re.IGNORECASE)
_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def extract_expression(response: str) -> str | None:
    """The final expression of a countdown response (see module docstring), else None."""
    text = response[-MAX_RESPONSE_CHARS:]
    lines = text.splitlines()
    candidate = None
    for line in reversed(lines):
        match = _ANSWER_RE.search(line)
        if match and match.group(1).strip():
            candidate = match.group(1)
            break
    if candidate is None:
        candidate = last_boxed(text)
    if candidate is None:
        for line in reversed(lines):
            if line.strip() and _EXPR_LINE_RE.fullmatch(line.strip()):
                candidate = line
                break
    if candidate is None:
        return None
    candidate = candidate.strip().strip("$`*. ").strip()
    return _TRAILING_EQ_RE.sub("", candidate) or None


def countdown_reward_result(response: str, gold: str) -> RewardResult:
    """:func:`countdown_reward` with its status. ``gold``: ``"target=24 numbers=3,5,7,9"``."""
    target, numbers = parse_gold(gold)  # a bad gold is a data bug: raise, quoting it
    if not isinstance(response, str):
        return RewardResult(0.0, PARSE_FAILURE)
    expression = extract_expression(response)
    if expression is None:
        return RewardResult(0.0, NO_ANSWER)
    try:
        parsed = parse_arithmetic(expression)
    except ArithmeticParseError:
        return RewardResult(0.0, PARSE_FAILURE)
    available = Counter(numbers)
    used = Counter(parsed.literals)
    fair = all(used[x] <= available[x] for x in used)
    return RewardResult(1.0 if fair and parsed.value == target else 0.0, OK)


def countdown_reward(response: str, gold: str) -> float:
    """1.0 if the response's final expression uses the numbers fairly and equals the target."""
    return countdown_reward_result(response, gold).score


def countdown_answer_key(response: str, gold: str) -> str | None:
    """The solution a response gives, up to commutativity / associativity (the generator's
    notion of distinct solutions, :func:`reco_megatron.data.countdown.solution_key`), or None
    without a parsable answer. ``gold`` is unused: the key does not depend on the problem."""
    del gold
    if not isinstance(response, str):
        return None
    expression = extract_expression(response)
    return None if expression is None else solution_key(expression)


def steps_are_sound(response: str, target: int, numbers: tuple[int, ...]) -> bool:
    """True when the steps before the last ``Answer:`` are all true equations over numbers
    then available (given or computed earlier, each used once), there is at least one, and the
    last one's result is ``target``."""
    text = response[-MAX_RESPONSE_CHARS:]
    answers = list(_ANSWER_AT_RE.finditer(text))
    work = text[: answers[-1].start()] if answers else text
    pool = Counter(numbers)
    result = None
    for match in _STEP_RE.finditer(work):
        a, op, b, c = int(match.group(1)), match.group(2), int(match.group(3)), int(match.group(4))
        if _OPS[op](a, b) != c:
            return False
        pool[a] -= 1
        pool[b] -= 1
        if pool[a] < 0 or pool[b] < 0:
            return False
        pool[c] += 1
        result = c
    return result == target


def countdown_worked_reward_result(response: str, gold: str) -> RewardResult:
    """:func:`countdown_reward_result` that also refuses a worked solution whose steps are
    wrong (:func:`steps_are_sound`); the ``worked`` style's reward."""
    graded = countdown_reward_result(response, gold)
    if graded.score == 0.0:
        return graded
    target, numbers = parse_gold(gold)
    return graded if steps_are_sound(response, target, numbers) else RewardResult(0.0, OK)


def countdown_worked_reward(response: str, gold: str) -> float:
    """1.0 if the final expression is correct and fair and every step before it is sound."""
    return countdown_worked_reward_result(response, gold).score
