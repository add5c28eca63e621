"""Dotted overrides: ``loss.eps_high=0.28``, ``rollout.stop=['</s>']``, ``kl.ref=null``.

The key is a dotted path of section and field names (and keys of ``dict[str, X]`` fields);
the value is parsed as one YAML flow value, so ``1e-6``, ``true``, ``[1, 2]``, ``{a: 1}``,
``null`` and ``'quoted strings'`` mean what they mean in a config file. An override *sets*
the value at its path: a mapping given for a section is merged onto the section's default
like a file's, but it replaces what the file said for that section. A key inside a
``dict[str, X]`` field (``reward_weights.format=0.5``) edits one entry of the current dict
(the file's, else the default), where a file's mapping replaces the dict whole.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from reco_megatron.config.bounded_yaml import load_bounded
from reco_megatron.config.dump import config_to_dict, to_plain
from reco_megatron.config.errors import ConfigError, ConfigPath, Problems, unknown_key_message
from reco_megatron.config.schema import (
    default_of,
    dict_value_type,
    init_fields,
    is_dataclass_instance,
    preset_key,
    section_type,
    type_hints,
    type_name,
)

_KEY_PART = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_\-]*")
EXAMPLE = "loss.eps_high=0.28"
"""An override shown in error messages."""


@dataclass(frozen=True)
class Override:
    """One parsed ``key=value`` argument."""

    key: tuple[str, ...]
    """The dotted key, split: ``("loss", "eps_high")``."""

    value: Any
    """The value parsed as YAML."""

    text: str
    """The argument as given, quoted back in error messages."""


def parse_value(text: str) -> Any:
    """``text`` parsed as a YAML value (safe_load, bounded: ``bounded_yaml``); raises
    ConfigError if it is not YAML, repeats a key or expands past the node cap."""
    try:
        return load_bounded(text)
    except ConfigError as exc:
        raise ConfigError([f"override value {text[:80]!r}: {p}" for p in exc.problems]) from None
    except Exception as exc:  # yaml errors, and ValueError from e.g. the date 2024-13-01
        reason = " ".join(str(exc).split())
        raise ConfigError(
            [f"cannot parse {text!r} as a YAML value ({reason}); quote strings, e.g. 'a: b'"]
        ) from exc


def parse_override(text: str) -> Override:
    """Split and parse one ``dotted.key=value`` argument; raises ConfigError if malformed."""
    if not isinstance(text, str):
        raise ConfigError([f"override {text!r}: expected a string such as {EXAMPLE}"])
    if text.startswith("-"):
        raise ConfigError(
            [f"override {text!r}: options are not overrides; drop the dashes: {EXAMPLE}"]
        )
    key, sep, raw = text.partition("=")
    if not sep:
        raise ConfigError([f"override {text!r} has no '=': write dotted.key=value, e.g. {EXAMPLE}"])
    key = key.strip()
    parts = key.split(".")
    if not all(_KEY_PART.fullmatch(part) for part in parts):
        raise ConfigError(
            [
                f"override {text!r}: malformed key {key!r}; write field names joined by dots "
                f"(letters, digits, '_' and '-'), e.g. {EXAMPLE}"
            ]
        )
    if not raw.strip():
        raise ConfigError(
            [f"override {text!r}: empty value; write {key}=null for None or {key}='' for ''"]
        )
    try:
        value = parse_value(raw)
    except ConfigError as exc:
        raise ConfigError([f"override {text!r}: {p}" for p in exc.problems]) from exc
    return Override(tuple(parts), value, text)


def apply_override(raw: dict[str, Any], cls: type, override: Override, problems: Problems) -> None:
    """Set ``override`` in the plain tree ``raw`` of config class ``cls``, in place.

    The key is checked against the schema on the way down; an unknown name or a path through
    a leaf is added to ``problems`` (with the same "did you mean" as a file's unknown keys).
    """
    node = raw
    tp: Any = cls
    path: ConfigPath = ()
    base: Any = None  # the default instance of the current section (None: class defaults)
    for i, part in enumerate(override.key):
        section = section_type(tp)
        default: Any = None
        if section is not None:
            fields = {f.name: f for f in init_fields(section)}
            if part == preset_key(section) and i == len(override.key) - 1:
                node[part] = override.value  # applied first when the section is built
                problems.set_origin((*path, part), override.text)
                return
            if part not in fields:
                valid = [*fields, *filter(None, [preset_key(section)])]
                message = unknown_key_message(part, valid, path, section)
                problems.add((*path, part), f"{message} (in override {override.text!r})")
                return
            next_tp = type_hints(section)[part]
            default = getattr(base, part) if base is not None else default_of(fields[part])
        else:
            next_tp = dict_value_type(tp)  # the check below keeps tp a section or a dict here
        if i == len(override.key) - 1:
            node[part] = override.value
            problems.set_origin((*path, part), override.text)
            return
        if section_type(next_tp) is None and dict_value_type(next_tp) is None:
            kind = type_name(next_tp)
            whole = ".".join(map(str, (*path, part))) + ("=[...]" if "[" in kind else "=...")
            problems.add(
                (*path, part),
                f"has type {kind}, not a section, so override {override.text!r} cannot set a key "
                f"inside it; set it whole, e.g. {whole}",
            )
            return
        child = node.get(part)
        if child is None and section_type(next_tp) is None and isinstance(default, Mapping):
            child = to_plain(default)  # one key of a dict field: edit the default dict
        if is_dataclass_instance(child):
            child = config_to_dict(child)
        if not isinstance(child, dict):
            child = {}
        node[part] = child
        base = default if is_dataclass_instance(default) else None
        node, tp, path = child, next_tp, (*path, part)
