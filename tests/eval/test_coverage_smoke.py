"""The coverage experiment's reduced version (examples/coverage/run.py --smoke): SFT base ->
GRPO and ReCo (1 seed, 2 RL steps, coverage eval every step, GRPO's budget curve) -> reco-eval
-> report. Checks that the pipeline runs and writes its outputs, not the outcome; the report's
statistics are checked against hand-made counts."""

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
    argv = ["--smoke", "--out", str(out), "--methods", "grpo", "reco", "--curve", "grpo/s1"]
    argv += ["--curve-steps", "3", "--save-every", "1"]  # the curve run goes one step further
    argv += ["--report-steps", "1", "--keep-all"]  # and the methods are compared at 1 and 2
    assert module.main(argv) == 0
    raw = json.loads((out / "eval" / "passk.json").read_text())["checkpoints"]
    assert sorted((e["label"], e["rl_step"]) for e in raw) == [
        ("base", 0), ("grpo/s1", 1), ("grpo/s1", 2), ("grpo/s1", 3), ("reco/s1", 1), ("reco/s1", 2)
    ]  # fmt: skip
    entries = [e for e in raw if e["rl_step"] in (0, 2)]
    keys = {"pass@1", "pass@4", "rare_correct_frac", "distinct_correct"}
    assert all(set(e["summary"]) >= keys for e in entries)
    for e in entries:  # distinct correct solutions never exceed the correct samples
        assert all(0 <= p["extra"]["distinct_correct"] <= p["correct"] for p in e["problems"])
    report = (out / "coverage.md").read_text()
    assert "| grpo | 1 |" in report and "| reco - grpo |" in report
    assert report.index("## Results after 2 RL steps") < report.index("## Results after 1 RL")
    assert "## Budget search" in report
    assert [
        line.split(" |")[0] for line in report.splitlines() if line[:3] in ("| 1", "| 2", "| 3")
    ] == ["| 1", "| 2", "| 3"]  # the curve: every saved step of grpo/s1, also past --rl-steps
    for png in ("coverage.png", "coverage_budget.png"):
        assert png in report and (out / png).stat().st_size > 1000
    curves = json.loads((out / "coverage_passk_curves.json").read_text())
    assert curves["k"] == [1, 2, 3, 4] and set(curves) == {"k", "base", "grpo", "reco"}
    # Resumable: a second invocation finds every stage done and redoes none of them.
    parts = sorted((out / "eval" / "parts").glob("*/*/passk.json"))
    names = [p.parent.name for p in parts]
    assert names == [
        "base-step_00000000",
        "grpo-s1-step_00000001",
        "grpo-s1-step_00000002",
        "grpo-s1-step_00000003",
        "reco-s1-step_00000001",
        "reco-s1-step_00000002",
    ]
    stamps = {p: p.stat().st_mtime_ns for p in parts}
    ckpt_stamps = {p: p.stat().st_mtime_ns for p in out.glob("*/**/checkpoints/latest")}
    assert len(ckpt_stamps) == 3
    copy = json.loads((out / "coverage_passk.json").read_text())["checkpoints"]
    assert len(copy) == len(raw)
    assert module.main(argv) == 0
    assert {p: p.stat().st_mtime_ns for p in parts} == stamps
    assert {p: p.stat().st_mtime_ns for p in out.glob("*/**/checkpoints/latest")} == ckpt_stamps
    for run, steps in (("grpo-s1", [0, 1, 2, 3]), ("reco-s1", [0, 1, 2])):
        rows = [json.loads(x) for x in (out / "runs" / run / "eval.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == steps
        assert "pass@2" in rows[0] and "unique_frac" in rows[0]
        assert (out / "runs" / run / "coverage_curve.png").exists()


def test_coverage_report_statistics_from_counts(tmp_path) -> None:
    """pass@k, intervals and paired differences from hand-made per-problem counts."""
    spec = importlib.util.spec_from_file_location(
        "coverage_analysis", ROOT / "examples/coverage/analysis.py"
    )
    assert spec is not None and spec.loader is not None
    analysis = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(analysis)

    def entry(label, correct, distinct):
        problems = [
            {"id": f"p{i}", "n": 4, "correct": c, "unique_frac": 0.5,
             "extra": {"distinct_correct": d}}
            for i, (c, d) in enumerate(zip(correct, distinct, strict=True))
        ]  # fmt: skip
        return {"label": label, "problems": problems}

    entries = [
        entry("base", [0, 1, 4, 2], [0, 1, 3, 2]),
        entry("grpo/s1", [0, 4, 4, 4], [0, 1, 1, 1]),
        entry("grpo/s2", [0, 4, 4, 4], [0, 1, 1, 1]),
        entry("reco/s1", [1, 4, 4, 4], [1, 2, 2, 2]),
        entry("reco/s2", [1, 4, 4, 4], [1, 2, 2, 2]),
    ]
    groups = analysis.group(entries)
    assert [len(groups[m]) for m in ("base", "grpo", "reco")] == [1, 2, 2]
    # pass@4 with n = 4 is "solved at all": base 3/4, grpo 3/4, reco 4/4.
    assert analysis.values(groups["reco"], "pass@4").mean() == 1.0
    assert analysis.values(groups["base"], "pass@1").mean() == (0 + 0.25 + 1 + 0.5) / 4
    table = analysis.results_table(groups, ["grpo", "reco"])
    assert "| grpo | 2 | 75.0 [" in table  # pass@1 of grpo: 3 of 4 problems always solved
    diff = analysis.difference_table(groups, ["grpo", "reco"], ["grpo"])
    # reco - grpo in distinct correct: +1 on every problem and seed, a zero-width interval.
    assert "+1.00 [+1.00, +1.00]*" in diff
    curves = analysis.passk_curves(groups, ["grpo", "reco"], n_boot=50)
    assert curves["k"] == [1, 2, 3, 4]
    assert curves["reco"]["mean"][-1] == 100.0 and curves["base"]["mean"][-1] == 75.0
    assert curves["base"]["mean"][0] == 100.0 * (0 + 0.25 + 1 + 0.5) / 4
    png = analysis.plot_passk_curves(tmp_path / "c.png", curves, "t")
    assert png.stat().st_size > 1000
    budget = [(0, entries[0]), (10, entries[1])]
    assert analysis.plot_budget(tmp_path / "b.png", {"grpo/s1": budget}).stat().st_size > 1000
    assert "| 10 |" in analysis.budget_table(budget)
    grpo = curves["grpo"]
    assert all(
        lo <= m <= hi for lo, m, hi in zip(grpo["low"], grpo["mean"], grpo["high"], strict=True)
    )
    # Training table: first/last-window means per run, then over runs; a metric that one run
    # did not log is averaged over the others and says so; null (NaN) rows are left out.
    run_a = [{"step": t, "reward_mean": float(t), "weight_active": None} for t in range(40)]
    run_b = [{"step": t, "reward_mean": 1.0, "weight_active": 0.5} for t in range(40)]
    row = analysis.training_table({"reco": [run_a, run_b]}).splitlines()[2]
    assert row.startswith("| reco | 5.250 -> 15.250 |")  # (9.5 + 1) / 2 and (29.5 + 1) / 2
    assert row.endswith("| 0.500 -> 0.500 (1 of 2 runs) |")
    # A run that solves nothing is a training failure: its seed can be left out for everyone.
    assert analysis.diverged_seeds(groups, ["grpo", "reco"]) == []
    broken = [dict(e) for e in entries]
    broken[4] = entry("reco/s2", [0, 0, 0, 0], [0, 0, 0, 0])
    bgroups = analysis.group(broken)
    assert analysis.diverged_seeds(bgroups, ["grpo", "reco"]) == [1]
    kept = analysis.without_seeds(bgroups, ["grpo", "reco"], [1])
    assert [r.label for r in kept["grpo"]] == ["grpo/s1"] and len(kept["reco"]) == 1
    tests = analysis.seed_test_table(groups, ["grpo", "reco"])
    assert "| reco | +25.0, +25.0 | 2/2 | 0.5 | +1.00, +1.00 | 2/2 | 0.5 |" in tests
    entries[3]["problems"] = entries[3]["problems"][:3]
    with pytest.raises(ValueError, match="other problems"):
        analysis.group(entries)
