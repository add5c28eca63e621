"""SIGTERM, SIGUSR1 and Ctrl-C in every phase end with exit 75 and an intact checkpoint.

The story test stops one run four times, each time differently, and checks that the run
that finally completes equals an uninterrupted one row for row:

1. SIGTERM to the process group during the SFT warm-up (before: exit 143, the warm-up lost):
   exit 75, checkpoint ``sft_*``;
2. SIGTERM during RL step 2, a second one while its stop checkpoint is written and a third
   after it (before: the one after the checkpoint gave exit 143): exit 75, each noted;
3. Ctrl-C (SIGINT) during RL step 4 and a second one while its checkpoint is written: stopped
   at once, the partial checkpoint removed, the previous complete one (step 3) named, exit 75;
4. the same command to the end.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from reco_megatron.trainer.lifecycle import RunAborted, StopSignals
from reco_megatron.trainer.reporting import is_wall_clock
from tests.tiny_overrides import TINY_RUN

ROOT = Path(__file__).resolve().parents[2]
ARGS = [
    *TINY_RUN,
    "sft.steps=6",
    "sft.batch_size=8",
    "trainer.max_steps=4",
    "checkpoint.save_interval=1",
    "checkpoint.keep_last=1",
    "eval.interval=0",
]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", "RECO_LOG_LEVEL": "DEBUG"}


def test_the_state_machine() -> None:
    before = signal.getsignal(signal.SIGINT)  # SIG_IGN when pytest runs as a background job
    signals = StopSignals().install()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        assert signals.received == signal.SIGTERM
        os.kill(os.getpid(), signal.SIGUSR1)  # again: noted, nothing raised
        with pytest.raises(RunAborted):
            os.kill(os.getpid(), signal.SIGINT)  # a second Ctrl-C stops at once
    finally:
        signals.restore()
    assert signal.getsignal(signal.SIGINT) is before


def _cmd(out: Path) -> list[str]:
    return [sys.executable, "-m", "reco_megatron.train", "examples/tiny_cpu.yaml", *ARGS]


class _Run:
    """A trainer in its own process group (as srun starts a job step), its log in a file."""

    def __init__(self, out: Path, name: str) -> None:
        self.out, self.log = out, out.parent / f"{name}.log"
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(
                [*_cmd(out), f"trainer.output_dir={out}"],
                cwd=ROOT,
                env=ENV,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def text(self) -> str:
        return self.log.read_text()

    def wait_for(self, ready, what: str) -> None:
        deadline = time.monotonic() + 600
        while not ready():
            assert self.proc.poll() is None, f"ended before {what}: {self.text()[-3000:]}"
            assert time.monotonic() < deadline, f"never reached {what}"
            time.sleep(0.002)

    def wait_into_step_after(self, step: int) -> None:
        """Until RL step ``step + 1`` has begun: the loop logs it (at DEBUG) after the stop
        check that follows step ``step`` and its checkpoint, so a signal sent now lands inside
        that step (a step takes > 0.1 s here), never at the check before it."""
        self.wait_for(lambda: f"step {step + 1} begins" in self.text(), f"RL step {step + 1}")

    def signal(self, sig: int) -> None:
        os.killpg(self.proc.pid, sig)

    def saving(self) -> bool:
        return any((self.out / "checkpoints").glob(".tmp-*"))

    def rows(self) -> int:
        path = self.out / "metrics.jsonl"
        return len(path.read_text().splitlines()) if path.exists() else 0

    def finish(self) -> tuple[int, str]:
        code = self.proc.wait(timeout=600)
        text = self.text()
        assert "Traceback" not in text, text[-3000:]
        return code, text


def _latest(out: Path) -> str:
    return (out / "checkpoints" / "latest").read_text().strip()


def _rows(out: Path) -> list[dict]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(x).items() if not is_wall_clock(k)} for x in lines]


@pytest.mark.slow
def test_every_stop_resumes_exactly(tmp_path) -> None:
    reference = tmp_path / "reference"
    done = subprocess.run(
        [*_cmd(reference), f"trainer.output_dir={reference}"],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = tmp_path / "run"

    run = _Run(out, "1-sft")  # 1. SIGTERM during the SFT warm-up
    run.wait_for(lambda: "sft 1/6 " in run.text(), "SFT step 1")
    run.signal(signal.SIGTERM)
    code, text = run.finish()
    assert code == 75 and "during the SFT warm-up" in text
    assert _latest(out).startswith("sft_")

    run = _Run(out, "2-term")  # 2. SIGTERM, again while saving, again after the checkpoint
    run.wait_into_step_after(1)
    run.signal(signal.SIGTERM)  # during step 2
    run.wait_for(run.saving, "a checkpoint being written")
    run.signal(signal.SIGTERM)
    run.wait_for(lambda: "stopped by signal SIGTERM" in run.text(), "the stop checkpoint")
    run.signal(signal.SIGTERM)
    code, text = run.finish()
    assert code == 75 and text.count("received SIGTERM again") == 2
    assert _latest(out) == "step_00000002" and not run.saving()

    run = _Run(out, "3-int")  # 3. Ctrl-C, and Ctrl-C again while a checkpoint is written
    run.wait_into_step_after(3)
    run.signal(signal.SIGINT)  # during step 4: its stop checkpoint is cut short
    run.wait_for(run.saving, "a checkpoint being written")
    run.signal(signal.SIGINT)
    code, text = run.finish()
    assert code == 75 and "Ctrl-C again stops at once" in text
    line = next(x for x in text.splitlines() if x.startswith("reco-train:"))
    assert "stopped at once by a second Ctrl-C" in line and "is intact" in line
    assert _latest(out) == "step_00000003" and "step_00000003" in line and not run.saving()

    code, text = _Run(out, "4-end").finish()  # 4. to the end
    assert code == 0, text[-3000:]
    assert _rows(out) == _rows(reference)
    kept = sorted(p.name for p in (out / "checkpoints").iterdir() if p.name != "latest")
    assert kept == ["step_00000000", "step_00000004"]  # keep_last=1 never drops step 0
