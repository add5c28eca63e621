"""What a config class accepts: its init fields, their resolved annotations, their names.

Annotations are resolved with :func:`typing.get_type_hints`, so classes written with
``from __future__ import annotations`` work. The supported annotations are listed in
:data:`SUPPORTED`; :func:`validate_schema` rejects anything else up front, with a TypeError
(a bug in the config class, not in the user's file).
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union

SUPPORTED = (
    "int, float, bool, str, pathlib.Path, Any, Literal[...], X | None, X | Y, list[X], "
    "tuple[X, ...], tuple[X, Y], dict[str, X], nested dataclasses"
)
"""Human-readable list of the annotations the loader understands."""

_SCALARS: tuple[type, ...] = (int, float, bool, str, Path)


def is_dataclass_type(tp: object) -> bool:
    """True for a dataclass *class* (not an instance)."""
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def is_dataclass_instance(value: object) -> bool:
    """True for an instance of a dataclass."""
    return dataclasses.is_dataclass(value) and not isinstance(value, type)


def is_union(tp: object) -> bool:
    """True for ``X | Y`` and ``typing.Union[X, Y]`` / ``Optional[X]``."""
    return typing.get_origin(tp) in (Union, types.UnionType)


def init_fields(cls: type) -> tuple[dataclasses.Field[Any], ...]:
    """The fields a config file may set: dataclass fields with ``init=True``."""
    return tuple(f for f in dataclasses.fields(cls) if f.init)


@functools.cache
def type_hints(cls: type) -> dict[str, Any]:
    """Resolved annotations of ``cls`` (string annotations evaluated in its module)."""
    try:
        return typing.get_type_hints(cls)
    except (NameError, TypeError) as exc:
        raise TypeError(
            f"cannot resolve the annotations of {cls.__qualname__}: {exc}; config classes "
            "must be defined at module level with importable annotation names"
        ) from exc


def preset_key(cls: type) -> str | None:
    """The key that names a preset in a section of class ``cls``, or None.

    A config class opts in with ``PRESET_FIELD: ClassVar[str] = "preset"`` and two
    classmethods: ``preset_names()`` and ``preset(name, **fields) -> instance`` (the preset's
    field values with ``fields`` on top). In a file or an override, ``section.preset: NAME``
    then builds the section as ``cls.preset(NAME, **its other keys)`` instead of on the
    default, wherever those keys are written (``loss: {preset: grpo, eps_high: 0.28}``).
    """
    key = getattr(cls, "PRESET_FIELD", None)
    methods = all(callable(getattr(cls, m, None)) for m in ("preset", "preset_names"))
    return key if isinstance(key, str) and methods else None


def has_default(field: dataclasses.Field[Any]) -> bool:
    """Whether the field may be left out of a config."""
    return field.default is not dataclasses.MISSING or field.default_factory is not (
        dataclasses.MISSING
    )


def default_of(field: dataclasses.Field[Any]) -> Any:
    """The field's default value (calling its factory), or ``dataclasses.MISSING``."""
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return dataclasses.MISSING


def strip_optional(tp: Any) -> Any:
    """``X | None`` -> ``X``; anything else unchanged (including ``X | Y | None``)."""
    if is_union(tp):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


def section_type(tp: Any) -> type | None:
    """The dataclass behind ``tp`` (``Sub`` or ``Sub | None``), or None for a leaf."""
    inner = strip_optional(tp)
    return inner if is_dataclass_type(inner) else None


def dict_value_type(tp: Any) -> Any | None:
    """``X`` for ``dict[str, X]`` (or its Optional), ``Any`` for ``dict`` / ``Any``, else None."""
    inner = strip_optional(tp)
    if inner is dict or inner is Any:
        return Any
    if typing.get_origin(inner) is dict:
        return typing.get_args(inner)[1]
    return None


def type_name(tp: Any) -> str:
    """A short, readable spelling of an annotation: ``float | None``, ``list[int]``."""
    if tp is type(None):
        return "None"
    if tp is Any:
        return "any"
    if tp is Path:
        return "path"
    if is_dataclass_type(tp) or tp in _SCALARS:
        return tp.__name__
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if is_union(tp):
        return " | ".join(type_name(a) for a in args)
    if origin is Literal:
        return " | ".join(repr(a) for a in args)
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        return f"tuple[{type_name(args[0])}, ...]"
    if origin in (list, tuple, dict):
        return f"{origin.__name__}[{', '.join(type_name(a) for a in args)}]"
    return getattr(tp, "__name__", repr(tp))


def _check(tp: Any, where: str, seen: set[type]) -> None:
    if tp is Any or tp is type(None) or tp in _SCALARS or tp in (list, tuple, dict):
        return
    if is_dataclass_type(tp):
        validate_schema(tp, _seen=seen)
        return
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        bad = [a for a in args if not isinstance(a, (str, int, float, bool, type(None)))]
        if bad:
            raise TypeError(f"{where}: Literal values must be scalars, got {bad!r}")
        return
    if is_union(tp) or origin is list or origin is tuple:
        for arg in args:
            if arg is not Ellipsis:
                _check(arg, where, seen)
        return
    if origin is dict:
        if args[0] is not str:
            raise TypeError(f"{where}: dict keys must be str (YAML keys), got {args[0]!r}")
        _check(args[1], where, seen)
        return
    raise TypeError(f"{where}: unsupported annotation {tp!r}; supported: {SUPPORTED}")


def validate_schema(cls: type, *, _seen: set[type] | None = None) -> None:
    """Raise TypeError if ``cls`` is not a dataclass or has an unsupported annotation."""
    if not is_dataclass_type(cls):
        raise TypeError(f"config classes must be dataclasses, got {cls!r}")
    seen = set() if _seen is None else _seen
    if cls in seen:
        return
    seen.add(cls)
    hints = type_hints(cls)
    for field in init_fields(cls):
        _check(hints[field.name], f"{cls.__qualname__}.{field.name}", seen)
