"""``reco-train --nproc-per-node N``: N local ranks that answer like one process (exit status,
one message for a bad config, a signal delivered once, a crashed rank stops the others)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from reco_megatron import launcher

ROOT = Path(__file__).resolve().parents[2]


def test_split_nproc() -> None:
    assert launcher.split_nproc(["a.yaml", "x=1"]) == (None, ["a.yaml", "x=1"])
    assert launcher.split_nproc(["--nproc-per-node", "2", "a.yaml"]) == (2, ["a.yaml"])
    assert launcher.split_nproc(["a.yaml", "--nproc-per-node=4"]) == (4, ["a.yaml"])
    for bad in (["--nproc-per-node"], ["--nproc-per-node", "0"], ["--nproc-per-node=x"]):
        with pytest.raises(ValueError, match="--nproc-per-node needs a number"):
            launcher.split_nproc(bad)


def test_rank_env() -> None:
    env = launcher.rank_env(1, 2, 12345, {"OMP_NUM_THREADS": "3"})
    assert env["RANK"] == env["LOCAL_RANK"] == "1" and env["WORLD_SIZE"] == "2"
    assert env["MASTER_PORT"] == "12345" and env["OMP_NUM_THREADS"] == "3"


def _train(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "reco_megatron.train", "--nproc-per-node", "2", *args],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_bad_layout_is_one_line_and_exit_2_before_any_rank_starts() -> None:
    res = _train("examples/tiny_cpu.yaml", "parallel.tensor_model_parallel_size=3")
    assert res.returncode == 2, res.stderr
    assert res.stderr.splitlines() == [
        "reco-train: invalid configuration: world size 2 is not divisible by TP x PP x CP = "
        "3 x 1 x 1 = 3: change the number of processes (nodes x GPUs per node) or the parallel "
        "block"
    ]


@pytest.mark.dist
def test_a_config_error_found_by_the_ranks_is_one_line_and_exit_2(tmp_path: Path) -> None:
    res = _train(
        "examples/tiny_cpu.yaml",
        f"data.tokenizer={tmp_path / 'missing.model'}",
        f"trainer.output_dir={tmp_path / 'run'}",
    )
    assert res.returncode == 2, res.stderr
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("reco-train: invalid configuration: data.")
    assert "Traceback" not in res.stderr and "ChildFailedError" not in res.stderr


def test_a_crashed_rank_stops_the_others(monkeypatch, capsys) -> None:
    monkeypatch.setattr(launcher, "GRACE_S", 0.5)
    crash = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(1)"])
    stuck = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    start = time.monotonic()
    assert launcher._wait([crash, stuck]) == 1
    assert time.monotonic() - start < 60 and stuck.returncode is not None
    err = capsys.readouterr().err
    assert err.startswith("reco-train: rank 0 exited with status 1") and "other ranks" in err


def test_same_answer_from_every_rank_is_the_answer(capsys) -> None:
    procs = [subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(75)"]) for _ in range(2)]
    assert launcher._wait(procs) == 75
    assert capsys.readouterr().err == ""


SIGCOUNT = """
import signal, sys, time
count = 0
def on(signum, frame):
    global count
    count += 1
signal.signal(signal.SIGINT, on)
__import__("os").write(1, b"ready\\n")  # one write: print() makes two when unbuffered
time.sleep(3)
open(sys.argv[1] + "." + __import__("os").environ["RANK"], "w").write(str(count))
"""


def test_a_signal_reaches_every_rank_once(tmp_path: Path) -> None:
    (tmp_path / "sigcount.py").write_text(SIGCOUNT)
    code = (
        "import sys; from reco_megatron.launcher import launch; "
        f"sys.exit(launch(2, [{str(tmp_path / 'count')!r}], module='sigcount'))"
    )
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{tmp_path}"}
    parent = subprocess.Popen(
        [sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True
    )
    for _ in range(2):
        assert parent.stdout.readline().strip() == "ready"
    parent.send_signal(signal.SIGINT)
    assert parent.wait(timeout=60) == 0
    assert [(tmp_path / f"count.{r}").read_text() for r in range(2)] == ["1", "1"]
