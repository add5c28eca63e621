"""Find the final answer in a model response (pure string work, no parsing of maths).

Order of precedence, each taking the *last* occurrence in the text:

1. ``\\boxed{...}`` / ``\\fbox{...}`` with nested braces (``\\boxed{\\frac{1}{2}}``);
2. the last line containing "answer is ..." or "answer: ..." (case-insensitive);
3. the last plain number (``-3``, ``1,234``, ``0.5``, ``3/4``).

Every scan is linear in the text length; callers bound that length first.
"""

from __future__ import annotations

import re

_BOX_RE = re.compile(r"\\(?:boxed|fbox)\b")
_ANSWER_RE = re.compile(r"answer\s*(?:is|:)\s*:?\s*(.+)", re.IGNORECASE)
_NUMBER_RE = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?|-?\d+(?:\.\d+)?(?:\s*/\s*\d+)?")
_TRAILING = " \t.;,!$*`"


def last_boxed(text: str) -> str | None:
    """Content of the last balanced ``\\boxed{...}`` (or ``\\boxed 5``) in ``text``, else None."""
    for match in reversed(list(_BOX_RE.finditer(text))):
        i = match.end()
        while i < len(text) and text[i] == " ":
            i += 1
        if i < len(text) and text[i] == "{":
            depth = 0
            for j in range(i, len(text)):
                if text[j] == "{":
                    depth += 1
                elif text[j] == "}":
                    depth -= 1
                    if depth == 0:
                        content = text[i + 1 : j].strip()
                        if content:
                            return content
                        break
            continue  # unbalanced or empty: try an earlier box
        bare = re.match(r"[^\s$]+", text[i:])
        if bare and match.end() < i:
            return bare.group(0)
    return None


def answer_phrase(text: str) -> str | None:
    """What follows "answer is"/"answer:" on the last line that has it, trimmed, else None."""
    for line in reversed(text.splitlines()):
        matches = list(_ANSWER_RE.finditer(line))
        if matches:
            content = matches[-1].group(1).strip().strip(_TRAILING).strip()
            if content:
                return content
    return None


def last_number(text: str) -> str | None:
    """The last plain number in ``text`` (thousands commas and spaces removed), else None."""
    matches = _NUMBER_RE.findall(text)
    if not matches:
        return None
    return matches[-1].replace(",", "").replace(" ", "")


def extract_final_answer(text: str) -> str | None:
    """The response's final answer as a string, by the precedence in the module docstring."""
    for finder in (last_boxed, answer_phrase, last_number):
        found = finder(text)
        if found is not None:
            return found
    return None
