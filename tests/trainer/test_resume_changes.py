"""Resumes that say what changed: a schedule change is applied (the optimizer's learning rate
really changes), a change of what is trained is refused with the keys listed (data files by
content), and every start is kept in ``config_history.jsonl``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from reco_megatron.trainer.lifecycle.config_history import diff_configs, is_safe
from tests.tiny_overrides import TINY_RUN

ROOT = Path(__file__).resolve().parents[2]
BASE = [*TINY_RUN, "sft.steps=0", "eval.interval=0"]


def test_safe_keys_and_content_changes_are_told_apart() -> None:
    saved = {"optimizer": {"lr": 1e-3, "adam_beta1": 0.9}, "trainer": {"seed": 1, "max_steps": 5}}
    now = {"optimizer": {"lr": 2e-3, "adam_beta1": 0.8}, "trainer": {"seed": 1, "max_steps": 9}}
    now["trainer"]["allow_config_change"] = False  # a key this version added, at its default
    diff = diff_configs(
        saved, now, {"data.train_path": "sha256:a"}, {"data.train_path": "sha256:b"}
    )
    assert diff.safe == [("optimizer.lr", 1e-3, 2e-3), ("trainer.max_steps", 5, 9)]
    assert diff.trained == [
        ("optimizer.adam_beta1", 0.9, 0.8),
        ("data.train_path (content)", "sha256:a", "sha256:b"),
    ]
    for key in ("stability.ratio_max", "eval.n", "reward.num_workers", "parallel.micro_batch_size"):
        assert is_safe(key), key
    for key in ("model.hidden_size", "loss.objective", "reward.reward", "rollout.group_size"):
        assert not is_safe(key), key


def test_keys_an_older_config_had_resume() -> None:
    """A checkpoint of an older release holds keys this one replaced: one at a neutral value
    (``data.dataset.max_prompt_len: null``) is no change, one that was set
    (``trainer.tensorboard: true``) is a safe change, logged, never a refusal."""
    saved = {"data": {"dataset": {"max_prompt_len": None}}, "trainer": {"tensorboard": True}}
    now: dict = {"data": {"dataset": {}}, "trainer": {}}
    diff = diff_configs(saved, now, {}, {})
    assert diff.safe == [("trainer.tensorboard", True, None)]
    assert diff.trained == []
    saved["data"]["dataset"]["max_prompt_len"] = 80
    assert diff_configs(saved, now, {}, {}).trained == []


def test_keys_this_version_added_are_no_change_at_the_old_behaviour() -> None:
    """A checkpoint written before separate placement existed resumes colocated without a
    change; resuming it with the workers is a safe change, logged."""
    saved: dict = {"rollout": {"group_size": 8}, "loss": {"objective": "reco"}}
    now = {
        "rollout": {"group_size": 8, "placement": "colocated", "num_workers": 1},
        "loss": {"objective": "reco", "response_weight_policy": "auto"},
    }
    diff = diff_configs(saved, now, {}, {})
    assert diff.safe == diff.trained == []
    now["rollout"]["placement"] = "separate"
    now["loss"]["response_weight_policy"] = "behaviour"
    diff = diff_configs(saved, now, {}, {})
    assert diff.safe == [("rollout.placement", None, "separate")]
    assert diff.trained == [("loss.response_weight_policy", None, "behaviour")]


def _train(out: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "reco_megatron.train", "examples/tiny_cpu.yaml", *BASE]
    return subprocess.run(
        [*cmd, f"trainer.output_dir={out}", *extra],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=600,
    )


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.slow
def test_resume_refuses_what_changes_training_and_applies_the_schedule(tmp_path) -> None:
    out = tmp_path / "run"
    first = _train(out, "trainer.max_steps=2")
    assert first.returncode == 0, first.stderr[-3000:]
    metrics = (out / "metrics.jsonl").read_text()

    refused = _train(out, "trainer.max_steps=3", "trainer.seed=7", "rollout.group_size=8")
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert "trainer.seed: 1234 -> 7" in refused.stderr
    assert "rollout.group_size: 4 -> 8" in refused.stderr
    assert "trainer.allow_config_change=true" in refused.stderr
    assert "Traceback" not in refused.stderr

    data = out / "data" / "train.jsonl"  # the same rows in another order: other data
    original = data.read_bytes()
    data.write_text("".join(reversed(original.decode().splitlines(keepends=True))))
    reordered = _train(out, "trainer.max_steps=3")
    assert reordered.returncode == 2, reordered.stderr[-3000:]
    assert "data.train_path (content): 'sha256:" in reordered.stderr
    data.write_bytes(original)
    assert (out / "metrics.jsonl").read_text() == metrics  # refused starts change nothing
    assert len(_lines(out / "config_history.jsonl")) == 1

    # lr up (the remedy the stability guard suggests): before, "the checkpoint is damaged"
    resumed = _train(out, "trainer.max_steps=3", "optimizer.lr=1e-3")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resume: optimizer.lr 0.0005 -> 0.001" in resumed.stderr
    rows = _lines(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[1]["lr"] == pytest.approx(5e-4) and rows[2]["lr"] == pytest.approx(1e-3)
    history = _lines(out / "config_history.jsonl")
    assert [h["from_step"] for h in history] == [0, 2]
    assert history[1]["checkpoint"] == "step_00000002"
    assert history[1]["changes"] == {"optimizer.lr": [5e-4, 1e-3], "trainer.max_steps": [2, 3]}
    assert history[1]["config"]["optimizer"]["lr"] == 1e-3
    assert set(history[0]["inputs"]) == {"data.train_path", "data.tokenizer"}

    # a damaged 'latest': one line; with on_damaged=fallback the newest checkpoint is used
    # (and the config check runs against the checkpoint actually loaded)
    (out / "checkpoints" / "latest").write_bytes(b"step_0000\xe90003\n")
    damaged = _train(out, "trainer.max_steps=3", "optimizer.lr=1e-3")
    assert damaged.returncode == 2 and "holds non-ASCII bytes" in damaged.stderr
    assert "Traceback" not in damaged.stderr
    fallback = _train(
        out, "trainer.max_steps=3", "optimizer.lr=1e-3", "checkpoint.on_damaged=fallback"
    )
    assert fallback.returncode == 0, fallback.stderr[-3000:]
    assert "resuming from the newest complete checkpoint, step_00000003" in fallback.stderr
    assert (out / "checkpoints" / "latest").read_text() == "step_00000003\n"
