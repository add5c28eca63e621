"""Countdown problems: determinism, >= k distinct solutions, disjoint splits, the CLI."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest

from reco_megatron.data.arith import parse_arithmetic
from reco_megatron.data.countdown import (
    enumerate_solutions,
    generate,
    parse_gold,
    render,
    solution_key,
    write_splits,
)


def test_generation_is_deterministic_in_the_seed() -> None:
    assert generate(10, seed=7) == generate(10, seed=7)
    assert generate(10, seed=7) != generate(10, seed=8)


@pytest.mark.parametrize("k", [2, 4, 8])
def test_each_problem_has_at_least_k_distinct_verified_solutions(k: int) -> None:
    for problem in generate(15, seed=k, min_solutions=k):
        assert len(set(problem.solutions)) == len(problem.solutions) >= k
        assert problem.target not in problem.numbers
        for solution in problem.solutions:
            parsed = parse_arithmetic(solution)
            assert parsed.value == problem.target
            for number in set(parsed.literals):  # each given number at most once
                assert parsed.literals.count(number) <= problem.numbers.count(number)
        assert parse_gold(problem.gold) == (problem.target, problem.numbers)


def _reachable(values: tuple[int, ...]) -> set[int]:
    """Brute force: every value of an expression using each number at most once."""
    found = set(values)
    for i, j in itertools.permutations(range(len(values)), 2):
        rest = tuple(v for k, v in enumerate(values) if k not in (i, j))
        a, b = values[i], values[j]
        for combined in (a + b, a - b, a * b):
            found |= _reachable((*rest, combined))
    return found


def test_enumeration_reaches_exactly_the_brute_force_values() -> None:
    numbers = (2, 3, 5, 7)
    assert set(enumerate_solutions(numbers)) == _reachable(numbers)


def test_distinct_means_up_to_commutativity_and_associativity() -> None:
    texts = {render(node) for node in enumerate_solutions((2, 3, 4))[9]}
    assert "2 + 3 + 4" in texts  # and not also "4 + 3 + 2", "(2 + 3) + 4", ...
    assert "3*(4 - 2) + 3" not in texts  # 3 used twice is never generated
    assert sum(sorted(t.replace(" ", "")) == sorted("2+3+4") for t in texts) == 1
    assert all(parse_arithmetic(t).value == 9 for t in texts)


def test_splits_are_disjoint_and_the_cli_writes_them(tmp_path: Path) -> None:
    train_path, eval_path = write_splits(tmp_path / "api", n_train=30, n_eval=10, seed=0)
    train = [json.loads(line) for line in train_path.read_text().splitlines()]
    held_out = [json.loads(line) for line in eval_path.read_text().splitlines()]
    assert (len(train), len(held_out)) == (30, 10)
    key = lambda r: (tuple(r["numbers"]), r["target"])  # noqa: E731
    assert not {key(r) for r in train} & {key(r) for r in held_out}
    assert {"id", "prompt", "answer", "n_solutions", "solutions"} <= set(train[0])
    out = tmp_path / "cli"
    cmd = [sys.executable, "-m", "reco_megatron.data.countdown", "--out", str(out)]
    cmd += ["--n-train", "30", "--n-eval", "10", "--seed", "0"]
    subprocess.run(cmd, check=True, capture_output=True, timeout=60)
    assert (out / "train.jsonl").read_text() == train_path.read_text()
    assert (out / "eval.jsonl").read_text() == eval_path.read_text()


def test_bad_arguments_are_explained() -> None:
    with pytest.raises(ValueError, match="n_numbers >= 2"):
        generate(3, seed=0, n_numbers=1)
    with pytest.raises(RuntimeError, match="min_solutions"):
        generate(3, seed=0, n_numbers=2, min_solutions=50)
    with pytest.raises(ValueError, match="target=24 numbers"):
        parse_gold("24")


def test_solution_key_is_the_generators_notion_of_distinct() -> None:
    """Every enumerated solution keys to itself (so n distinct solutions give n keys), and
    rewritings by commutativity / associativity / a-(b-c) = a-b+c give the same key, while
    distributivity does not (the generator counts 3*(4+5) and 3*4+3*5 as two)."""
    for problem in generate(25, seed=11, max_number=6, target_range=(5, 16), min_solutions=4):
        assert [solution_key(s) for s in problem.solutions] == list(problem.solutions)
    same = ["3*(4 + 5)", "(5+4)*3", "((4)+5) * 3"]
    assert len({solution_key(s) for s in same}) == 1
    assert solution_key("5-(4-3)") == solution_key("5 - 4 + 3") == solution_key("-4+5+3")
    assert solution_key("2*(3*4)") == solution_key("4*3*2")
    assert solution_key("3*4 + 3*5") != solution_key("3*(4+5)")
    assert solution_key("x + 1") is None
    assert solution_key("") is None
