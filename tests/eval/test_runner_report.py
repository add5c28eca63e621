"""The sampling loop on a fake engine with known correct counts, and the written outputs."""

from __future__ import annotations

import json
import math

import pytest

from reco_megatron.algo.passk import pass_at_k
from reco_megatron.eval import report
from reco_megatron.eval.metrics import coverage_summary, ks_up_to
from reco_megatron.eval.runner import EvalProblem, evaluate_problems, problem_seed
from reco_megatron.rollout.requests import Completion, SamplingParams

CORRECT = {"p0": 0, "p1": 1, "p2": 3, "p3": 8}


class FakeEngine:
    """Sample j of a problem is token ``[1]`` (correct) for j < c, else ``[0, seed % 7]``."""

    def __init__(self) -> None:
        self.seeds: dict[int, int] = {}

    def generate(self, prompts, n, sampling):
        (prompt,) = prompts
        c = CORRECT[f"p{prompt[0]}"]
        self.seeds[prompt[0]] = sampling.seed
        group = [
            Completion(
                prompt_index=0,
                sample_index=j,
                token_ids=[1] if j < c else [0, sampling.seed % 7, j],
                logprobs=[0.0] if j < c else [0.0, 0.0, 0.0],
                finish_reason="stop",
            )
            for j in range(n)
        ]
        return [group]


def _grade(texts, golds):
    return [1.0 if t == "1" else 0.0 for t in texts]


def _decode(ids):
    return " ".join(str(i) for i in ids)


def _problems(order=(0, 1, 2, 3)):
    return [EvalProblem(id=f"p{i}", prompt_ids=[i], gold="1") for i in order]


def test_counts_and_passk_from_a_fake_engine() -> None:
    engine = FakeEngine()
    results = evaluate_problems(
        engine, _problems(), n=8, sampling=SamplingParams(), grade=_grade, decode=_decode
    )
    assert [r.correct for r in results] == [0, 1, 3, 8]
    summary = coverage_summary(results, ks_up_to(8))
    for k in (1, 2, 4, 8):
        expected = sum(float(pass_at_k(8, c, k)) for c in CORRECT.values()) / 4
        assert math.isclose(summary[f"pass@{k}"], expected, abs_tol=1e-12)
    assert summary["rare_correct_frac"] == 0.25


def test_seeds_are_per_problem_and_independent_of_order() -> None:
    a, b = FakeEngine(), FakeEngine()
    kw = dict(n=2, sampling=SamplingParams(), grade=_grade, decode=_decode, seed=5)
    evaluate_problems(a, _problems(), **kw)
    evaluate_problems(b, _problems(order=(3, 1, 2, 0)), **kw)
    assert a.seeds == b.seeds
    assert len(set(a.seeds.values())) == 4
    assert a.seeds[0] == problem_seed(5, "p0") != problem_seed(6, "p0")


def test_empty_problem_list_is_an_error() -> None:
    with pytest.raises(ValueError, match="empty"):
        evaluate_problems(
            FakeEngine(), [], n=2, sampling=SamplingParams(), grade=_grade, decode=_decode
        )


def test_outputs_exist_and_parse(tmp_path) -> None:
    results = evaluate_problems(
        FakeEngine(), _problems(), n=8, sampling=SamplingParams(), grade=_grade, decode=_decode
    )
    summary = coverage_summary(results, ks_up_to(8))
    entries = [report.entry(label, "ckpt", summary, results, {"n": 8}) for label in ("a", "b")]
    path = report.write_json(tmp_path / "t.json", entries)
    back = report.read_json(path)
    assert [e["label"] for e in back] == ["a", "b"]
    assert back[0]["problems"][2]["correct"] == 3
    assert back[0]["summary"]["pass@8"] == pytest.approx(0.75)
    json.loads(path.read_text())
    md = report.markdown_table([("a", summary)], {"a": {"pass@1": 0.01}})
    header, _rule, row = md.strip().splitlines()
    assert header.startswith("| checkpoint | pass@1 | pass@2 | pass@4 | pass@8 |")
    assert row.count("|") == header.count("|") and "± 1.0" in row
    png = report.plot_passk(
        tmp_path / "p.png", [("a", summary), ("b", summary)], {"a": (summary, summary)}
    )
    import matplotlib.image as mpimg

    assert mpimg.imread(png).ndim == 3
    rows = [{"step": s, **summary} for s in (0, 5)]
    curve = report.plot_over_training(tmp_path / "c.png", rows)
    assert curve is not None and curve.stat().st_size > 1000


def test_distinct_correct_counts_distinct_keys_of_correct_samples_only() -> None:
    """Correct samples "1" all give key "one"; with a key that tells them apart by their
    sample index the count is c; wrong samples never count, None keys never count."""
    problems = _problems()
    kw = dict(n=8, sampling=SamplingParams(), grade=_grade, decode=_decode)
    same = evaluate_problems(FakeEngine(), problems, answer_key=lambda t, g: "one", **kw)
    assert [r.extra["distinct_correct"] for r in same] == [0, 1, 1, 1]
    calls = iter(range(10**6))
    each = evaluate_problems(FakeEngine(), problems, answer_key=lambda t, g: str(next(calls)), **kw)
    assert [r.extra["distinct_correct"] for r in each] == [0, 1, 3, 8]
    none = evaluate_problems(FakeEngine(), problems, answer_key=lambda t, g: None, **kw)
    assert [r.extra["distinct_correct"] for r in none] == [0, 0, 0, 0]
    summary = coverage_summary(each, ks_up_to(8))
    assert summary["distinct_correct"] == 3.0
    assert "distinct_correct" not in coverage_summary(
        evaluate_problems(FakeEngine(), problems, **kw), ks_up_to(8)
    )


def test_an_answer_key_returning_a_non_string_is_named() -> None:
    def bad_key(text, gold):
        return 3

    with pytest.raises(TypeError, match=r"bad_key.*must return a string"):
        evaluate_problems(
            FakeEngine(), _problems(), n=8, sampling=SamplingParams(), grade=_grade,
            decode=_decode, answer_key=bad_key,
        )  # fmt: skip
