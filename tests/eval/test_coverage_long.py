"""The long-response coverage experiment (examples/coverage/run.py --style worked): units
that are skipped once written, so the experiment continues across sessions; the report from
whatever units exist; and the whole pipeline at a tiny scale."""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples" / "coverage"))


def _module(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / f"examples/coverage/{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _entry(label: str, correct: list[int]) -> dict:
    return {
        "label": label,
        "problems": [
            {"id": f"p{i}", "n": 4, "correct": c, "unique_frac": 0.5,
             "extra": {"distinct_correct": min(c, 2)}}
            for i, c in enumerate(correct)
        ],
        "summary": {"time_s": 1.0},
    }  # fmt: skip


class _Fake:
    """Stand-ins for the RL run and the evaluation: record the calls, write metrics rows."""

    def __init__(self, tmp: Path) -> None:
        self.tmp, self.calls = tmp, []

    def run_dir(self, method: str, seed: int) -> Path:
        return self.tmp / "runs" / f"{method}-s{seed}"

    def train(self, job: tuple[str, int]) -> float:
        self.calls.append(("train", *job))
        d = self.run_dir(*job)
        d.mkdir(parents=True, exist_ok=True)
        w = 0.0 if job[0] == "grpo" else 0.25
        rows = [{"step": s, "weight_active": w, "weight_active_tokens": w / 5} for s in (1, 2)]
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        return 0.0

    def evaluate(self, label: str, step_dir: Path) -> list[dict]:
        self.calls.append(("eval", label))
        return [_entry(label, [1, 2, 0] if label != "base" else [0, 1, 0])]


def _run(units, fake, methods, seeds, deadline=None, settings=None):
    return units.run_units(
        units_dir=fake.tmp / "units", settings=settings or {"rl_steps": 2},
        methods=methods, seeds=seeds, base_step=fake.tmp / "base", train=fake.train,
        evaluate=fake.evaluate, run_dir=fake.run_dir, rl_steps=2, render=lambda u: None,
        deadline=deadline,
    )  # fmt: skip


def test_units_are_taken_seed_by_seed_and_skipped_once_written(tmp_path: Path) -> None:
    units = _module("long_units")
    (tmp_path / "base").mkdir()
    (tmp_path / "base" / "model.pt").write_bytes(b"weights")
    fake = _Fake(tmp_path)
    methods = ["grpo", "reco_prefix"]
    got = _run(units, fake, methods, [1, 2], deadline=time.time() + 3600)
    assert [c for c in fake.calls if c[0] == "train"] == [
        ("train", "grpo", 1), ("train", "reco_prefix", 1),
        ("train", "grpo", 2), ("train", "reco_prefix", 2),
    ]  # fmt: skip
    assert sorted(got) == sorted(p.name for p in (tmp_path / "units").glob("*.json"))
    assert len(got) == 5 and got["reco_prefix-s1.json"]["training"]["weight_active"] == {
        "first": 0.25, "last": 0.25, "all": 0.25
    }  # fmt: skip
    # A later session: only the missing unit is trained, the base is not evaluated again.
    (tmp_path / "units" / "grpo-s2.json").unlink()
    fake.calls.clear()
    _run(units, fake, methods, [1, 2])
    assert fake.calls == [("train", "grpo", 2), ("eval", "grpo/s2")]
    # Past the deadline no unit starts; other settings are refused, not mixed in.
    (tmp_path / "units" / "grpo-s2.json").unlink()
    fake.calls.clear()
    _run(units, fake, methods, [1, 2], deadline=time.time() - 1)
    assert fake.calls == []
    with pytest.raises(SystemExit, match="other --units directory"):
        _run(units, fake, methods, [1, 2], settings={"rl_steps": 3})
    # Only complete seeds enter the tables (seed 2 lacks grpo): base + seed 1's two methods.
    entries = units.entries(units.read_units(tmp_path / "units", {"rl_steps": 2}), methods)
    assert [e["label"] for e in entries] == ["base", "grpo/s1", "reco_prefix/s1"]


def test_reports_say_when_units_come_from_more_than_one_base() -> None:
    units = _module("long_units")
    one = {"base.json": {"base": "aa"}, "grpo-s1.json": {"base": "aa"}}
    assert units.base_note(one) == ""
    two = {**one, "reco-s1.json": {"base": "bb"}}
    note = units.base_note(two)
    assert "2 different SFT bases" in note
    assert "`aa`: base, grpo-s1" in note and "`bb`: reco-s1" in note


@pytest.mark.slow
def test_long_coverage_experiment_smoke(tmp_path: Path) -> None:
    run = _module("run")
    out = tmp_path / "long"
    argv = ["--smoke", "--style", "worked", "--out", str(out), "--eval-threads", "1"]
    assert run.main(argv) == 0
    names = sorted(p.name for p in (out / "coverage_long").glob("*.json"))
    assert names == ["base.json", "grpo-s1.json", "reco-s1.json", "reco_prefix-s1.json"]
    unit = json.loads((out / "coverage_long" / "reco_prefix-s1.json").read_text())
    assert {"weight_active", "weight_active_tokens"} <= set(unit["training"])
    assert unit["entry"]["label"] == "reco_prefix/s1" and unit["entry"]["rl_step"] == 2
    report = (out / "coverage_long.md").read_text()
    assert "Units done: 4 of 4 planned" in report and "| reco_prefix - grpo |" in report
    assert "| reco_prefix | " in report.split("## Where the response weight acts")[1]
    # Worked responses: the base's samples are long (the smoke's base is barely trained).
    base_unit = json.loads((out / "coverage_long" / "base.json").read_text())
    assert base_unit["entry"]["summary"]["mean_len"] > 24
    # The same command again finds every unit done and redoes nothing.
    stamps = {p: p.stat().st_mtime_ns for p in (out / "coverage_long").glob("*.json")}
    assert run.main(argv) == 0
    assert {p: p.stat().st_mtime_ns for p in (out / "coverage_long").glob("*.json")} == stamps
    # The base is stored beside the units; a new --out (a later session) restores it instead
    # of training it, and its tensors are the ones every unit names.
    manifest = json.loads((out / "coverage_long_base" / "manifest.json").read_text())
    assert manifest["digest"] == base_unit["base"]
    later = tmp_path / "later"
    units = ["--units", str(out / "coverage_long"), "--results", str(later / "report.md")]
    assert run.main([*argv[:-4], "--out", str(later), *units, "--eval-threads", "1"]) == 0
    assert not (later / "logs" / "base.log").exists()
    assert (later / "base" / "checkpoints" / "latest").exists()
    assert "Units done: 4 of 4 planned" in (later / "report.md").read_text()


@pytest.mark.slow
@pytest.mark.skipif(sys.version_info < (3, 12), reason="main stack only (CI time)")
def test_staleness_experiment_smoke(tmp_path: Path) -> None:
    """The staleness units: a K = 0 run and a K = 2 run (trainer plus a rollout worker) from
    one base, each a unit with the staleness columns, and the report comparing them."""
    run = _module("run")
    out = tmp_path / "stale"
    argv = ["--smoke", "--experiment", "staleness", "--methods", "reco_k0", "reco_k2"]
    assert run.main([*argv, "--out", str(out), "--eval-threads", "1"]) == 0
    names = sorted(p.name for p in (out / "coverage_staleness").glob("*.json"))
    assert names == ["base.json", "reco_k0-s1.json", "reco_k2-s1.json"]
    k0 = json.loads((out / "coverage_staleness" / "reco_k0-s1.json").read_text())["training"]
    k2 = json.loads((out / "coverage_staleness" / "reco_k2-s1.json").read_text())["training"]
    assert "staleness_mean" not in k0 and k2["staleness_mean"]["all"] > 0
    report = (out / "coverage_staleness.md").read_text()
    assert "Units done: 3 of 3 planned" in report and "| reco_k2 - reco_k0 |" in report
