"""Math answer reward on top of ``math_verify`` (``parse`` / ``verify``), never ``eval``.

``math_reward(response, gold)`` is 1.0 when the response's final answer (see
:mod:`reco_megatron.rewards.extract`) is mathematically equivalent to ``gold`` (``1/2`` ==
``0.5`` == ``\\frac{1}{2}``), else 0.0. Garbage, empty or unparseable input gives 0.0.

``math_verify`` parses LaTeX with sympy, which can be slow or hang on adversarial input. Its
own ``signal.alarm`` timeouts (``reward.grader_timeout_s``, whole seconds, default 3; the
pool passes it in :data:`~reco_megatron.rewards.types.GRADER_TIMEOUT_ENV`) are used when
called from a main thread. math_verify turns a timeout into "no match"; here it is status
``grader_timeout`` instead (score 0.0, counted as a failure, ``reward_fail_grader_timeout``),
unless another comparison of the same item matched. The hard guarantee (kill and replace a
hung process) is :class:`~reco_megatron.rewards.pool.RewardPool`'s.
"""

from __future__ import annotations

import os
import threading
import time
from itertools import product

from reco_megatron.rewards.extract import extract_final_answer, last_number
from reco_megatron.rewards.types import (
    GRADER_TIMEOUT,
    GRADER_TIMEOUT_ENV,
    NO_ANSWER,
    OK,
    PARSE_FAILURE,
    RewardResult,
)

MAX_RESPONSE_CHARS = 8192
"""Only the last this-many characters of a response are searched (the answer is at the end)."""
MAX_ANSWER_CHARS = 512
"""A longer extracted answer is treated as a parse failure rather than handed to sympy."""
PARSE_TIMEOUT_S = 3
"""math_verify's own (signal-based, whole seconds) timeout for parse and verify, unless
:data:`~reco_megatron.rewards.types.GRADER_TIMEOUT_ENV` says otherwise."""


class GraderTimeout(Exception):
    """math_verify gave up on an expression (its own timeout): no verdict."""


def _alarm_timeout() -> int | None:
    """math_verify's signal timeout only works in the main thread; None elsewhere."""
    if threading.current_thread() is not threading.main_thread():
        return None
    return int(os.environ.get(GRADER_TIMEOUT_ENV, PARSE_TIMEOUT_S))


def _parse_one(text: str, timeout: int | None) -> list:
    from math_verify import parse
    from math_verify.errors import TimeoutException

    start = time.monotonic()
    try:
        return parse(text, parsing_timeout=timeout, raise_on_error=True)
    except TimeoutException as exc:
        raise GraderTimeout(f"parsing {text[:60]!r} took over {timeout} s") from exc
    except Exception:  # sympy/antlr raise anything: unparseable, as math_verify would say
        if _ran_out(start, timeout):  # the alarm's exception, re-raised as another one
            raise GraderTimeout(f"parsing {text[:60]!r} took over {timeout} s") from None
        return []


def _ran_out(start: float, timeout: int | None) -> bool:
    """Whether a call that began at ``start`` lasted its whole alarm: sympy code that catches
    every exception can swallow the alarm's, turning a timeout into "no match"; the clock
    still tells."""
    return timeout is not None and time.monotonic() - start >= timeout


def _parse(text: str) -> list:
    """math_verify parse of a bare LaTeX/plain expression, wrapped in ``$..$`` first."""
    timeout = _alarm_timeout()
    if "$" not in text and "\\boxed" not in text:
        parsed = _parse_one(f"${text}$", timeout)
        if parsed:
            return parsed
    return _parse_one(text, timeout)


def _verify(gold: list, pred: list) -> bool:
    """math_verify's ``verify`` (any pair of the parses matches), except that a pair that
    timed out is not a mismatch: with no match, a timeout raises :class:`GraderTimeout`."""
    from math_verify import verify
    from math_verify.errors import TimeoutException

    timeout = _alarm_timeout()
    timed_out = False
    for g, p in product(gold, pred):
        start = time.monotonic()
        try:
            if verify([g], [p], timeout_seconds=timeout, raise_on_error=True):
                return True
        except TimeoutException:
            timed_out = True
            continue
        except Exception:  # a comparison sympy cannot make: not equal, as math_verify says
            pass
        timed_out = timed_out or _ran_out(start, timeout)  # an alarm sympy swallowed
    if timed_out:
        raise GraderTimeout(f"a comparison took over {timeout} s")
    return False


def _compact(text: str) -> str:
    return "".join(text.split()).strip("$")


def math_reward_result(response: str, gold: str) -> RewardResult:
    """:func:`math_reward` with the reason for the score (``ok`` / ``no_answer`` / ...).

    Args:
        response: model output, any string (only the last ``MAX_RESPONSE_CHARS`` are read).
        gold: reference answer, LaTeX or plain (``"\\frac{1}{2}"``, ``"0.5"``, ``"x+1"``).
    """
    if not isinstance(response, str) or not isinstance(gold, str):
        return RewardResult(0.0, PARSE_FAILURE)
    answer = extract_final_answer(response[-MAX_RESPONSE_CHARS:])
    if answer is None:
        return RewardResult(0.0, NO_ANSWER)
    if len(answer) > MAX_ANSWER_CHARS or len(gold) > MAX_ANSWER_CHARS:
        return RewardResult(0.0, PARSE_FAILURE)
    try:
        gold_parsed = _parse(gold)
        pred_parsed = _parse(answer)
        if not pred_parsed:
            # "the answer is 42 apples": fall back to the number inside the phrase.
            number = last_number(answer)
            pred_parsed = _parse(number) if number is not None else []
        if not gold_parsed or not pred_parsed:
            # Unparseable gold: only a literal match counts.
            equal = _compact(answer) == _compact(gold) != ""
            return RewardResult(1.0 if equal else 0.0, OK if equal else PARSE_FAILURE)
        matched = _verify(gold_parsed, pred_parsed)
    except GraderTimeout:
        return RewardResult(0.0, GRADER_TIMEOUT)
    except MemoryError:
        raise  # the pool counts it and replaces the worker
    except Exception:  # sympy/antlr raise anything; the contract is "0.0, never crash"
        return RewardResult(0.0, PARSE_FAILURE)
    return RewardResult(1.0 if matched else 0.0, OK)


def math_reward(response: str, gold: str) -> float:
    """1.0 if the final answer of ``response`` equals ``gold`` mathematically, else 0.0."""
    return math_reward_result(response, gold).score
