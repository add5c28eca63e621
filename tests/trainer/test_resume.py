"""Preemption: SIGTERM mid-run, checkpoint, exit 75, rerun -> the same metrics rows.

A real process gets a real signal (right after step 1 of 8 is logged). On CPU in one
process every piece of the step is deterministic (per-prompt sampling seeds, restored
weights, optimizer, scheduler, RNGs and data position), so the resumed run's rows equal the
uninterrupted run's bit for bit, except the wall-clock ``time_*`` columns.
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

from reco_megatron.trainer.reporting import is_wall_clock
from tests.trainer.test_loop import TINY

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def _cmd(out: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "reco_megatron.train",
        "examples/tiny_cpu.yaml",
        *TINY,
        "trainer.max_steps=8",
        "checkpoint.save_interval=0",
        f"trainer.output_dir={out}",
    ]


def _rows(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [{k: v for k, v in r.items() if not is_wall_clock(k)} for r in rows]


def test_sigterm_then_resume_equals_uninterrupted(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    full = tmp_path / "full"
    subprocess.run(_cmd(full), cwd=ROOT, env=env, check=True, timeout=600, capture_output=True)

    cut = tmp_path / "cut"
    proc = subprocess.Popen(
        _cmd(cut), cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 600
    # Signal as soon as step 1 is logged: 7 steps remain, far longer than the signal takes.
    while len(_rows(cut)) < 1:
        assert proc.poll() is None, proc.stderr.read()
        assert time.monotonic() < deadline, "the run did not reach step 1"
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    proc.send_signal(signal.SIGTERM)  # a second signal while it finishes/saves is harmless
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 75, err[-3000:]
    assert "stopped by signal" in err
    stopped_at = len(_rows(cut))
    assert 1 <= stopped_at < 8
    assert (cut / "checkpoints" / "latest").read_text().strip() == f"step_{stopped_at:08d}"

    resumed = subprocess.run(
        _cmd(cut), cwd=ROOT, env=env, timeout=600, capture_output=True, text=True
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stderr
    assert _rows(cut) == _rows(full)
