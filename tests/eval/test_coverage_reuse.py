"""examples/coverage/reuse.py: evaluations of an earlier run stand in for runs of this one
only with proof (another seed reproduced exactly) and the same protocol."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROTOCOL = {"n": 4, "kmax": 4, "temperature": 1.0, "top_p": 1.0, "max_new_tokens": 24,
            "seed": 0, "reward": "countdown"}  # fmt: skip


def _module():
    sys.path.insert(0, str(ROOT / "examples" / "coverage"))
    spec = importlib.util.spec_from_file_location("reuse", ROOT / "examples/coverage/reuse.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _entry(label: str, step: int, correct: int) -> dict:
    problems = [{"id": "p0", "n": 4, "correct": correct, "extra": {"distinct_correct": 1.0}}]
    protocol = {**PROTOCOL, "data": "/old/eval.jsonl"}
    return {"label": label, "checkpoint": "/old/ckpt", "protocol": str(protocol),
            "summary": {"pass@1": correct / 4, "time_s": 60.0}, "problems": problems,
            "rl_step": step}  # fmt: skip


def test_reuse_with_proof(tmp_path) -> None:
    reuse = _module()
    src = tmp_path / "old.json"
    old = [_entry(f"{m}/s{s}", 2, s) for m in ("grpo", "reco") for s in (1, 2)]
    src.write_text(json.dumps({"checkpoints": old}))
    mapping = reuse.parse_methods(["grpo", "reco=reco_plain"], ["grpo", "reco", "reco_plain"])
    assert mapping == {"grpo": "grpo", "reco": "reco_plain"}
    parts = tmp_path / "parts"
    reused = reuse.seed_parts(src, mapping, [2], [2], parts, PROTOCOL)
    assert reused == {("grpo", 2), ("reco_plain", 2)}
    part = json.loads((parts / "reco_plain-s2-step_00000002" / "passk.json").read_text())
    assert part["checkpoints"][0]["label"] == "reco_plain/s2"
    assert part["checkpoints"][0]["reused_from"] == str(src)
    # seed 1 trained afresh and reproduced exactly: the note names the proof
    fresh = [{**_entry("grpo/s1", 2, 1)}, {**_entry("reco_plain/s1", 2, 1)}]
    note = reuse.check_reproduced(src, mapping, fresh, reused, tmp_path / "reused.json")
    assert "grpo/s1@2, reco_plain/s1@2 reproduced" in note
    assert json.loads((tmp_path / "reused.json").read_text())["mismatched"] == []
    # a fresh evaluation that differs refuses the reuse
    fresh[1]["problems"] = [{**fresh[1]["problems"][0], "correct": 3}]
    with pytest.raises(SystemExit, match=r"\['reco_plain/s1@2'\] differ"):
        reuse.check_reproduced(src, mapping, fresh, reused, tmp_path / "reused.json")
    # nothing compared: no proof
    with pytest.raises(SystemExit, match="nothing proves the reuse"):
        reuse.check_reproduced(src, mapping, [], reused, tmp_path / "reused.json")


def test_reuse_refuses_other_protocols_and_missing_entries(tmp_path) -> None:
    reuse = _module()
    src = tmp_path / "old.json"
    src.write_text(json.dumps({"checkpoints": [_entry("grpo/s2", 2, 1)]}))
    with pytest.raises(SystemExit, match="not comparable"):
        reuse.seed_parts(src, {"grpo": "grpo"}, [2], [2], tmp_path, {**PROTOCOL, "n": 8})
    with pytest.raises(SystemExit, match="no evaluation of grpo/s3 at step 2"):
        reuse.seed_parts(src, {"grpo": "grpo"}, [3], [2], tmp_path, PROTOCOL)
    with pytest.raises(SystemExit, match="give METHOD or OLD=METHOD"):
        reuse.parse_methods(["reco=nope"], ["grpo"])
