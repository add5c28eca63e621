"""Faults as an operator's cluster delivers them, on real training processes.

* Slurm preemption: SIGTERM to the whole process group (``os.killpg``) after the first save:
  exit 75, then the rerun's metrics and eval rows equal an uninterrupted run's.
* SIGKILL of the rank after a step that was not checkpointed: no helper process survives it,
  and the rerun's ``metrics.jsonl`` / ``eval.jsonl`` hold every step exactly once, equal to
  the uninterrupted run.
* A reward function that breaks after its start-up check: exit 3 with a message, before any
  update on the broken rewards; one that fails on some items: per-kind counts per step.
* A disk that fills up during a run (a real tmpfs): a message with free space, needed space
  and the path instead of a raw ``CheckpointException``; after freeing space the rerun works.

One uninterrupted reference run (module fixture) serves the comparisons; CPU runs in one
process are deterministic, so rows agree exactly apart from wall-clock ``time_*`` columns.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from reco_megatron.trainer.reporting import is_wall_clock
from tests.tiny_overrides import TINY_RUN
from tests.tmpfs import fill, small_tmpfs

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
STEPS = 4
BASE = [
    *TINY_RUN,
    "sft.steps=0",
    f"trainer.max_steps={STEPS}",
    "eval.interval=2",
    "eval.n=2",
    "eval.num_prompts=2",
]
ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT)}


def _cmd(out: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "reco_megatron.train",
        "examples/tiny_cpu.yaml",
        *BASE,
        f"trainer.output_dir={out}",
        *extra,
    ]


def _run(out: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        _cmd(out, *extra), cwd=ROOT, env=ENV, timeout=600, capture_output=True, text=True
    )


def _rows(path: Path, drop: str | None = None) -> list[dict]:
    """The rows without wall-clock columns (``drop``: without the columns starting so)."""
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    keep = (lambda k: not k.startswith(drop)) if drop else (lambda k: not is_wall_clock(k))
    return [{k: v for k, v in r.items() if keep(k)} for r in rows]


def _wait_for(proc: subprocess.Popen, ready, what: str) -> None:
    deadline = time.monotonic() + 600
    while not ready():
        assert proc.poll() is None, f"the run ended before {what}: {proc.stderr.read()[-3000:]}"
        assert time.monotonic() < deadline, f"the run did not reach {what}"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("full") / "run"
    done = _run(out, "checkpoint.save_interval=0")
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def _same_as_reference(out: Path, reference: Path) -> None:
    rows = _rows(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert rows == _rows(reference / "metrics.jsonl")
    evals = _rows(out / "eval.jsonl", drop="time_s")
    assert [r["step"] for r in evals] == [0, 2, 4]
    assert evals == _rows(reference / "eval.jsonl", drop="time_s")


def test_process_group_sigterm_after_first_save(tmp_path, reference) -> None:
    out = tmp_path / "run"
    proc = subprocess.Popen(
        _cmd(out, "checkpoint.save_interval=1"),
        cwd=ROOT,
        env=ENV,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, as srun gives a job step
    )
    _wait_for(proc, (out / "checkpoints" / "latest").exists, "its first checkpoint")
    os.killpg(proc.pid, signal.SIGTERM)  # every process of the group: trainer and helpers
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 75, err[-3000:]
    assert "BrokenPipeError" not in err and "stopped by signal" in err
    stopped = len(_rows(out / "metrics.jsonl"))
    assert (out / "checkpoints" / "latest").read_text().strip() == f"step_{stopped:08d}"
    assert not list((out / "checkpoints").glob(".tmp-*"))

    resumed = _run(out, "checkpoint.save_interval=1")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stderr
    _same_as_reference(out, reference)


def _descendants(pid: int) -> list[psutil.Process]:
    return psutil.Process(pid).children(recursive=True)


def test_sigkill_after_an_uncheckpointed_step(tmp_path, reference) -> None:
    out = tmp_path / "run"
    with open(tmp_path / "stderr.log", "w") as log:  # a file: an orphan cannot hold a pipe open
        proc = subprocess.Popen(
            _cmd(out, "checkpoint.save_interval=2"),
            cwd=ROOT,
            env=ENV,
            stdout=subprocess.DEVNULL,
            stderr=log,
        )
    # step 3 is logged, its checkpoint would be at step 4: kill now, mid-step 4 at the latest
    deadline = time.monotonic() + 600
    while len(_rows(out / "metrics.jsonl")) < 3:
        assert proc.poll() is None, (tmp_path / "stderr.log").read_text()[-3000:]
        assert time.monotonic() < deadline, "the run did not reach step 3"
        time.sleep(0.05)
    helpers = _descendants(proc.pid)
    assert helpers, "expected the reward worker(s) as children"
    proc.kill()
    proc.wait(timeout=60)
    _, alive = psutil.wait_procs(helpers, timeout=20)
    assert not alive, f"orphans after SIGKILL: {[(p.pid, p.cmdline()[:4]) for p in alive]}"
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_00000002"
    assert len(_rows(out / "metrics.jsonl")) >= 3

    resumed = _run(out, "checkpoint.save_interval=2")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stderr and "dropped" in resumed.stderr
    _same_as_reference(out, reference)
    discarded = _rows(out / "metrics.jsonl.discarded")
    assert discarded and all(r["step"] > 2 for r in discarded)


def test_reward_that_breaks_after_its_check_stops_the_run(tmp_path) -> None:
    out = tmp_path / "run"
    done = _run(out, "reward.reward=tests.rewards._helpers:nan_after_self_check")
    assert done.returncode == 3, done.stderr[-3000:]
    assert "step 1: 100% of the rewards failed (nan=16)" in done.stderr
    assert "reward.max_failed_frac=0.5" in done.stderr
    assert done.stderr.count("failed (nan) on response") == 1  # warned once, with an example
    assert _rows(out / "metrics.jsonl") == []  # nothing was trained on the broken step


def test_reward_failures_are_counted_per_kind(tmp_path) -> None:
    out = tmp_path / "run"
    spec = "reward.reward=tests.rewards._helpers:fails_on_some_targets"
    done = _run(out, spec, "reward.max_failed_frac=1.0", "trainer.max_steps=2", "eval.interval=0")
    assert done.returncode == 0, done.stderr[-3000:]
    rows = _rows(out / "metrics.jsonl")
    assert len(rows) == 2
    for row in rows:
        raised, none = row["reward_fail_raised"], row["reward_fail_none"]
        assert raised + none > 0
        assert row["reward_fail_frac"] == (raised + none) / 16
        for kind in ("nan", "not_a_number", "memory", "timeout", "crash"):
            assert row[f"reward_fail_{kind}"] == 0
    assert done.stderr.count("failed (raised) on response") == 1
    assert done.stderr.count("failed (none) on response") == 1


def test_disk_full_during_a_run(tmp_path) -> None:
    with small_tmpfs(tmp_path / "disk", "72m") as disk:
        out = disk / "run"
        proc = subprocess.Popen(
            _cmd(out, "checkpoint.save_interval=2", "eval.interval=0"),
            cwd=ROOT,
            env=ENV,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        _wait_for(proc, lambda: len(_rows(out / "metrics.jsonl")) >= 1, "step 1")
        ballast = fill(disk, leave_bytes=100 * 1024)  # the checkpoint of step 2 needs ~600 KiB
        _, err = proc.communicate(timeout=600)
        assert proc.returncode == 1, err[-3000:]
        assert f"no space left on the device of {out / 'checkpoints'}" in err
        assert "MiB free" in err and "it needs at least" in err
        assert "Traceback" not in err, err[-3000:]
        assert not list((out / "checkpoints").glob(".tmp-*"))

        ballast.unlink()
        again = _run(out, "checkpoint.save_interval=2", "eval.interval=0")
        assert again.returncode == 0, again.stderr[-3000:]
        assert [r["step"] for r in _rows(out / "metrics.jsonl")] == list(range(1, STEPS + 1))
