"""Synthetic "countdown" task with many correct answers, for CPU runs and coverage studies.

A problem gives ``n_numbers`` integers in ``[2, max_number]`` and a target T; a correct answer is an
expression with ``+ - *`` and parentheses that uses **each given number at most once**
(classic Countdown rules; not all numbers need be used) and equals T. Problems are generated
deterministically from a seed by enumerating every expression over the numbers and keeping
targets reached by at least ``min_solutions`` *distinct* expressions, where two expressions
are the same if they differ only by commutativity / associativity of ``+`` and ``*`` (and
``a-(b-c)`` == ``a-b+c``); ``3*(4+5)`` and ``3*4+3*5`` count as distinct. Several distinct
answers per prompt is the point: pass@k and diversity metrics need room to spread.

Two styles (``style``): ``answer`` (the default) teaches and asks for ``Answer: <expression>``
only; ``worked`` writes the solution's steps first, one ``a op b = c`` per combination in the
order the numbers are combined, each followed by the numbers still available, then the answer
(:func:`worked_response`): responses of 50-100 tokens instead of 10-25, graded by
``countdown_worked`` (the steps must be true and reach the target, the answer as before).

Answers are checked by :func:`reco_megatron.rewards.countdown_reward` with the safe parser of
:mod:`reco_megatron.data.arith` (never ``eval``). Write splits with::

    python -m reco_megatron.data.countdown --out DIR --n-train 1000 --n-eval 100 --seed 0
"""

from __future__ import annotations

import argparse
import json
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, get_args

from reco_megatron.utils.logging import get_logger

log = get_logger(__name__)

PROMPT_TEMPLATE = (
    "Using the numbers {numbers}, each at most once, and the operations + - * with "
    "parentheses, write an expression that equals {target}. "
    "End your response with 'Answer: <expression>'."
)
WORKED_TEMPLATE = (
    "Using the numbers {numbers}, each at most once, and the operations + - * with "
    "parentheses, reach {target}, showing each step as 'a + b = c' with the numbers that "
    "remain, then end your response with 'Answer: <expression>'."
)
"""The ``worked`` style's prompt (only characters of the shipped SentencePiece vocabulary)."""
CALCULATOR_TEMPLATE = (
    "Using the numbers {numbers}, write an expression that equals {target}. The calculator "
    "answers '<3 * 4=' with '12>'. End your response with 'Answer: <expression>'."
)
"""The ``calculator`` style's prompt: the ``calculator`` environment
(:mod:`reco_megatron.envs.calculator`) evaluates ``<expression=`` and returns ``value>``."""
CountdownStyle = Literal["answer", "worked", "calculator"]
STYLES: tuple[str, ...] = get_args(CountdownStyle)
"""The response styles of :func:`generate`."""
_GOLD_RE = re.compile(r"target=(-?\d+) numbers=(\d+(?:,\d+)*)")


@dataclass(frozen=True)
class Problem:
    """One countdown problem. ``solutions``: canonical distinct expressions (all of them);
    ``style``: what the prompt asks for and the warm-up teaches (:data:`STYLES`)."""

    numbers: tuple[int, ...]
    target: int
    solutions: tuple[str, ...]
    style: str = "answer"

    @property
    def prompt(self) -> str:
        template = {"worked": WORKED_TEMPLATE, "calculator": CALCULATOR_TEMPLATE}.get(
            self.style, PROMPT_TEMPLATE
        )
        return template.format(numbers=list(self.numbers), target=self.target)

    def response(self, solution: str) -> str:
        """The warm-up's response text for one of :attr:`solutions` in this style."""
        if self.style == "worked":
            return worked_response(self.numbers, solution)
        if self.style == "calculator":
            return calculator_response(solution)
        return f"Answer: {solution}"

    @property
    def gold(self) -> str:
        """The reward's ``gold`` string: ``"target=24 numbers=3,5,7,9"``."""
        return f"target={self.target} numbers={','.join(map(str, self.numbers))}"


