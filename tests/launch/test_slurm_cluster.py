"""``sbatch slurm/reco_tiny.sh`` on a real one-node Slurm cluster on localhost.

This test changes the system: its fixture runs ``.ci/slurm_up.sh``, which installs slurm-wlm
and munge with apt-get when absent, writes ``/etc/slurm/slurm.conf`` and a munge key, and
starts munged, slurmctld and slurmd (it stops the daemons it started). So it runs only on
explicit opt-in, ``RECO_TEST_SYSTEM_CHANGES=1`` (``.ci/run`` sets it); otherwise it skips
with the reason. Opted in, it skips when not root or Slurm cannot be installed; under
``CI=true`` those are failures instead.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.tiny_overrides import TINY_RUN

ROOT = Path(__file__).resolve().parents[2]
IN_CI = os.environ.get("CI", "").lower() == "true"
OPT_IN = "RECO_TEST_SYSTEM_CHANGES"
"""Set to 1 to let tests install packages, write system files and start daemons."""
TINY = [*TINY_RUN, "trainer.max_steps=2", "sft.steps=2"]

pytestmark = pytest.mark.slurm


def _unavailable(reason: str) -> None:
    if IN_CI:
        pytest.fail(f"CI=true but the Slurm cluster is unavailable: {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def slurm_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    if os.environ.get(OPT_IN) != "1":
        pytest.skip(
            f"installs slurm-wlm/munge, writes /etc/slurm and starts daemons: set {OPT_IN}=1 "
            "to allow it (.ci/run does)"
        )
    if os.geteuid() != 0:
        _unavailable("needs root to start munged/slurmctld/slurmd")
    state = tmp_path_factory.mktemp("slurm-state")
    env = {**os.environ, "STATE_DIR": str(state)}
    up = subprocess.run(
        ["bash", str(ROOT / ".ci/slurm_up.sh")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if up.returncode == 77:
        _unavailable(up.stderr.strip())
    assert up.returncode == 0, up.stdout + up.stderr
    started = "already up" not in up.stdout
    yield state
    if started:
        subprocess.run(["bash", str(ROOT / ".ci/slurm_down.sh")], env=env, timeout=60)


def _job_state(job_id: str) -> str:
    out = subprocess.run(
        ["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True
    ).stdout
    for field in out.split():
        if field.startswith("JobState="):
            return field.split("=", 1)[1]
    return "UNKNOWN"


def test_sbatch_tiny_completes(slurm_cluster: Path, tmp_path: Path) -> None:
    out_dir = tmp_path / "run"
    log = tmp_path / "job.out"
    env = {
        **os.environ,
        "PYTHON": sys.executable,
        "PYTHONPATH": str(ROOT),
        "OUTPUT_DIR": str(out_dir),
    }
    sub = subprocess.run(
        ["sbatch", "--parsable", f"--output={log}", "slurm/reco_tiny.sh", *TINY],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert sub.returncode == 0, sub.stderr
    job_id = sub.stdout.strip().split(";")[0]
    deadline = time.monotonic() + 420
    state = _job_state(job_id)
    while state in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "UNKNOWN"):
        if time.monotonic() > deadline:
            subprocess.run(["scancel", job_id])
            pytest.fail(f"job {job_id} still {state} after 420 s; log:\n{log.read_text()}")
        time.sleep(2)
        state = _job_state(job_id)
    text = log.read_text() if log.exists() else "(no log)"
    assert state == "COMPLETED", f"job {job_id} ended {state}; log:\n{text[-4000:]}"
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    assert rows, "metrics.jsonl is empty"
    assert (out_dir / "checkpoints" / "latest").exists()
    assert list((out_dir / "checkpoints").glob("step_*"))
    assert "layout: TP=1 PP=1 CP=1 DP=1 WORLD=1" in text
