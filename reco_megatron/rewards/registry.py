"""Reward functions by name or import path, validated at start-up.

A spec is a built-in name (``"math"``, ``"countdown"``) or ``"package.module:function"``.
:func:`resolve_reward` imports it and checks that the attribute exists, is callable, and
accepts ``(response, gold)`` positionally; every failure raises :class:`RewardSpecError`
naming the spec and saying what to fix. Calling the function (the return-type self-check)
happens inside a :class:`~reco_megatron.rewards.pool.RewardPool` worker, under its timeout.
"""

from __future__ import annotations

import importlib
import inspect
import math
import numbers
from collections.abc import Callable

from reco_megatron.rewards.types import INVALID, NAN, NONE, OK, STATUSES, RewardResult

BUILTIN_REWARDS: dict[str, str] = {
    "math": "reco_megatron.rewards.math_reward:math_reward_result",
    "countdown": "reco_megatron.rewards.countdown_reward:countdown_reward_result",
    "countdown_worked": "reco_megatron.rewards.countdown_reward:countdown_worked_reward_result",
}


BUILTIN_ANSWER_KEYS: dict[str, str] = {
    "countdown": "reco_megatron.rewards.countdown_reward:countdown_answer_key",
    "countdown_worked": "reco_megatron.rewards.countdown_reward:countdown_answer_key",
}
"""Answer keys by reward name: ``key(response, gold) -> str | None`` names the solution a
response gives, so that evaluation can count the *distinct* correct solutions per problem."""


class RewardSpecError(ValueError):
    """A reward spec cannot be imported or is not a ``(response, gold) -> float`` callable."""


def resolve_reward(
    spec: str, builtins: dict[str, str] = BUILTIN_REWARDS, what: str = "reward"
) -> Callable[[str, str], object]:
    """The callable named by ``spec`` (built-in name or ``"module:function"``), validated.

    ``builtins``/``what``: the name table and the word used in errors (answer keys reuse this
    with :data:`BUILTIN_ANSWER_KEYS` and ``"answer key"``)."""
    if not isinstance(spec, str) or not spec.strip():
        raise RewardSpecError(
            f"{what} spec must be a built-in name {sorted(builtins)} or "
            f"'module:function', got {spec!r}"
        )
    path = builtins.get(spec, spec)
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr or ":" in attr:
        raise RewardSpecError(
            f"{what} spec {spec!r} is neither a built-in ({sorted(builtins)}) nor of the "
            "form 'package.module:function' (one colon between module and function)"
        )
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # ImportError, or whatever the module raises at import
        raise RewardSpecError(
            f"{what} {spec!r}: module {module_name!r} cannot be imported "
            f"({type(exc).__name__}: {exc}); check the spelling and that it is on PYTHONPATH"
        ) from exc
    obj: object = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            names = sorted(n for n in dir(module) if callable(getattr(module, n, None)))
            names = [n for n in names if not n.startswith("_")][:20]
            raise RewardSpecError(
                f"{what} {spec!r}: module {module_name!r} has no attribute {attr!r} "
                f"(public callables there: {names})"
            )
        obj = getattr(obj, part)
    if not callable(obj):
        raise RewardSpecError(
            f"{what} {spec!r}: {attr!r} is a {type(obj).__name__}, not a callable; it must be "
            "a function (response: str, gold: str)"
        )
    try:
        inspect.signature(obj).bind("response", "gold")
    except TypeError as exc:
        raise RewardSpecError(
            f"{what} {spec!r}: {attr!r} cannot be called as fn(response, gold) ({exc}); give it "
            "two positional parameters"
        ) from exc
    except ValueError:
        pass  # builtins without a signature: the pool's self-check calls it
    return obj  # type: ignore[return-value]


def answer_key_spec(reward: str, spec: str = "") -> str:
    """The answer key a run uses: ``spec`` when given (``"none"`` switches it off, giving
    ``""``), else the built-in key of ``reward`` if it has one, else ``""``."""
    if spec == "none":
        return ""
    return spec or BUILTIN_ANSWER_KEYS.get(reward, "")


def resolve_answer_key(spec: str) -> Callable[[str, str], object] | None:
    """The answer-key callable named by ``spec`` (as from :func:`answer_key_spec`; ``""``:
    None), validated like a reward spec."""
    return resolve_reward(spec, BUILTIN_ANSWER_KEYS, "answer key") if spec else None


def coerce_result(value: object) -> RewardResult:
    """Turn a reward function's return value into a :class:`RewardResult`.

    Accepted: a finite real number (int, float, a numpy scalar or 0-d array, numpy's bool
    included; a bool counts as 0/1), or a ``RewardResult`` with a finite score and a known
    status. Anything else scores 0.0
    with status ``"none"`` (None), ``"nan"`` (NaN or an infinity) or ``"invalid"`` (a string,
    another object, an unknown status, an int too large for a float).
    """
    if isinstance(value, RewardResult):
        score, status = value
        if status not in STATUSES:
            return RewardResult(0.0, INVALID)
    else:
        score, status = value, OK
    if score is None:
        return RewardResult(0.0, NONE)
    if type(score).__module__ == "numpy" and getattr(score, "shape", None) == ():
        score = score.item()  # np.bool_, np.float32, a 0-d array: their Python value
    if isinstance(score, bool):
        score = float(score)
    if not isinstance(score, numbers.Real):
        return RewardResult(0.0, INVALID)
    try:
        score = float(score)
    except OverflowError:
        return RewardResult(0.0, INVALID)
    if not math.isfinite(score):
        return RewardResult(0.0, NAN)
    return RewardResult(score, status)