def parse_gold(gold: str) -> tuple[int, tuple[int, ...]]:
    """Inverse of :attr:`Problem.gold`; ValueError quoting ``gold`` if malformed."""
    match = _GOLD_RE.fullmatch(gold.strip()) if isinstance(gold, str) else None
    if match is None:
        raise ValueError(f"countdown gold must look like 'target=24 numbers=3,5,7,9', got {gold!r}")
    return int(match.group(1)), tuple(int(x) for x in match.group(2).split(","))


# Canonical expressions are nested tuples, so equality *is* "same up to commutativity and
# associativity": ("n", 3) a number; ("s", ((sign, child), ...)) a flattened sum with sorted
# signed terms (children are never sums); ("p", (child, ...)) a flattened product with sorted
# factors (children are never products).
Node = tuple


def _terms(node: Node, sign: int) -> list[tuple[int, Node]]:
    if node[0] == "s":
        return [(sign * s, child) for s, child in node[1]]
    return [(sign, node)]


def _factors(node: Node) -> list[Node]:
    return list(node[1]) if node[0] == "p" else [node]


def _combine(a: Node, b: Node) -> list[Node]:
    """Every expression combining ``a`` and ``b`` once: a+b, a-b, b-a, a*b (canonical)."""
    return [
        ("s", tuple(sorted(_terms(a, 1) + _terms(b, 1)))),
        ("s", tuple(sorted(_terms(a, 1) + _terms(b, -1)))),
        ("s", tuple(sorted(_terms(b, 1) + _terms(a, -1)))),
        ("p", tuple(sorted(_factors(a) + _factors(b)))),
    ]


def evaluate(node: Node) -> int:
    """Integer value of a canonical node."""
    if node[0] == "n":
        return node[1]
    if node[0] == "s":
        return sum(sign * evaluate(child) for sign, child in node[1])
    value = 1
    for child in node[1]:
        value *= evaluate(child)
    return value


def render(node: Node) -> str:
    """Plain expression text, positives first: ``("s", ((-1, 5), (1, 3)))`` -> ``"3 - 5"``."""
    if node[0] == "n":
        return str(node[1])
    if node[0] == "p":
        return "*".join(f"({render(c)})" if c[0] == "s" else render(c) for c in node[1])
    terms = sorted(node[1], key=lambda t: -t[0])  # stable: positives first
    text = ""
    for i, (sign, child) in enumerate(terms):
        body = render(child)
        if i == 0:
            text = body if sign > 0 else f"-{body}"
        else:
            text += f" + {body}" if sign > 0 else f" - {body}"
    return text


def canonical(tree: tuple) -> Node:
    """The canonical node of a parsed expression (:attr:`reco_megatron.data.arith.Parsed.tree`):
    the same equivalence as the generator's (commutativity and associativity of ``+`` and
    ``*``, ``a-(b-c)`` == ``a-b+c``), so two answers get the same node exactly when they count
    as the same solution. A unary minus negates the terms of its operand."""
    kind = tree[0]
    if kind == "n":
        return tree
    if kind == "neg":
        return ("s", tuple(sorted(_terms(canonical(tree[1]), -1))))
    a, b = canonical(tree[1]), canonical(tree[2])
    if kind == "*":
        return ("p", tuple(sorted(_factors(a) + _factors(b))))
    return ("s", tuple(sorted(_terms(a, 1) + _terms(b, 1 if kind == "+" else -1))))


