"""A small, safe integer-arithmetic parser: ``+ - *``, parentheses, unary minus. No ``eval``.

Grammar (recursive descent)::

    expr    := term (("+" | "-") term)*
    term    := unary ("*" unary)*
    unary   := "-" unary | primary
    primary := INTEGER | "(" expr ")"

:func:`parse_arithmetic` returns the value, the literals and the syntax tree: nested tuples
``("n", 3)``, ``("+", a, b)``, ``("-", a, b)``, ``("*", a, b)``, ``("neg", a)``, so callers can
reason about the expression's form (e.g. :func:`reco_megatron.data.countdown.solution_key`).

Anything else (names, calls, attributes, ``/``, ``**``, floats, ``=``) is rejected with
:class:`ArithmeticParseError` quoting the offending character and its position. Inputs are
bounded: at most ``MAX_CHARS`` characters, ``MAX_DEPTH`` nested parentheses / unary minuses,
``MAX_DIGITS`` digits per literal, so evaluation time and integer size stay small.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_CHARS = 256
MAX_DEPTH = 32
MAX_DIGITS = 6


class ArithmeticParseError(ValueError):
    """The text is not a whitelisted arithmetic expression (the message says where and why)."""


Tree = tuple
"""A syntax-tree node: ``("n", int)``, ``(op, left, right)`` for ``op`` in ``+ - *``, or
``("neg", child)``."""


@dataclass(frozen=True)
class Parsed:
    """Result of :func:`parse_arithmetic`: the integer value, the literals in text order, and
    the syntax tree (see :data:`Tree`)."""

    value: int
    literals: tuple[int, ...]
    tree: Tree


def _value(node: Tree) -> int:
    kind = node[0]
    if kind == "n":
        return node[1]
    if kind == "neg":
        return -_value(node[1])
    left, right = _value(node[1]), _value(node[2])
    return left + right if kind == "+" else left - right if kind == "-" else left * right


class _Parser:
    def __init__(self, text: str) -> None:
        self.text = text
        self.pos = 0
        self.depth = 0
        self.literals: list[int] = []

    def fail(self, why: str) -> ArithmeticParseError:
        return ArithmeticParseError(f"{why} at position {self.pos} in {self.text[:64]!r}")

    def peek(self) -> str:
        while self.pos < len(self.text) and self.text[self.pos] in " \t":
            self.pos += 1
        return self.text[self.pos] if self.pos < len(self.text) else ""

    def expr(self) -> Tree:
        node = self.term()
        while (op := self.peek()) in ("+", "-") and op:
            self.pos += 1
            node = (op, node, self.term())
        return node

    def term(self) -> Tree:
        node = self.unary()
        while self.peek() == "*":
            self.pos += 1
            if self.peek() == "*":
                raise self.fail("exponent '**' is not allowed (only + - * and parentheses)")
            node = ("*", node, self.unary())
        return node

    def enter(self) -> None:
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise self.fail(f"nesting deeper than {MAX_DEPTH}")

    def unary(self) -> Tree:
        if self.peek() == "-":
            self.pos += 1
            self.enter()
            node = ("neg", self.unary())
            self.depth -= 1
            return node
        return self.primary()

    def primary(self) -> Tree:
        char = self.peek()
        if char == "(":
            self.pos += 1
            self.enter()
            node = self.expr()
            if self.peek() != ")":
                raise self.fail("expected ')'")
            self.pos += 1
            self.depth -= 1
            return node
        if char.isascii() and char.isdigit():
            start = self.pos
            while self.pos < len(self.text) and self.text[self.pos].isascii():
                if not self.text[self.pos].isdigit():
                    break
                self.pos += 1
            digits = self.text[start : self.pos]
            if len(digits) > MAX_DIGITS:
                raise self.fail(f"number with more than {MAX_DIGITS} digits")
            self.literals.append(int(digits))
            return ("n", int(digits))
        if not char:
            raise self.fail("unexpected end of expression")
        raise self.fail(f"unexpected character {char!r} (only digits, + - *, parentheses)")


def parse_arithmetic(text: str) -> Parsed:
    """Parse and evaluate ``text``; raise :class:`ArithmeticParseError` unless whitelisted.

    >>> parse_arithmetic("(3 + 5) * -2").value
    -16
    """
    if not isinstance(text, str):
        raise ArithmeticParseError(f"expected a string, got {type(text).__name__}")
    if len(text) > MAX_CHARS:
        raise ArithmeticParseError(
            f"expression of {len(text)} characters exceeds the limit of {MAX_CHARS}"
        )
    parser = _Parser(text)
    tree = parser.expr()
    if parser.peek():
        raise parser.fail(f"unexpected character {parser.peek()!r} after the expression")
    if not parser.literals:
        raise ArithmeticParseError(f"no number in {text[:64]!r}")
    return Parsed(value=_value(tree), literals=tuple(parser.literals), tree=tree)
