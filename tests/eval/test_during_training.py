"""The trainer's periodic coverage evaluation: config validation and schedule (the run itself is
exercised by the coverage smoke test)."""

from __future__ import annotations

import json

import pytest

from reco_megatron.eval.during_training import CoverageEvaluator, EvalConfig, held_out_path
from tests.eval.test_runner_report import CORRECT, FakeEngine, _grade


def test_eval_config_validation() -> None:
    assert EvalConfig().interval == 0  # off by default
    with pytest.raises(ValueError, match=r"kmax=8 > n=4"):
        EvalConfig(n=4, kmax=8)
    with pytest.raises(ValueError, match=r"eval\.interval"):
        EvalConfig(interval=-1)


class _Tok:
    eos_id, pad_id, vocab_size = 2, 0, 16

    def encode(self, text: str) -> list[int]:
        return [int(text.strip()[1:])]

    def decode(self, ids) -> str:
        return " ".join(str(i) for i in ids)


def test_schedule_rows_and_curve(tmp_path) -> None:
    from reco_megatron.data.chat import PromptFormatter

    data = tmp_path / "held_out.jsonl"
    data.write_text(
        "".join(json.dumps({"id": k, "prompt": k, "answer": "1"}) + "\n" for k in CORRECT)
    )
    assert held_out_path("", tmp_path) is None
    assert held_out_path(str(data), tmp_path) == data
    cov = CoverageEvaluator(
        EvalConfig(interval=3, n=8, num_prompts=0),
        data,
        tmp_path,
        _Tok(),
        PromptFormatter(template="{prompt}"),
        max_new_tokens=4,
        max_prompt_len=8,
        answer_key=lambda text, gold: text,
    )
    engine = FakeEngine()
    ran = [s for s in range(8) if cov.maybe_run(s, 7, engine, _grade) is not None]
    assert ran == [0, 3, 6, 7]
    rows = [json.loads(x) for x in (tmp_path / "eval.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == ran
    assert rows[0]["pass@1"] == pytest.approx(12 / 32) and rows[0]["rare_correct_frac"] == 0.25
    assert rows[0]["distinct_correct"] == 0.75  # every correct sample is the text "1"
    assert cov.finish() == tmp_path / "coverage_curve.png"
    resumed = CoverageEvaluator(
        EvalConfig(interval=3, n=8),
        data,
        tmp_path,
        _Tok(),
        PromptFormatter(template="{prompt}"),
        max_new_tokens=4,
        max_prompt_len=8,
    )
    assert not resumed.due(6, 7) and resumed.due(9, 12)  # logged steps are not redone