def worked_steps(node: Node) -> list[tuple[int, str, int, int]]:
    """The steps ``(a, op, b, a op b)`` that compute a canonical node, children first, each
    sum and product combined left to right in :func:`render`'s order (positives first).
    ``("p", (("s", ((1, 4), (1, 5))), ("n", 3)))`` -> ``[(4, "+", 5, 9), (9, "*", 3, 27)]``."""
    steps: list[tuple[int, str, int, int]] = []

    def value_of(child: Node) -> int:
        if child[0] != "n":
            steps.extend(worked_steps(child))
        return evaluate(child)

    if node[0] == "n":
        return steps
    if node[0] == "p":
        values = [value_of(c) for c in node[1]]
        acc = values[0]
        for v in values[1:]:
            steps.append((acc, "*", v, acc * v))
            acc *= v
        return steps
    terms = sorted(node[1], key=lambda t: -t[0])  # render's order: positives first
    values = [(sign, value_of(c)) for sign, c in terms]
    if values[0][0] < 0:
        raise ValueError(f"a sum without a positive term has no worked form: {render(node)!r}")
    acc = values[0][1]
    for sign, v in values[1:]:
        steps.append((acc, "+" if sign > 0 else "-", v, acc + sign * v))
        acc += sign * v
    return steps


def worked_response(numbers: Sequence[int], solution: str) -> str:
    """The ``worked`` style's response for ``solution`` over ``numbers``: every step followed
    by the numbers still available (sorted), then the answer, on one line (the shipped
    tokenizer has no newline). ``([2, 3, 4, 5], "3*(4 + 5) - 2")`` ->
    ``"[2, 3, 4, 5] 4 + 5 = 9 [2, 3, 9] 3 * 9 = 27 [2, 27] 27 - 2 = 25 [25]. Answer: ..."``."""
    from reco_megatron.data.arith import parse_arithmetic

    pool = sorted(numbers)
    parts = [str(pool)]
    for a, op, b, c in worked_steps(canonical(parse_arithmetic(solution).tree)):
        pool.remove(a)
        pool.remove(b)
        pool = sorted([*pool, c])
        parts.append(f"{a} {op} {b} = {c} {pool}")
    return " ".join(parts) + f". Answer: {solution}"


def calculator_response(solution: str) -> str:
    """The ``calculator`` style's response: each step of :func:`worked_steps` as a calculator
    call ``<a op b=`` with the value the environment returns (``c>``), then the answer.
    ``"3*(4 + 5)"`` -> ``"<4 + 5=9> <3 * 9=27> Answer: 3*(4 + 5)"``."""
    from reco_megatron.data.arith import parse_arithmetic

    steps = worked_steps(canonical(parse_arithmetic(solution).tree))
    calls = [f"<{a} {op} {b}={c}>" for a, op, b, c in steps]
    return " ".join([*calls, f"Answer: {solution}"])


def solution_key(expression: str) -> str | None:
    """A text naming ``expression``'s solution up to the equivalence of :func:`canonical`
    (``"3*(4+5)"`` and ``"(5 + 4) * 3"`` give the same key), or None if it does not parse."""
    from reco_megatron.data.arith import ArithmeticParseError, parse_arithmetic

    try:
        return render(canonical(parse_arithmetic(expression).tree))
    except ArithmeticParseError:
        return None


def enumerate_solutions(numbers: Sequence[int]) -> dict[int, set[Node]]:
    """Map each reachable value to its distinct canonical expressions (numbers used <= once)."""
    n = len(numbers)
    table: dict[int, set[Node]] = {1 << i: {("n", x)} for i, x in enumerate(numbers)}
    for mask in range(1, 1 << n):
        if mask in table:
            continue
        found: set[Node] = set()
        sub = (mask - 1) & mask
        while sub:
            other = mask ^ sub
            if sub < other:  # each unordered split once; _combine covers both orders
                for a in table[sub]:
                    for b in table[other]:
                        found.update(_combine(a, b))
            sub = (sub - 1) & mask
        table[mask] = found
    by_value: dict[int, set[Node]] = {}
    for nodes in table.values():
        for node in nodes:
            by_value.setdefault(evaluate(node), set()).add(node)
    return by_value


