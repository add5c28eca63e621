"""Turn a plain YAML tree into a config dataclass, checking each value against its annotation.

Coercions are the safe ones only: an int where a float is expected, an integral float or an
exponent string where an int is expected, a list where a tuple is expected, a string where a
path is expected, and an exponent string such as ``1e-6`` where a float is expected (PyYAML
follows YAML 1.1 and reads ``1e-6`` as a string). Booleans must be real booleans: ``true``
and ``false`` in YAML, never the string ``"yes"``. A section (nested dataclass) given as a
mapping is built on top of the section's default, so a file only lists what it changes.
"""

from __future__ import annotations

import dataclasses
import re
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from reco_megatron.config.errors import (
    ConfigPath,
    Problems,
    describe_value,
    did_you_mean,
    unknown_key_message,
)
from reco_megatron.config.schema import (
    default_of,
    has_default,
    init_fields,
    is_dataclass_instance,
    is_dataclass_type,
    is_union,
    preset_key,
    section_type,
    type_hints,
    type_name,
)

FAIL: Any = object()
"""Returned by :func:`coerce` when the value was rejected (the reason is in ``problems``)."""

_EXPONENT_NUMBER = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")
_SEQUENCE = (list, tuple)


def _expected(problems: Problems, path: ConfigPath, what: str, value: Any, hint: str = "") -> Any:
    problems.add(path, f"expected {what}, got {describe_value(value)}{hint}")
    return FAIL


def _to_float(value: Any, path: ConfigPath, problems: Problems) -> Any:
    if isinstance(value, bool):
        return _expected(problems, path, "float", value, "; write a number such as 0.2")
    if isinstance(value, float):
        return value
    if isinstance(value, int):
        try:
            return float(value)
        except OverflowError:
            return _expected(problems, path, "float", value, "; the number is too large")
    if isinstance(value, str) and _EXPONENT_NUMBER.fullmatch(value.strip()):
        return float(value)
    return _expected(problems, path, "float", value)


def _to_int(value: Any, path: ConfigPath, problems: Problems) -> Any:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    number = value
    if isinstance(value, str) and _EXPONENT_NUMBER.fullmatch(value.strip()):
        number = float(value)
    if isinstance(number, float) and number.is_integer():
        return int(number)
    return _expected(problems, path, "int", value)


def _to_str(value: Any, path: ConfigPath, problems: Problems) -> Any:
    if isinstance(value, str):
        return value
    hint = ""
    if value is not None and not isinstance(value, (Mapping, *_SEQUENCE)):
        hint = f"; quote it to pass a string, e.g. '{value}'"
    return _expected(problems, path, "str", value, hint)


def _to_literal(value: Any, tp: Any, path: ConfigPath, problems: Problems) -> Any:
    choices = typing.get_args(tp)
    for choice in choices:
        if type(value) is type(choice) and value == choice:
            return choice
    names = [c for c in choices if isinstance(c, str)]
    hint = did_you_mean(value, names).rstrip() if isinstance(value, str) else ""
    listing = ", ".join(repr(c) for c in choices)
    return _expected(problems, path, f"one of {listing}", value, f"; {hint}" if hint else "")


def _to_union(value: Any, tp: Any, path: ConfigPath, problems: Problems, base: Any) -> Any:
    args = typing.get_args(tp)
    if value is None:
        if type(None) in args:
            return None
        return _expected(problems, path, type_name(tp), value)
    options = [a for a in args if a is not type(None)]
    if len(options) == 1:
        return coerce(value, options[0], path, problems, base)
    # A member matching the value's own type wins over a conversion: in ``int | str`` the
    # string "0E0" stays a string rather than being read as the number 0.
    exact = [o for o in options if isinstance(o, type) and type(value) is o]
    for option in exact + [o for o in options if o not in exact]:
        scratch = Problems()
        result = coerce(value, option, path, scratch, base)
        if result is not FAIL:
            return result
    return _expected(problems, path, type_name(tp), value)


def _to_sequence(value: Any, tp: Any, path: ConfigPath, problems: Problems) -> Any:
    origin = typing.get_origin(tp) or tp
    args = typing.get_args(tp)
    if not isinstance(value, _SEQUENCE):
        return _expected(problems, path, f"a list ({type_name(tp)})", value)
    if origin is tuple and args and not (len(args) == 2 and args[1] is Ellipsis):
        if len(value) != len(args):
            return _expected(problems, path, f"{len(args)} items ({type_name(tp)})", value)
        item_types = list(args)
    else:
        item_types = [args[0] if args else Any] * len(value)
    items = [
        coerce(item, item_tp, (*path, i), problems, None)
        for i, (item, item_tp) in enumerate(zip(value, item_types, strict=True))
    ]
    if any(item is FAIL for item in items):
        return FAIL
    return tuple(items) if origin is tuple else items


