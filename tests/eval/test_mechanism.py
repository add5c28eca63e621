"""The mechanism experiment (examples/mechanism): its exact statistics against sampling, the
synthetic length sweep at its two limits, and the reduced pipeline end to end (resumed without
redoing finished runs)."""

from __future__ import annotations

import importlib
import json
import math
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
HERE = ROOT / "examples" / "mechanism"


@pytest.fixture(scope="module")
def mech():
    # The experiment's modules import each other by bare name (task, rl, stats, ...): load
    # them from its directory and unload them afterwards so no other test sees those names.
    # One torch thread, as run.py uses: these are tiny ops, and two threads on a shared CPU
    # only wait for each other.
    before, threads = set(sys.modules), torch.get_num_threads()
    torch.set_num_threads(1)
    sys.path.insert(0, str(HERE))
    try:
        yield {name: importlib.import_module(name) for name in ("task", "sweep", "run", "length")}
    finally:
        torch.set_num_threads(threads)
        sys.path.remove(str(HERE))
        for name in set(sys.modules) - before:
            if (
                getattr(sys.modules[name], "__file__", "")
                and str(HERE) in sys.modules[name].__file__
            ):
                del sys.modules[name]


def test_valid_stats_match_sampling(mech) -> None:
    # pass@1 is scored exactly (valid answers enumerated); the share of valid answers among 4,000
    # sampled responses per prompt must agree with it within 5 standard errors.
    task_mod = mech["task"]
    spec = task_mod.TaskSpec(prompts=3)
    task = task_mod.Task(spec, seed=3)
    torch.manual_seed(3)
    policy = task_mod.Policy(spec)
    task_mod.sft(policy, task, 60, seed=3)
    stats = task_mod.valid_stats(policy, task, 16)
    n = 4_000
    prompts = torch.arange(3).repeat_interleave(n)
    responses, _, _ = policy.sample(prompts, torch.Generator().manual_seed(0))
    hit = task.reward(prompts, responses).view(3, n).mean(1)
    se = math.sqrt(0.25 / n)
    assert abs(float(hit.mean()) - stats["pass1"]) < 5 * se
    assert 0.0 < stats["entropy"] <= math.log(spec.k_max)
    assert stats["pass1"] > 0.01  # the SFT start puts mass on the valid answers


def test_sweep_limits(mech) -> None:
    sweep = mech["sweep"]
    # A deterministic pool: every response has probability 1 and all G are identical, so the
    # sequence weight is 1/G and the empirical weight 1/G: all below 1.
    one_hot = torch.eye(4)[torch.zeros(16, dtype=torch.long)]
    rows = sweep.activity(one_hot, [1, 64], groups=10)
    assert all(r["w_lt1_sequence"] == 1.0 and r["w_lt1_empirical"] == 1.0 for r in rows)
    # A uniform pool over 4 tokens: log pi(o) = -T log 4, below -log 8 from T = 2 on.
    rows = sweep.activity(torch.full((16, 4), 0.25), [1, 2, 32], groups=50)
    assert rows[0]["w_lt1_sequence"] == 1.0 and rows[1]["w_lt1_sequence"] == 0.0
    assert rows[2]["w_lt1_empirical"] == 0.0
    assert sweep.sequence_threshold(8, math.log(4)) == pytest.approx(1.5)


def test_pipeline_smoke_and_resume(mech, tmp_path) -> None:
    run = mech["run"]
    out = tmp_path / "mech"
    assert run.main(["--smoke", "--out", str(out), "--methods", "grpo", "reco"]) == 0
    raw = sorted(p.name for p in (out / "raw").iterdir())
    assert raw == ["grpo-s1.json", "grpo-s2.json", "reco-s1.json", "reco-s2.json"]
    curves = json.loads((out / "raw" / "reco-s1.json").read_text())["curves"]
    assert curves["step"] == [0, 2, 4, 6]
    assert {"pass1", "entropy", "distinct", "w_lt1_sequence", "w_lt1_empirical"} <= set(curves)
    report = (out / "mechanism.md").read_text()
    assert "| reco |" in report and "mechanism.png" in report and "sign-flip" in report
    assert (out / "mechanism.png").stat().st_size > 1000
    stamps = {p: p.stat().st_mtime_ns for p in (out / "raw").iterdir()}
    assert run.main(["--smoke", "--out", str(out), "--methods", "grpo", "reco"]) == 0
    assert {p: p.stat().st_mtime_ns for p in (out / "raw").iterdir()} == stamps


