"""examples/coverage: per-seed lists in seed-number order, and the stored report's per-seed
tables are what its stored per-problem counts give."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "docs" / "results"
METHODS = ("grpo", "reco", "reco_plain", "reco_cmax", "reco_response_only", "reco_token_only")
"""The report's rows, in its order."""


def _analysis():
    sys.path.insert(0, str(ROOT / "examples" / "coverage"))
    spec = importlib.util.spec_from_file_location(
        "coverage_analysis_order", ROOT / "examples/coverage/analysis.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _entry(label: str, distinct: float) -> dict:
    problem = {"id": 0, "n": 8, "correct": 1, "unique_frac": 0.5}
    return {"label": label, "problems": [{**problem, "extra": {"distinct_correct": distinct}}]}


def test_per_seed_lists_follow_the_seed_numbers() -> None:
    """Seeds 1, 2, 10 (a string sort gives s1, s10, s2): each reco run is `seed` distinct
    answers ahead of GRPO's, so the listed differences must read 1, 2, 10."""
    an = _analysis()
    seeds = (10, 1, 2)
    entries = [_entry("base", 0.0)]
    entries += [_entry(f"grpo/s{s}", 0.0) for s in seeds]
    entries += [_entry(f"reco/s{s}", float(s)) for s in seeds]
    table = an.seed_test_table(an.group(entries), ["grpo", "reco"])
    header, _, row = table.strip().splitlines()
    assert "per seed (s1, s2, s10)" in header
    assert row.split(" | ")[4] == "+1.00, +2.00, +10.00"


def test_stored_per_seed_tables_are_the_stored_counts() -> None:
    an = _analysis()
    entries = json.loads((RESULTS / "coverage_passk.json").read_text())["checkpoints"]
    report = (RESULTS / "coverage.md").read_text(encoding="utf-8")
    base = [e for e in entries if e["label"] == "base"]
    for budget in (120, 40):
        at = an.group(base + [e for e in entries if e.get("rl_step") == budget])
        table = an.seed_test_table(at, list(METHODS))
        section = report[report.index(f"## Results after {budget} RL steps") :]
        assert table in section, f"the per-seed table after {budget} steps is not the stored one"
