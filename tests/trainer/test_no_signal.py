"""The no-signal guard, the method's name on the progress line, the end-of-run commands with
the run's interpreter, and reco-eval keeping an earlier evaluation."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest

from reco_megatron.trainer.lifecycle import DeadRunGuard, NoSignalGuard, NoSignalStop
from reco_megatron.trainer.sections import StabilityConfig


def _row(step: int, zero_adv_frac: float, reward: float = 0.0) -> dict[str, float]:
    return {"step": step, "zero_adv_frac": zero_adv_frac, "reward_mean": reward}


def test_warns_once_at_the_kth_step_of_a_streak(caplog) -> None:
    guard = NoSignalGuard(StabilityConfig(no_signal_steps=3))
    with caplog.at_level(logging.WARNING):
        for step in range(1, 8):
            guard.observe(_row(step, 1.0))
    lines = [r.getMessage() for r in caplog.records if "no learning signal" in r.getMessage()]
    assert lines == [lines[0]] and "steps 1-3" in lines[0], lines
    assert "check that the reward scores this task's answers" in lines[0]


def test_a_step_with_signal_restarts_the_count(caplog) -> None:
    guard = NoSignalGuard(StabilityConfig(no_signal_steps=3))
    with caplog.at_level(logging.WARNING):
        for step, frac in enumerate([1.0, 1.0, 0.5, 1.0, 1.0], start=1):
            guard.observe(_row(step, frac))
    assert not [r for r in caplog.records if "no learning signal" in r.getMessage()]


def test_stop_raises_and_zero_turns_it_off() -> None:
    guard = NoSignalGuard(StabilityConfig(no_signal_steps=2, no_signal_action="stop"))
    guard.observe(_row(1, 1.0))
    with pytest.raises(NoSignalStop, match="steps 1-2 every group's responses had the same"):
        guard.observe(_row(2, 1.0))
    off = NoSignalGuard(StabilityConfig(no_signal_steps=0, no_signal_action="stop"))
    for step in range(1, 10):
        off.observe(_row(step, 1.0))


def test_the_dead_run_guards_observation_drives_it(tmp_path: Path) -> None:
    """The loop's one hook (``DeadRunGuard.observe``) feeds the no-signal guard too: a run that
    never earned a reward is not dead, but it has no signal."""
    cfg = StabilityConfig(no_signal_steps=2, no_signal_action="stop")
    dead = DeadRunGuard(cfg, tmp_path)
    dead.observe({**_row(1, 1.0), "reward_nonzero_frac": 0.0})
    with pytest.raises(NoSignalStop):
        dead.observe({**_row(2, 1.0), "reward_nonzero_frac": 0.0})


def test_no_signal_steps_is_validated() -> None:
    with pytest.raises(ValueError, match=r"stability\.no_signal_steps must be an integer >= 0"):
        StabilityConfig(no_signal_steps=-1)


def test_the_progress_line_names_the_method() -> None:
    from reco_megatron.config import config_to_dict, load_config
    from reco_megatron.trainer.config import TrainConfig
    from reco_megatron.trainer.reporting.metrics_writer import loss_label

    def label(*overrides: str) -> str:
        cfg = load_config(TrainConfig, "examples/tiny_cpu.yaml", list(overrides))
        return loss_label(config_to_dict(cfg)["loss"])

    # the tiny example's GRPO has eps_high 0.28 and no KL, like DAPO: still called grpo
    assert label() == "reco" and label("loss.preset=grpo") == "grpo"
    assert label("loss.preset=reco_plain") == "reco_plain"
    assert label("loss.preset=cispo") == "cispo"


def test_next_commands_use_the_runs_interpreter(tmp_path, monkeypatch) -> None:
    from reco_megatron.trainer.reporting.summary import command

    bin_dir = tmp_path / "venv" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "reco-eval").write_text("#!/bin/sh\n")
    monkeypatch.setattr(sys, "executable", str(bin_dir / "python"))
    monkeypatch.chdir(tmp_path)
    assert command("reco-eval") == "venv/bin/reco-eval"
    assert command("reco-export") == "reco-export"  # none beside it: the bare name


def test_reco_eval_keeps_an_earlier_evaluation(tmp_path, caplog) -> None:
    from reco_megatron.evaluate import main

    ckpt, out, data = tmp_path / "ckpt", tmp_path / "eval", tmp_path / "p.jsonl"
    ckpt.mkdir()
    out.mkdir()
    data.write_text('{"prompt": "1+1", "answer": "2"}\n')
    (out / "passk.json").write_text("{}")
    args = [str(ckpt), "--data", str(data), "--out", str(out), "--tokenizer", "x.model"]
    with caplog.at_level(logging.ERROR):
        assert main([*args, "--reward", "math"]) == 2
    message = caplog.records[-1].getMessage()
    assert "already holds an earlier evaluation (passk.json)" in message
    assert "--overwrite" in message
