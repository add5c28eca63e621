"""Progress where a person waits (a bar, or lines where none fits; rates without the first
step) and the end-of-run summary."""

from __future__ import annotations

import io
import json
import logging
import os
from pathlib import Path

import pytest

from reco_megatron.trainer.reporting import progress as progress_mod
from reco_megatron.trainer.reporting import summary_lines
from reco_megatron.trainer.reporting.progress import StepProgress, can_draw_bar, format_seconds


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> _Clock:
    fake = _Clock()
    monkeypatch.setattr(progress_mod.time, "perf_counter", fake)
    return fake


@pytest.fixture
def lines(caplog):
    package = logging.getLogger("reco_megatron")
    package.addHandler(caplog.handler)
    caplog.handler.setLevel(logging.INFO)
    yield caplog
    package.removeHandler(caplog.handler)


def test_rate_and_eta_ignore_the_first_step(clock, lines) -> None:
    """After a resume at step 7, a 10 s first step (compilation, first sync) and 0.5 s steps:
    0.50 s/step (not 7.30), and a line per step where no bar can be drawn."""
    p = StepProgress(20, desc="reco", initial=7, bar=False)
    for duration in (10.0, 0.5, 0.5):
        clock.now += duration
        p.update({"reward_mean": 0.25})
    assert p.seconds_per_step() == pytest.approx(0.5)
    assert p.eta() == pytest.approx(0.5 * 10)
    messages = [r.getMessage() for r in lines.records]
    assert messages[0] == "reco 8/20 reward_mean=0.25 (first step 0:10, includes warm-up)"
    assert messages[-1] == "reco 10/20 reward_mean=0.25 (0.50 s/step, ETA 5.0 s)"


def test_lines_every_n_steps_and_the_last(clock, lines) -> None:
    p = StepProgress(25, desc="sft", every=10, bar=False)
    for _ in range(25):
        clock.now += 1.0
        p.update({"nll": 1.0})
    shown = [r.getMessage().split(" nll")[0] for r in lines.records]
    assert shown == ["sft 1/25", "sft 10/25", "sft 20/25", "sft 25/25"]


def test_no_bar_on_a_pipe_or_a_zero_column_terminal(monkeypatch) -> None:
    assert not can_draw_bar(io.StringIO())

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr(
        progress_mod.shutil, "get_terminal_size", lambda fallback: os.terminal_size((0, 0))
    )
    assert not can_draw_bar(Tty())
    monkeypatch.setattr(
        progress_mod.shutil, "get_terminal_size", lambda fallback: os.terminal_size((120, 40))
    )
    assert can_draw_bar(Tty())


def test_bar_shows_rate_without_the_first_step(clock) -> None:
    p = StepProgress(10, desc="reco", bar=True)
    for duration in (7.3, 0.5, 0.5):
        clock.now += duration
        p.update({"reward_mean": 0.1, "unique_frac": 0.9, "loss": 0.0, "grad_norm": 1.0})
    postfix = p._bar.postfix
    p.close()
    assert "0.50 s/step, ETA" in postfix and "grad_norm" not in postfix


def test_nothing_left_draws_nothing(lines) -> None:
    p = StepProgress(5, desc="reco", initial=5)
    assert not p.enabled and p._bar is None
    p.close()


def test_format_seconds() -> None:
    assert format_seconds(3.14) == "3.1 s"
    assert format_seconds(75.3) == "1:15"
    assert format_seconds(3725) == "1:02:05"


def test_summary(tmp_path: Path) -> None:
    rows = [
        {"step": i, "reward_mean": 0.1 if i <= 10 else 0.3, "unique_frac": 0.9 if i <= 10 else
         0.5, "time_rollout": 1.0, "time_train": 2.0}
        for i in range(1, 61)
    ]  # fmt: skip
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "checkpoints" / "step_00000060").mkdir(parents=True)
    phases = {"startup": 20.0, "sft": 118.0, "rl": 180.0}
    text = "\n".join(summary_lines(tmp_path, phases, first_step=50, total_s=320.0))
    assert "reward_mean  0.100 (steps 1-10) -> 0.300 (steps 51-60)" in text
    assert "unique_frac  0.900 (steps 1-10) -> 0.500 (steps 51-60)" in text
    assert "start-up 0:20, SFT warm-up 1:58, RL 3:00 (10 steps: rollout 0:10, updates 0:20)" in text
    assert "5:20 in all" in text
    assert "checkpoints/step_00000060 (latest)" in text
    assert f"reco-eval {tmp_path}" in text and f"reco-export {tmp_path}/checkpoints" in text
    assert "base=" not in text
    (tmp_path / "checkpoints" / "step_00000000").mkdir()
    text = "\n".join(summary_lines(tmp_path, phases))
    assert f"reco-eval base={tmp_path}/checkpoints/step_00000000 trained={tmp_path}" in text


@pytest.mark.dist  # a real (tiny) run, in this process
def test_the_first_rl_steps_time_leaves_the_sft_warm_up_out(tmp_path, monkeypatch, lines) -> None:
    """The warm-up is made to look 1000 s long (the clock jumps as it ends): the first RL
    step's line must not carry it ("first step 4:27" was the whole SFT phase)."""
    import time

    from reco_megatron.train import main
    from reco_megatron.trainer.loop import Trainer
    from tests.tiny_overrides import TINY_RUN

    real, jump = time.perf_counter, [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: real() + jump[0])
    warm_up = Trainer._warm_up

    def long_warm_up(self: Trainer, start: int) -> bool:
        stopped = warm_up(self, start)
        jump[0] += 1000.0
        return stopped

    monkeypatch.setattr(Trainer, "_warm_up", long_warm_up)
    monkeypatch.chdir(Path(__file__).resolve().parents[2])
    args = ["examples/tiny_cpu.yaml", *TINY_RUN, "sft.steps=2", "sft.batch_size=8"]
    args += ["trainer.max_steps=2", "eval.interval=0", f"trainer.output_dir={tmp_path / 'run'}"]
    assert main(args) == 0
    (first,) = [r.getMessage() for r in lines.records if r.getMessage().startswith("reco 1/2 ")]
    shown = first.split("(first step ", 1)[1].split(",", 1)[0]  # "2.6 s", "0:12" or "16:42"
    parts = [float(x) for x in shown.removesuffix(" s").split(":")]
    seconds = sum(x * 60**i for i, x in enumerate(reversed(parts)))
    assert seconds < 1000, first  # the step alone, not the warm-up's 1000 s
