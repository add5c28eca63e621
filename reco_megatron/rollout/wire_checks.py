"""The field checks of the control channel's frames (:mod:`.wire`): each takes a decoded value
and the field's name, returns the value (rebuilt where a type needs it) or raises
:class:`WireError` naming the field. The bounded ones (:func:`text`, :func:`bounded`,
:func:`whole`, :func:`real`, :func:`token_ids`) also refuse a value over its size or range.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

MAX_DEPTH = 16
"""The deepest nesting :func:`plain` accepts."""


class WireError(ValueError):
    """A frame that is not one of :data:`.wire.SCHEMA`'s; says which field and why."""


Check = Callable[[Any, str], Any]


def integer(v: Any, f: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise WireError(f"{f} must be an integer, got {type(v).__name__}")
    return v


def number(v: Any, f: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise WireError(f"{f} must be a number, got {type(v).__name__}")
    return float(v)


def string(v: Any, f: str) -> str:
    if not isinstance(v, str):
        raise WireError(f"{f} must be a string, got {type(v).__name__}")
    return v


def boolean(v: Any, f: str) -> bool:
    if not isinstance(v, bool):
        raise WireError(f"{f} must be a boolean, got {type(v).__name__}")
    return v


def raw_bytes(v: Any, f: str) -> bytes:
    if not isinstance(v, bytes):
        raise WireError(f"{f} must be bytes, got {type(v).__name__}")
    return v


def optional(check: Check) -> Check:
    return lambda v, f: None if v is None else check(v, f)


def list_of(check: Check) -> Check:
    def run(v: Any, f: str) -> list[Any]:
        if not isinstance(v, list):
            raise WireError(f"{f} must be a list, got {type(v).__name__}")
        return [check(x, f"{f}[{i}]") for i, x in enumerate(v)]

    return run


def ints(v: Any, f: str) -> list[int]:
    if not isinstance(v, list) or not all(type(x) is int for x in v):
        raise WireError(f"{f} must be a list of integers")
    return v


def floats(v: Any, f: str) -> list[float]:
    if not isinstance(v, list) or not all(type(x) is float for x in v):
        raise WireError(f"{f} must be a list of floats")
    return v


def plain(v: Any, f: str, depth: int = 0) -> Any:
    """Plain data (None, bool, int, float, str, lists, maps with string keys)."""
    if depth > MAX_DEPTH:
        raise WireError(f"{f} is nested deeper than {MAX_DEPTH}")
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, list):
        return [plain(x, f, depth + 1) for x in v]
    if isinstance(v, dict):
        for k in v:
            string(k, f"{f} key")
        return {k: plain(x, f"{f}.{k}", depth + 1) for k, x in v.items()}
    raise WireError(f"{f} holds a {type(v).__name__}, not plain data")


def text(limit: int) -> Check:
    def run(v: Any, f: str) -> str:
        if len(string(v, f)) > limit:
            raise WireError(f"{f} holds {len(v)} characters, over the bound of {limit}")
        return v

    return run


def bounded(check: Check, limit: int) -> Check:
    def run(v: Any, f: str) -> list[Any]:
        if isinstance(v, list) and len(v) > limit:
            raise WireError(f"{f} holds {len(v)} items, over the bound of {limit}")
        return check(v, f)

    return run


def whole(low: int, high: int) -> Check:
    def run(v: Any, f: str) -> int:
        if not low <= integer(v, f) <= high:
            raise WireError(f"{f} must be in [{low}, {high}], got {v}")
        return v

    return run


def real(low: float, high: float) -> Check:
    """A finite number in ``(low, high]``."""

    def run(v: Any, f: str) -> float:
        x = number(v, f)
        if not low < x <= high:
            raise WireError(f"{f} must be in ({low:g}, {high:g}], got {v!r}")
        return x

    return run


def token_ids(limit: int) -> Check:
    def run(v: Any, f: str) -> list[int]:
        ids = bounded(ints, limit)(v, f)
        if any(not 0 <= x < 2**31 for x in ids):
            raise WireError(f"{f} holds a token id outside [0, 2**31)")
        return ids

    return run


def finite(v: Any, f: str) -> float:
    x = number(v, f)
    if not math.isfinite(x):
        raise WireError(f"{f} must be finite, got {x!r}")
    return x


def plain_map(v: Any, f: str) -> dict[str, Any]:
    if not isinstance(v, dict):
        raise WireError(f"{f} must be a map, got {type(v).__name__}")
    return plain(v, f)


def fields(v: Any, f: str, spec: dict[str, Check]) -> dict[str, Any]:
    if not isinstance(v, dict):
        raise WireError(f"{f} must be a map, got {type(v).__name__}")
    if set(v) != set(spec):
        missing, extra = sorted(set(spec) - set(v)), sorted(set(v) - set(spec), key=str)
        parts = [f"missing fields {missing}"] * bool(missing)
        parts += [f"unexpected fields {extra}"] * bool(extra)
        raise WireError(f"{f}: {', '.join(parts)}")
    return {name: check(v[name], f"{f}.{name}") for name, check in spec.items()}


def record(spec: dict[str, Check]) -> Check:
    return lambda v, f: fields(v, f, spec)
