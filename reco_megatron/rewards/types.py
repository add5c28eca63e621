"""Reward result type and the status vocabulary shared by reward functions and the pool.

A reward function is any callable ``fn(response: str, gold: str) -> float``. It may instead
return a :class:`RewardResult` to say *why* it gave its score (e.g. no answer found); the
:class:`~reco_megatron.rewards.pool.RewardPool` counts those statuses as metrics.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

# Statuses a reward function may report.
OK = "ok"  # the answer was parsed and compared (the score says whether it matched)
NO_ANSWER = "no_answer"  # no final answer found in the response
PARSE_FAILURE = "parse_failure"  # an answer was found but could not be parsed / checked
GRADER_TIMEOUT = "grader_timeout"  # the grader (e.g. math_verify) gave up within its own limit
# Statuses only the pool assigns.
TIMEOUT = "timeout"  # the worker exceeded the per-item timeout and was killed
CRASH = "crash"  # the worker process died (segfault, os._exit, killed by the OS)
MEMORY = "memory"  # MemoryError under the worker's address-space limit
ERROR = "error"  # the reward function raised an exception
INVALID = "invalid"  # the reward function returned a non-number (a str, an object, ...)
NAN = "nan"  # the reward function returned NaN or an infinity
NONE = "none"  # the reward function returned None (a missing ``return``)
OUT_OF_RANGE = "out_of_range"  # a finite score beyond ``reward.max_abs_score``

FUNCTION_STATUSES: tuple[str, ...] = (OK, NO_ANSWER, PARSE_FAILURE, GRADER_TIMEOUT)
POOL_STATUSES: tuple[str, ...] = (TIMEOUT, CRASH, MEMORY, ERROR, INVALID, NAN, NONE, OUT_OF_RANGE)
STATUSES: tuple[str, ...] = FUNCTION_STATUSES + POOL_STATUSES

FAILURE_KINDS: dict[str, str] = {
    ERROR: "raised",
    NAN: "nan",
    NONE: "none",
    INVALID: "not_a_number",
    MEMORY: "memory",
    TIMEOUT: "timeout",
    CRASH: "crash",
    GRADER_TIMEOUT: "grader_timeout",
    OUT_OF_RANGE: "out_of_range",
}
"""Statuses where the reward *function* failed (the item scores 0.0 without a verdict), and
the name each is counted under (``reward_fail_<name>`` in ``metrics.jsonl``). ``no_answer`` and
``parse_failure`` are verdicts on the response, not failures."""


GRADER_TIMEOUT_ENV = "RECO_REWARD_GRADER_TIMEOUT_S"
"""Environment variable the pool sets in its workers to ``reward.grader_timeout_s``: the
limit a grader's own timeouts should use (the built-in math reward passes it to
math_verify); a reward function that times out inside returns status ``grader_timeout``."""


class RewardResult(NamedTuple):
    """A score in ``[0, 1]`` (by convention; the pool only requires a finite float) + status."""

    score: float
    status: str = OK


RewardFn = Callable[[str, str], "float | RewardResult"]