def generate(
    n: int,
    *,
    seed: int,
    n_numbers: int = 4,
    max_number: int = 12,
    target_range: tuple[int, int] = (10, 100),
    min_solutions: int = 3,
    exclude: set[tuple[tuple[int, ...], int]] | None = None,
    style: CountdownStyle = "answer",
) -> list[Problem]:
    """``n`` problems, deterministic in ``seed``, each with ``>= min_solutions`` solutions.

    ``exclude``: (sorted numbers, target) keys to skip, e.g. the train split for held-out.
    ``style``: :data:`STYLES`; it changes the prompt and the warm-up text, not the problems.
    """
    if style not in STYLES:
        raise ValueError(f"countdown style must be one of {list(STYLES)}, got {style!r}")
    if n < 0 or n_numbers < 2 or max_number < 2 or min_solutions < 1:
        raise ValueError(
            f"need n >= 0, n_numbers >= 2, max_number >= 2, min_solutions >= 1; got n={n}, "
            f"n_numbers={n_numbers}, max_number={max_number}, min_solutions={min_solutions}"
        )
    rng = random.Random(seed)
    seen = set(exclude or ())
    problems: list[Problem] = []
    attempts = 0
    while len(problems) < n:
        attempts += 1
        if attempts > 50 * n + 1000:
            raise RuntimeError(
                f"could not find {n} countdown problems with >= {min_solutions} solutions in "
                f"{attempts} draws: widen target_range={target_range} or lower min_solutions"
            )
        numbers = tuple(sorted(rng.randint(2, max_number) for _ in range(n_numbers)))
        by_value = enumerate_solutions(numbers)
        lo, hi = target_range
        candidates = sorted(
            v
            for v, keys in by_value.items()
            if lo <= v <= hi and len(keys) >= min_solutions and v not in numbers
        )
        candidates = [v for v in candidates if (numbers, v) not in seen]
        if not candidates:
            continue
        target = rng.choice(candidates)
        seen.add((numbers, target))
        solutions = tuple(sorted(render(k) for k in by_value[target]))
        problems.append(Problem(numbers=numbers, target=target, solutions=solutions, style=style))
    return problems


def to_record(problem: Problem, index: int, split: str, max_listed: int = 16) -> dict:
    """JSON record: ``prompt``, ``answer`` (the reward's gold), and metadata."""
    return {
        "id": f"countdown-{split}-{index:06d}",
        "prompt": problem.prompt,
        "answer": problem.gold,
        "numbers": list(problem.numbers),
        "target": problem.target,
        "n_solutions": len(problem.solutions),
        "solutions": list(problem.solutions[:max_listed]),
    }


def write_splits(
    out_dir: str | Path, *, n_train: int, n_eval: int, seed: int, **kwargs: object
) -> tuple[Path, Path]:
    """Write ``train.jsonl`` and ``eval.jsonl`` (disjoint problems) under ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    train = generate(n_train, seed=seed, **kwargs)  # type: ignore[arg-type]
    keys = {(p.numbers, p.target) for p in train}
    held_out = generate(n_eval, seed=seed + 1_000_003, exclude=keys, **kwargs)  # type: ignore[arg-type]
    paths = (out / "train.jsonl", out / "eval.jsonl")
    for path, split, problems in zip(paths, ("train", "eval"), (train, held_out), strict=True):
        with path.open("w", encoding="utf-8") as f:
            for i, problem in enumerate(problems):
                f.write(json.dumps(to_record(problem, i, split)) + "\n")
    log.info("countdown: wrote %d train / %d eval problems to %s", n_train, n_eval, out)
    return paths


def main(argv: Sequence[str] | None = None) -> None:
    """CLI: ``python -m reco_megatron.data.countdown --out DIR --n-train N --n-eval M``."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--n-train", type=int, default=1000)
    ap.add_argument("--n-eval", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--n-numbers", type=int, default=4)
    ap.add_argument("--max-number", type=int, default=12)
    ap.add_argument("--min-solutions", type=int, default=3)
    ap.add_argument("--style", choices=STYLES, default="answer")
    args = ap.parse_args(argv)
    write_splits(
        args.out,
        n_train=args.n_train,
        n_eval=args.n_eval,
        seed=args.seed,
        n_numbers=args.n_numbers,
        max_number=args.max_number,
        min_solutions=args.min_solutions,
        style=args.style,
    )


if __name__ == "__main__":
    main()
