"""A configuration that cannot run is refused before any compute: exit 2, one message per
problem (no traceback), printed once, and no output directory left behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from reco_megatron.train import main

ROOT = Path(__file__).resolve().parents[2]
TRAIN = (sys.executable, "-m", "reco_megatron.train", "examples/tiny_cpu.yaml")
GOOD_ROW = {"prompt": "Use 2 3 4 to make 9.", "answer": "9", "id": "a"}


def _refused(tmp_path: Path, capsys, overrides: list[str]) -> str:
    """Run ``main`` in-process; assert exit 2, no output dir; return the one stderr message."""
    out = tmp_path / "run"
    code = main(["examples/tiny_cpu.yaml", f"trainer.output_dir={out}", *overrides])
    err = capsys.readouterr().err
    assert code == 2, err
    assert not out.exists(), "an output directory was left behind"
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("reco-train:")]
    assert len(lines) == 1, err
    return err


def _jsonl(path: Path, rows: list[object]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


@pytest.mark.parametrize(
    ("overrides", "world", "expected"),
    [
        (["parallel.tensor_model_parallel_size=2"], "1", "world size 1 is not divisible by TP"),
        (
            ["parallel.tensor_model_parallel_size=4"],
            "4",
            "num_query_groups=2 (key/value heads) is not divisible by tensor_model_parallel_size=4",
        ),
        (["parallel.pipeline_model_parallel_size=3"], "3", "num_layers=4 is not divisible by PP"),
        (["rollout.prompts_per_step=6"], "2", "rollout.prompts_per_step=6 must be a multiple of"),
        (["parallel.micro_batch_size=3", "sft.steps=0"], "1", "parallel.micro_batch_size=3 must"),
        (["sft.batch_size=30"], "1", "sft.batch_size=30 must be a multiple of"),
        (
            ["update.max_tokens_per_microbatch=96"],  # tiny_cpu: prompts 80 + responses 24
            "1",
            "update.max_tokens_per_microbatch=96 is below the longest sequence: "
            "rollout.max_prompt_len + max_new_tokens - 1 = 103, rounded up to a multiple of 16 "
            "= 112: set it to at least 112",
        ),
        (
            ["update.sequence_packing=true"],
            "1",
            "update.sequence_packing=true needs update.max_tokens_per_microbatch",
        ),
        (["model.vocab_size=64"], "1", "model.vocab_size=64 is smaller than the tokenizer's 128"),
        (["data.tokenizer=nope/missing.model"], "1", "data.tokenizer='nope/missing.model'"),
        (["data.train_path=nope.jsonl"], "1", "data.train_path='nope.jsonl' does not exist"),
        (["checkpoint.init_megatron=nope"], "1", "checkpoint.init_megatron='nope' does not exist"),
        (["reward.reward=no_such_module_x:fn"], "1", "'no_such_module_x' cannot be imported"),
        (["rollout.group_size=1"], "1", "group_size must be >= 2, got 1"),
        (["trainer.max_steps=-1"], "1", "max_steps must be an integer >= 0, got -1"),
        (["checkpoint.save_interval=-2"], "1", "save_interval must be an integer >= 0, got -2"),
        # sanity ranges: accepted before, and lr=1e9 destroyed the model with exit 0
        (["optimizer.lr=1e9"], "1", "optimizer.lr=1000000000.0 is outside [0, 0.01]"),
        (["reward.num_workers=5000"], "1", "trainer.allow_out_of_range=[reward.num_workers]"),
    ],
)
def test_refused_before_compute(tmp_path, capsys, monkeypatch, overrides, world, expected) -> None:
    monkeypatch.setenv("WORLD_SIZE", world)  # the checks run before any process group exists
    err = _refused(tmp_path, capsys, overrides)
    assert expected in err


def test_files_the_config_names_are_checked(tmp_path: Path, capsys) -> None:
    bad = _jsonl(tmp_path / "bad.jsonl", [GOOD_ROW, {"prompt": "no answer"}])
    err = _refused(tmp_path, capsys, [f"data.train_path={bad}"])
    assert f"{bad}:2: field 'answer' is missing" in err
    good = _jsonl(tmp_path / "good.jsonl", [GOOD_ROW])
    err = _refused(tmp_path, capsys, [f"data.train_path={good}", "eval.interval=5"])
    assert "eval.interval=5 needs a held-out set: set data.eval_path" in err
    (tmp_path / "not_a_ckpt").mkdir()
    err = _refused(tmp_path, capsys, [f"checkpoint.init_megatron={tmp_path / 'not_a_ckpt'}"])
    assert "is not a reco-megatron checkpoint (no meta.json)" in err
    err = _refused(tmp_path, capsys, [f"checkpoint.init_hf={tmp_path / 'not_a_ckpt'}"])
    assert "holds no config.json" in err


def test_several_problems_are_listed_together(tmp_path: Path, capsys) -> None:
    out = tmp_path / "run"
    args = ["model.vocab_size=64", "data.train_path=nope.jsonl"]
    code = main(["examples/tiny_cpu.yaml", f"trainer.output_dir={out}", *args])
    err = capsys.readouterr().err
    assert code == 2 and not out.exists()
    assert err.startswith("reco-train: invalid configuration (2 problems):\n  - ")


def test_unwritable_output_dir_exits_2(tmp_path: Path, capsys) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    code = main(["examples/tiny_cpu.yaml", f"trainer.output_dir={blocker / 'run'}"])
    err = capsys.readouterr().err
    assert code == 2 and "is not writable" in err and "Traceback" not in err


@pytest.mark.dist
def test_the_issue_repro_in_a_real_process(tmp_path: Path) -> None:
    """``parallel.tensor_model_parallel_size=3`` in one process: exit 2, one message, no
    traceback, no directory (it used to exit 1 with a ``[rank0]:`` traceback)."""
    out = tmp_path / "run"
    proc = subprocess.run(
        [*TRAIN, f"trainer.output_dir={out}", "parallel.tensor_model_parallel_size=3"],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and not out.exists()
    assert proc.stderr.count("reco-train: invalid configuration") == 1
    assert "world size 1 is not divisible by TP x PP x CP = 3 x 1 x 1" in proc.stderr
    # Importing megatron-core on CPU warns (no TE / apex, no CUDA): none of it, raw or as a
    # "known warning" note, comes before the error; the error is all there is.
    assert "warnings.warn(" not in proc.stderr and "UserWarning" not in proc.stderr
    assert "known warning" not in proc.stderr
    assert proc.stderr.startswith("reco-train: invalid configuration (2 problems):\n"), proc.stderr
    assert len(proc.stderr.splitlines()) == 3, proc.stderr


@pytest.mark.dist
def test_torchrun_reports_once(tmp_path: Path) -> None:
    """Two ranks find the same problem; the message is printed once (local rank 0)."""
    out = tmp_path / "run"
    proc = subprocess.run(
        [
            *(sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"),
            *TRAIN[1:],
            f"trainer.output_dir={out}",
            "model.num_query_groups=1",
            "parallel.tensor_model_parallel_size=2",
        ],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode != 0
    assert proc.stderr.count("num_query_groups=1 (key/value heads) is not divisible") == 1
    assert not out.exists()
    assert "known warning" not in proc.stderr  # before an error the notes are dropped


def test_help_starts_with_a_usage_line(capsys) -> None:
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m reco_megatron.train [CONFIG.yaml] [dotted.key=value")
    assert "rollout.group_size" in out


def test_an_out_of_range_value_is_accepted_when_named() -> None:
    from reco_megatron.config import load_config
    from reco_megatron.trainer.config import TrainConfig

    overrides = ["optimizer.lr=0.05", "trainer.allow_out_of_range=[optimizer.lr]"]
    assert load_config(TrainConfig, "examples/tiny_cpu.yaml", overrides).optimizer.lr == 0.05
