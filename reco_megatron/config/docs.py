"""Field documentation from the source: the string literal written under each field.

The project documents a config field with a bare string right below it::

    eps_high: float = 0.2
    \"\"\"PPO clip above: the ratio r may rise to ``1 + eps_high``.\"\"\"

Python drops those strings at runtime, so :func:`field_docs` reads the class source with
:mod:`inspect` and :mod:`ast`. :func:`describe_config` renders the whole tree as a reference
(dotted key, type, default, doc) for ``--help-config`` and the docs.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import itertools
import textwrap
from typing import Any

import yaml

from reco_megatron.config.dump import to_plain
from reco_megatron.config.schema import (
    default_of,
    init_fields,
    is_dataclass_instance,
    is_dataclass_type,
    preset_key,
    section_type,
    type_hints,
    type_name,
)

_WIDTH = 96


def _preset_doc(cls: type, names: tuple[str, ...]) -> str:
    doc = _own_field_docs(cls).get("PRESET_FIELD") or _first_paragraph(cls.preset.__doc__)
    return doc + (f" One of: {', '.join(names)}." if names else "")


@functools.cache
def _own_field_docs(klass: type) -> dict[str, str]:
    """Docs of the fields annotated in ``klass``'s own body ({} if its source is unavailable)."""
    try:
        source = textwrap.dedent(inspect.getsource(klass))
    except (OSError, TypeError):  # built in a REPL, by exec, or from a .pyc only
        return {}
    nodes = [n for n in ast.parse(source).body if isinstance(n, ast.ClassDef)]
    if not nodes:
        return {}
    body = nodes[0].body
    docs: dict[str, str] = {}
    for stmt, nxt in itertools.pairwise(body):
        if (
            isinstance(stmt, ast.AnnAssign)
            and isinstance(stmt.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[stmt.target.id] = inspect.cleandoc(nxt.value.value)
    return docs


def field_docs(cls: type) -> dict[str, str]:
    """``{field name: docstring}`` for the fields of dataclass ``cls`` that have one.

    Inherited fields take their doc from the class that declares them (a subclass that
    re-declares a field with a new doc wins). Fields without a string under them are absent.
    """
    if not is_dataclass_type(cls):
        raise TypeError(f"field_docs expects a dataclass, got {cls!r}")
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if klass is not object:
            docs.update(_own_field_docs(klass))
    return {f.name: docs[f.name] for f in dataclasses.fields(cls) if f.name in docs}


def format_default(value: Any) -> str:
    """A default as the user would write it in YAML: ``null``, ``true``, ``[1, 2]``, ``reco``."""
    text = yaml.safe_dump(to_plain(value), default_flow_style=True, width=10**6)
    return text.removesuffix("\n...\n").strip()


def _first_paragraph(text: str | None) -> str:
    return " ".join(inspect.cleandoc(text or "").split("\n\n")[0].split())


def _wrap(text: str, indent: str) -> list[str]:
    paragraph = " ".join(text.split())
    return textwrap.wrap(paragraph, _WIDTH, initial_indent=indent, subsequent_indent=indent)


def _describe(cls: type, prefix: str, base: Any, lines: list[str], stack: tuple[type, ...]) -> None:
    hints = type_hints(cls)
    docs = field_docs(cls)
    preset = preset_key(cls)
    if preset is not None:
        names = tuple(cls.preset_names())
        lines.append(f"{prefix}{preset}: str (optional)")
        lines.extend(_wrap(_preset_doc(cls, names), "    "))
    for field in init_fields(cls):
        key = f"{prefix}{field.name}"
        hint = hints[field.name]
        default = getattr(base, field.name) if base is not None else default_of(field)
        section = section_type(hint)
        if section is not None and section not in stack:
            note = "optional section, default null" if default is None else "section"
            lines.append(f"{key}:  ({type_name(hint)}; {note})")
            lines.extend(_wrap(docs.get(field.name) or _first_paragraph(section.__doc__), "    "))
            sub_base = default if is_dataclass_instance(default) else None
            _describe(section, f"{key}.", sub_base, lines, (*stack, section))
            continue
        shown = "(required)" if default is dataclasses.MISSING else f"= {format_default(default)}"
        lines.append(f"{key}: {type_name(hint)} {shown}")
        if field.name in docs:
            lines.extend(_wrap(docs[field.name], "    "))


def describe_config(cls: type, prefix: str = "") -> str:
    """A readable reference of every key of ``cls``: dotted key, type, default and doc.

    Sections (nested dataclasses) are expanded in place with their keys dotted below them;
    defaults inside a section are the section default's values, as the loader uses them.
    """
    if not is_dataclass_type(cls):
        raise TypeError(f"describe_config expects a dataclass, got {cls!r}")
    lines = [f"{cls.__name__}: {_first_paragraph(cls.__doc__)}".rstrip(": "), ""]
    _describe(cls, prefix, None, lines, (cls,))
    return "\n".join(lines) + "\n"
