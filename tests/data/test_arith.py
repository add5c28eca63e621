"""The safe arithmetic parser: whitelisted grammar only, correct values, bounded input."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reco_megatron.data.arith import MAX_CHARS, ArithmeticParseError, parse_arithmetic


@pytest.mark.parametrize(
    ("text", "value", "literals"),
    [
        ("3", 3, (3,)),
        ("3 + 5 * 2", 13, (3, 5, 2)),
        ("(3 + 5) * 2", 16, (3, 5, 2)),
        ("2 - 3 - 4", -5, (2, 3, 4)),  # left-associative
        ("-3 * -(2 - 7)", -15, (3, 2, 7)),
        ("((((1))))", 1, (1,)),
        ("\t7*8 ", 56, (7, 8)),
    ],
)
def test_valid_expressions(text: str, value: int, literals: tuple[int, ...]) -> None:
    parsed = parse_arithmetic(text)
    assert (parsed.value, parsed.literals) == (value, literals)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("2**10", "exponent"),
        ("x + 1", "unexpected character 'x'"),
        ("__import__('os')", "unexpected character '_'"),
        ("abs(3)", "unexpected character 'a'"),
        ("(3).real", "unexpected character '.'"),
        ("8/2", "unexpected character '/'"),
        ("1.5 + 1", "unexpected character '.'"),
        ("3 = 3", "after the expression"),
        ("(1 + 2", "expected '\\)'"),
        ("1 +", "unexpected end"),
        ("", "unexpected end"),
        ("1\n+2", "after the expression"),
        ("١٢", "unexpected character"),  # non-ASCII digits
        ("1234567", "more than 6 digits"),
        ("(" * 40 + "1" + ")" * 40, "nesting deeper"),
        ("-" * 40 + "1", "nesting deeper"),
        ("1+" * 200 + "1", "exceeds the limit"),
    ],
)
def test_rejected_input(text: str, message: str) -> None:
    with pytest.raises(ArithmeticParseError, match=message):
        parse_arithmetic(text)


def test_non_string_is_rejected() -> None:
    with pytest.raises(ArithmeticParseError, match="expected a string"):
        parse_arithmetic(3)  # type: ignore[arg-type]


def _expr(depth: int) -> st.SearchStrategy[tuple[str, int]]:
    leaf = st.integers(0, 999).map(lambda n: (str(n), n))
    if depth == 0:
        return leaf

    def combine(a: tuple[str, int], op: str, b: tuple[str, int]) -> tuple[str, int]:
        value = {"+": a[1] + b[1], "-": a[1] - b[1], "*": a[1] * b[1]}[op]
        return f"({a[0]} {op} {b[0]})", value

    sub = _expr(depth - 1)
    return leaf | st.builds(combine, sub, st.sampled_from("+-*"), sub)


@settings(max_examples=100, deadline=None)
@given(_expr(3))
def test_generated_expressions_evaluate_like_integer_arithmetic(case: tuple[str, int]) -> None:
    text, value = case
    assert parse_arithmetic(text).value == value


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=MAX_CHARS + 20))
def test_any_text_parses_or_raises_the_documented_error(text: str) -> None:
    try:
        parsed = parse_arithmetic(text)
    except ArithmeticParseError:
        return
    assert isinstance(parsed.value, int)
    assert set(text) <= set("0123456789+-*() \t")


def test_the_tree_keeps_precedence_associativity_and_unary_minus() -> None:
    assert parse_arithmetic("2 - 3 - 4").tree == ("-", ("-", ("n", 2), ("n", 3)), ("n", 4))
    assert parse_arithmetic("2 + 3*4").tree == ("+", ("n", 2), ("*", ("n", 3), ("n", 4)))
    assert parse_arithmetic("-(2+3)").tree == ("neg", ("+", ("n", 2), ("n", 3)))