def test_tree_task_shares_openings_and_is_scored_exactly(mech) -> None:
    # Long answers: 4 choices at segment starts, free fillers. The valid choice strings share
    # openings, and pass@1 scored from the choice probabilities alone (exact whatever the
    # fillers) agrees with sampling full responses within 5 standard errors.
    task_mod = mech["task"]
    spec = task_mod.TaskSpec(prompts=3, length=16, tree=True)
    task = task_mod.Task(spec, seed=4)
    assert task.answers.shape == (3, spec.k_max, 4)
    firsts = [task.answers[q, : int(task.k[q]), 0].tolist() for q in range(3)]
    assert any(len(set(f)) < len(f) for f in firsts)  # some strings share their first choice
    torch.manual_seed(4)
    policy = task_mod.make_policy(spec)
    task_mod.sft(policy, task, 80, seed=4, batch=64)
    stats = task_mod.valid_stats(policy, task, 16)
    n = 4_000
    prompts = torch.arange(3).repeat_interleave(n)
    responses, logp, _ = policy.sample(prompts, torch.Generator().manual_seed(0))
    assert responses.shape == (3 * n, 16)
    torch.testing.assert_close(policy.token_logp(prompts[:64], responses[:64]), logp[:64])
    hit = task.reward(prompts, responses).view(3, n).mean(1)
    assert abs(float(hit.mean()) - stats["pass1"]) < 5 * math.sqrt(0.25 / n)
    assert stats["pass1"] > 0.01
    # fillers are free: changing one leaves the reward as it is
    changed = responses.clone()
    changed[:, 1] = (changed[:, 1] + 1) % spec.vocab
    assert torch.equal(task.reward(prompts, changed), task.reward(prompts, responses))


def test_length_pipeline_smoke_and_resume(mech, tmp_path) -> None:
    length = mech["length"]
    args = ["--lengths", "4", "16", "--seeds", "2", "--steps", "4", "--eval-every", "2",
            "--sft-steps", "10", "--methods", "grpo", "reco_prefix",
            "--units", str(tmp_path / "units"), "--out", str(tmp_path / "cache"),
            "--results", str(tmp_path / "length.md")]  # fmt: skip
    assert length.main(args) == 0
    units = sorted(p.relative_to(tmp_path / "units").as_posix()
                   for p in (tmp_path / "units").rglob("*.json"))  # fmt: skip
    assert units == sorted(f"L{n}/{m}-s{s}.json" for n in (4, 16)
                           for m in ("grpo", "reco_prefix") for s in (1, 2))  # fmt: skip
    unit = json.loads((tmp_path / "units" / "L16" / "reco_prefix-s1.json").read_text())
    assert {"w_lt1_prefix", "w_lt1_tok_prefix", "w_lt1_sequence"} <= set(unit["curves"])
    report = (tmp_path / "length.md").read_text()
    assert report.splitlines()[2].startswith("Generated by `python examples/mechanism/length.py")
    assert "| reco_prefix |" in report and "## L = 16" in report
    stamps = {p: p.stat().st_mtime_ns for p in (tmp_path / "units").rglob("*.json")}
    assert length.main(args) == 0
    assert length.main([*args, "--report-only"]) == 0
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "units").rglob("*.json")} == stamps
    assert "--report-only" not in (tmp_path / "length.md").read_text()
