"""The coverage experiment's reduced version (examples/coverage/run.py --smoke): SFT base ->
GRPO and ReCo (1 seed, 2 RL steps, coverage eval every step) -> reco-eval -> report. Checks
that the pipeline runs and writes its outputs, not the outcome."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_coverage_experiment_smoke(tmp_path) -> None:
    spec = importlib.util.spec_from_file_location("coverage_run", ROOT / "examples/coverage/run.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "cov"
    assert module.main(["--smoke", "--out", str(out), "--methods", "grpo", "reco"]) == 0
    entries = json.loads((out / "eval" / "passk.json").read_text())["checkpoints"]
    assert [e["label"] for e in entries] == ["base", "grpo/s1", "reco/s1"]
    assert all(set(e["summary"]) >= {"pass@1", "pass@4", "rare_correct_frac"} for e in entries)
    report = (out / "coverage.md").read_text()
    assert "| grpo |" in report and "coverage.png" in report
    assert (out / "coverage.png").stat().st_size > 1000
    # Resumable: a second invocation finds every stage done and redoes none of them.
    parts = sorted((out / "eval" / "parts").glob("*/*/passk.json"))
    names = [p.parent.name for p in parts]
    assert names == ["base-step_00000000", "grpo-s1-step_00000002", "reco-s1-step_00000002"]
    stamps = {p: p.stat().st_mtime_ns for p in parts}
    ckpt_stamps = {p: p.stat().st_mtime_ns for p in out.glob("*/**/checkpoints/latest")}
    assert len(ckpt_stamps) == 3
    assert module.main(["--smoke", "--out", str(out), "--methods", "grpo", "reco"]) == 0
    assert {p: p.stat().st_mtime_ns for p in parts} == stamps
    assert {p: p.stat().st_mtime_ns for p in out.glob("*/**/checkpoints/latest")} == ckpt_stamps
    for run in ("grpo-s1", "reco-s1"):
        rows = [json.loads(x) for x in (out / "runs" / run / "eval.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == [0, 1, 2]
        assert "pass@2" in rows[0] and "unique_frac" in rows[0]
        assert (out / "runs" / run / "coverage_curve.png").exists()