def _to_dict(value: Any, tp: Any, path: ConfigPath, problems: Problems) -> Any:
    if not isinstance(value, Mapping) or is_dataclass_instance(value):
        return _expected(problems, path, f"a mapping ({type_name(tp)})", value)
    args = typing.get_args(tp)
    value_tp = args[1] if args else Any
    result: dict[str, Any] = {}
    ok = True
    for key, item in value.items():
        if not isinstance(key, str):
            problems.add(path, f"key {describe_value(key)} is not a string; quote it: '{key}'")
            ok = False
            continue
        result[key] = coerce(item, value_tp, (*path, key), problems, None)
        ok = ok and result[key] is not FAIL
    return result if ok else FAIL


def coerce(value: Any, tp: Any, path: ConfigPath, problems: Problems, base: Any = None) -> Any:
    """``value`` checked against (and safely converted to) annotation ``tp``, or FAIL.

    ``base`` is the default instance of a section annotation: keys the mapping leaves out
    keep the base's values.
    """
    if tp is Any or tp is object:
        return value
    if tp is type(None):
        return None if value is None else _expected(problems, path, "null", value)
    if is_union(tp):
        return _to_union(value, tp, path, problems, base)
    if typing.get_origin(tp) is Literal:
        return _to_literal(value, tp, path, problems)
    if is_dataclass_type(tp):
        return build_dataclass(tp, value, path, problems, base)
    if tp is bool:
        if isinstance(value, bool):
            return value
        return _expected(problems, path, "bool", value, "; write true or false")
    if tp is int:
        return _to_int(value, path, problems)
    if tp is float:
        return _to_float(value, path, problems)
    if tp is str:
        return _to_str(value, path, problems)
    if tp is Path:
        if isinstance(value, (str, Path)):
            return Path(value)
        return _expected(problems, path, "a path (str)", value)
    origin = typing.get_origin(tp) or tp
    if origin in (list, tuple):
        return _to_sequence(value, tp, path, problems)
    if origin is dict:
        return _to_dict(value, tp, path, problems)
    raise TypeError(f"unsupported annotation {tp!r} at {path}")  # validate_schema rejects it


def _section_base(field: dataclasses.Field[Any], hint: Any, base: Any) -> Any:
    """The default instance a section field's mapping is merged onto (None: class defaults)."""
    if section_type(hint) is None:
        return None
    default = getattr(base, field.name) if base is not None else default_of(field)
    return default if is_dataclass_instance(default) else None


def _preset_name(cls: type, name: Any, path: ConfigPath, problems: Problems) -> Any:
    """``name`` when it is one of ``cls.preset_names()``, else FAIL with the reason."""
    names = list(cls.preset_names())
    if isinstance(name, str) and name in names:
        return name
    hint = did_you_mean(name, names).rstrip() if isinstance(name, str) else ""
    return _expected(
        problems, path, f"a preset, one of {', '.join(names)}", name, f"; {hint}" if hint else ""
    )


def build_dataclass(
    cls: type, value: Any, path: ConfigPath, problems: Problems, base: Any = None
) -> Any:
    """Instance of ``cls`` from mapping ``value`` (unset fields from ``base`` or defaults).

    A class with a preset key (:func:`~reco_megatron.config.schema.preset_key`) given one in
    ``value`` is built by ``cls.preset(name, **the other keys)`` instead of on ``base``.
    Unknown keys, missing required fields and wrong types are added to ``problems``; a
    ``ValueError`` (or ``TypeError``) from ``__post_init__`` is added with the section path in
    front. Returns FAIL if anything in this section or below it was wrong.
    """
    if isinstance(value, cls):
        return value
    if not isinstance(value, Mapping) or is_dataclass_instance(value):
        return _expected(problems, path, f"a mapping (section {cls.__name__})", value)
    fields = init_fields(cls)
    hints = type_hints(cls)
    names = [f.name for f in fields]
    known = set(names)
    ok = True
    preset = preset_key(cls)
    chosen = None  # the preset's name: it gives every field the mapping leaves out
    if preset is not None and preset in value:
        chosen = _preset_name(cls, value[preset], (*path, preset), problems)
        ok = chosen is not FAIL
        value = {k: v for k, v in value.items() if k != preset}
    for key in value:
        if key not in known:
            valid = [*names, preset] if preset is not None else names
            problems.add((*path, str(key)), unknown_key_message(key, valid, path, cls))
            ok = False
    kwargs: dict[str, Any] = {}
    for field in fields:
        hint = hints[field.name]
        if field.name in value:
            sub_base = _section_base(field, hint, base)
            item = coerce(value[field.name], hint, (*path, field.name), problems, sub_base)
            ok = ok and item is not FAIL
            kwargs[field.name] = item
        elif chosen is not None:
            continue
        elif base is not None:
            kwargs[field.name] = getattr(base, field.name)
        elif not has_default(field):
            problems.add((*path, field.name), f"missing required field ({type_name(hint)})")
            ok = False
    if not ok:
        return FAIL
    try:
        return cls.preset(chosen, **kwargs) if chosen is not None else cls(**kwargs)
    except (ValueError, TypeError) as exc:
        kind = "" if isinstance(exc, ValueError) else f"{type(exc).__name__} in validation: "
        problems.add(path, f"{kind}{exc}" if path else f"{cls.__name__}: {kind}{exc}")
        return FAIL
