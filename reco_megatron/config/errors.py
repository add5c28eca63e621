"""``ConfigError`` and the helpers that word its messages.

Every problem is one line that starts with the dotted path of the offending key
(``loss.eps_high: expected float, got 'abc' (str)``); a :class:`ConfigError` carries all the
problems found in one pass so a user fixes a config in one round trip, not one per error.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

ConfigPath = tuple[str | int, ...]
"""Location of a value: section and field names, list indices as ints (``("a", 0, "b")``)."""

_MAX_REPR = 60


class ConfigError(ValueError):
    """A configuration (file, mapping or override) is invalid; ``problems`` lists every issue.

    ``str(error)`` is the single problem when there is one, else a header and one problem per
    line; ``source`` names the file the config was read from, when there was one.
    """

    def __init__(self, problems: Iterable[str], source: str | None = None) -> None:
        self.problems: tuple[str, ...] = tuple(problems)
        self.source = source
        super().__init__(self._render())

    def _render(self) -> str:
        if len(self.problems) == 1 and self.source is None:
            return self.problems[0]
        where = f" {self.source}" if self.source else ""
        count = len(self.problems)
        header = f"invalid configuration{where} ({count} problem{'s' if count != 1 else ''}):"
        return "\n".join([header, *(f"  - {p}" for p in self.problems)])


def format_path(path: ConfigPath) -> str:
    """``("a", "b", 0, "c")`` -> ``"a.b[0].c"``."""
    text = ""
    for part in path:
        if isinstance(part, int):
            text += f"[{part}]"
        else:
            text += f".{part}" if text else part
    return text


def describe_value(value: Any) -> str:
    """``'abc' (str)``: the value's repr, shortened, and its type name."""
    text = repr(value)
    if len(text) > _MAX_REPR:
        text = text[: _MAX_REPR - 3] + "..."
    return f"{text} ({type(value).__name__})"


def did_you_mean(word: str, choices: Sequence[str]) -> str:
    """``"did you mean 'eps_high'? "`` for the closest choices (difflib), or ``""``."""
    matches = difflib.get_close_matches(word, list(choices), n=3, cutoff=0.6)
    if not matches:
        return ""
    return f"did you mean {' or '.join(repr(m) for m in matches)}? "


def unknown_key_message(
    key: object, valid: Sequence[str], section: ConfigPath, section_type: Any = None
) -> str:
    """The message for a key that names no field of ``section``, with a suggestion; for a key
    the section's class lists in ``REPLACED_KEYS`` (one that older configs had), what
    replaced it."""
    replaced = getattr(section_type, "REPLACED_KEYS", {}).get(str(key))
    if replaced is not None:
        return f"key {str(key)!r} is no longer read: {replaced}"
    where = f"'{format_path(section)}'" if section else "the top level"
    listing = ", ".join(sorted(valid)) if valid else "(none)"
    hint = did_you_mean(str(key), valid)
    return f"unknown key {str(key)!r}; {hint}valid keys of {where}: {listing}"


class Problems:
    """Collects problems while a config is checked; raises them together as a ConfigError.

    ``origins`` maps a path to the override that set it, so that a bad value coming from
    the command line says so: ``loss.eps_high: expected float, got 'x' (str)
    (set by override 'loss.eps_high=x')``.
    """

    def __init__(self, origins: Mapping[ConfigPath, str] | None = None) -> None:
        self.items: list[str] = []
        self.origins: dict[ConfigPath, str] = dict(origins or {})

    def __bool__(self) -> bool:
        return bool(self.items)

    def add(self, path: ConfigPath, message: str) -> None:
        """Record ``message`` about the value at ``path`` (empty path: the whole config)."""
        text = f"{format_path(path)}: {message}" if path else message
        origin = self._origin(path)
        if origin is not None:
            text += f" (set by override {origin!r})"
        self.items.append(text)

    def extend(self, messages: Iterable[str]) -> None:
        """Record ready-made messages (from another ConfigError)."""
        self.items.extend(messages)

    def set_origin(self, path: ConfigPath, override: str) -> None:
        """Remember that ``override`` set ``path`` (forgetting older overrides below it)."""
        for old in [p for p in self.origins if p[: len(path)] == path]:
            del self.origins[old]
        self.origins[path] = override

    def _origin(self, path: ConfigPath) -> str | None:
        best: ConfigPath | None = None
        for candidate in self.origins:
            if path[: len(candidate)] == candidate and (best is None or len(candidate) > len(best)):
                best = candidate
        return None if best is None else self.origins[best]

    def raise_if_any(self, source: str | None = None) -> None:
        """Raise a ConfigError with everything recorded so far, if anything was."""
        if self.items:
            raise ConfigError(self.items, source)
