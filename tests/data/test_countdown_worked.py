"""The countdown task's ``worked`` style: steps that compute the solution, a prompt the shipped
tokenizer encodes, long responses; the default ``answer`` style unchanged byte for byte."""

from __future__ import annotations

import hashlib
import statistics
from pathlib import Path

import pytest

from reco_megatron.data.arith import parse_arithmetic
from reco_megatron.data.countdown import (
    canonical,
    evaluate,
    generate,
    worked_response,
    worked_steps,
    write_splits,
)
from reco_megatron.data.tokenizer import SentencePieceTokenizer
from reco_megatron.trainer import setup
from reco_megatron.trainer.config import CountdownConfig

ROOT = Path(__file__).resolve().parents[2]
TINY = {"n_numbers": 4, "max_number": 5, "target_range": (5, 16), "min_solutions": 4}
# Hashes of what the code before the worked style wrote for examples/tiny_cpu.yaml's task
# (the README numbers are a run on exactly these bytes).
SPLITS_SHA256 = "0a1682267ad190242b02e291ee2744488f8015bfac3a9c2d82bba7d3b1ae2f81"
SFT_SHA256 = "6ce28f9304a7d3de74536f4dca46e90da9de872837afdf7e4d07d41b544ef49c"
UNK = 1  # the shipped SentencePiece model's <unk>


def _tokenizer() -> SentencePieceTokenizer:
    return SentencePieceTokenizer(str(ROOT / "examples/tiny/countdown_sp.model"))


def test_default_style_writes_the_same_bytes_as_before(tmp_path: Path) -> None:
    train, held_out = write_splits(tmp_path, n_train=110, n_eval=24, seed=1234, **TINY)
    digest = hashlib.sha256(train.read_bytes() + held_out.read_bytes()).hexdigest()
    assert digest == SPLITS_SHA256


def test_default_style_teaches_the_same_tokens_as_before() -> None:
    countdown = CountdownConfig(
        n_train=110, n_eval=24, n_numbers=4, max_number=5, target_min=5, target_max=16,
        min_solutions=4,
    )  # fmt: skip
    assert countdown.style == "answer"
    batches = setup.sft_batches(
        _tokenizer(), "{prompt}\n", steps=3, batch_size=32, solutions_per_problem=3,
        seed=1234, max_len=128, countdown=countdown,
    )  # fmt: skip
    h = hashlib.sha256()
    for batch in batches:
        h.update(batch.tokens.numpy().tobytes())
        h.update(batch.response_mask.numpy().tobytes())
    assert h.hexdigest() == SFT_SHA256


def test_steps_by_hand() -> None:
    assert worked_steps(canonical(parse_arithmetic("3*(4 + 5) - 2").tree)) == [
        (4, "+", 5, 9),
        (3, "*", 9, 27),
        (27, "-", 2, 25),
    ]
    assert worked_response([2, 3, 4, 5], "3*(4 + 5) - 2") == (
        "[2, 3, 4, 5] 4 + 5 = 9 [2, 3, 9] 3 * 9 = 27 [2, 27] 27 - 2 = 25 [25]. "
        "Answer: 3*(4 + 5) - 2"
    )
    # negative intermediate results inside a product (factors in canonical order)
    assert worked_steps(canonical(parse_arithmetic("(2 - 5)*(2 - 4)").tree)) == [
        (2, "-", 4, -2),
        (2, "-", 5, -3),
        (-2, "*", -3, 6),
    ]


def test_every_solution_is_computed_by_its_steps_from_the_given_numbers() -> None:
    for problem in generate(30, seed=5, style="worked", **TINY):
        for solution in problem.solutions:
            steps = worked_steps(canonical(parse_arithmetic(solution).tree))
            pool = list(problem.numbers)
            for a, op, b, c in steps:
                assert c == {"+": a + b, "-": a - b, "*": a * b}[op]
                pool.remove(a)
                pool.remove(b)
                pool.append(c)
            assert (
                steps[-1][3]
                == problem.target
                == evaluate(canonical(parse_arithmetic(solution).tree))
            )


def test_worked_problems_are_the_answer_problems_with_a_longer_response() -> None:
    answer = generate(40, seed=9, **TINY)
    worked = generate(40, seed=9, style="worked", **TINY)
    assert [(p.numbers, p.target, p.solutions) for p in answer] == [
        (p.numbers, p.target, p.solutions) for p in worked
    ]
    assert all(len(p.solutions) >= 4 for p in worked)
    tok = _tokenizer()
    lengths = [len(tok.encode(p.response(s))) for p in worked for s in p.solutions]
    assert statistics.median(lengths) >= 64 and max(lengths) + 1 <= 96  # + EOS
    assert all(UNK not in tok.encode(p.prompt) for p in worked)
    assert all(UNK not in tok.encode(p.response(s)) for p in worked for s in p.solutions)
    assert max(len(tok.encode(p.prompt + "\n")) for p in worked) <= 112


def test_an_unknown_style_is_refused() -> None:
    with pytest.raises(ValueError, match="style must be one of"):
        generate(1, seed=0, style="long")  # type: ignore[arg-type]
