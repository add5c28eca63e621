"""The tools pointed at a ``reco-train`` run directory, as a new user would: ``reco-export``
writes a folder that ``AutoTokenizer`` + ``AutoModelForCausalLM`` load and generate with (the
tokenizer found from the run's config), and ``reco-eval RUN_DIR`` takes tokenizer, reward,
data and lengths from the run's ``config.yaml``."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="the export check and reco-eval need transformers")

from reco_megatron.testing import run_distributed
from tests.tiny_overrides import TINY_RUN

pytestmark = pytest.mark.dist

ROOT = Path(__file__).resolve().parents[2]
SP_MODEL = ROOT / "examples" / "tiny" / "countdown_sp.model"


def _train(rank, world, out: str) -> int:
    from reco_megatron.train import main

    return main(
        [
            "examples/tiny_cpu.yaml",
            *TINY_RUN,
            "sft.steps=2",
            "trainer.max_steps=1",
            f"trainer.output_dir={out}",
        ]
    )


def _export(rank, world, argv: list[str]) -> int:
    from reco_megatron.export import main

    return main(argv)


def _evaluate(rank, world, argv: list[str]) -> int:
    from reco_megatron.evaluate import main

    return main(argv)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("run") / "tiny"
    (code,) = run_distributed(_train, 1, args=(str(out),), timeout=600)
    assert code == 0
    return out


def test_export_loads_with_auto_classes_and_generates(run_dir: Path, tmp_path: Path) -> None:
    import sentencepiece as spm
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "hf"
    (code,) = run_distributed(
        _export, 1, args=([str(run_dir / "checkpoints"), str(out)],), timeout=600
    )
    assert code == 0
    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out)
    sp = spm.SentencePieceProcessor(model_file=str(SP_MODEL))
    prompts = [json.loads(line)["prompt"] for line in (run_dir / "data/eval.jsonl").open()]
    for text in prompts:  # the ids the model was trained on
        assert tok.encode(text, add_special_tokens=False) == sp.encode(text)
    assert tok.eos_token_id == sp.eos_id() and model.generation_config.eos_token_id == sp.eos_id()
    ids = tok(prompts[0], return_tensors="pt", add_special_tokens=False).input_ids
    with torch.no_grad():
        new = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert new.shape[1] > ids.shape[1]
    assert isinstance(tok.decode(new[0, ids.shape[1] :]), str)


def test_export_leaves_a_sibling_tmp_folder_alone(run_dir: Path, tmp_path: Path) -> None:
    """Before: ``reco-export ... OUT`` removed ``.tmp-OUT`` beside it and all it held."""
    sibling = tmp_path / ".tmp-hf"
    sibling.mkdir()
    (sibling / "keep.txt").write_text("mine")
    out = tmp_path / "hf"
    (code,) = run_distributed(
        _export, 1, args=([str(run_dir / "checkpoints"), str(out)],), timeout=600
    )
    assert code == 0 and (out / "config.json").is_file()
    assert (sibling / "keep.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".tmp-hf", "hf"]


def test_export_refuses_a_non_empty_folder_naming_the_flag(
    run_dir: Path, tmp_path: Path, caplog
) -> None:
    out = tmp_path / "hf"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    from reco_megatron.export import main

    package = logging.getLogger("reco_megatron")  # it does not propagate to the root logger
    package.addHandler(caplog.handler)
    try:  # refused before any model is built, so it can run in-process
        assert main([str(run_dir / "checkpoints"), str(out)]) == 2
    finally:
        package.removeHandler(caplog.handler)
    assert "exists and is not empty: pass --overwrite to replace it" in caplog.text
    assert "overwrite=True" not in caplog.text
    assert (out / "keep.txt").exists()


def test_reco_eval_takes_everything_from_the_run(run_dir: Path) -> None:
    argv = [str(run_dir), "--n", "2", "--kmax", "2", "--limit", "2", "--no-progress"]
    (code,) = run_distributed(_evaluate, 1, args=([*argv, "--reward-workers", "1"],), timeout=600)
    assert code == 0
    (entry,) = json.loads((run_dir / "reco-eval" / "passk.json").read_text())["checkpoints"]
    assert entry["protocol"]["reward"] == "countdown"
    assert entry["protocol"]["max_new_tokens"] == 8  # rollout.max_new_tokens of the run
    assert entry["protocol"]["data"] == str(run_dir / "data" / "eval.jsonl")
    assert [p["n"] for p in entry["problems"]] == [2, 2]


def test_base_and_trained_in_one_reco_eval_call(run_dir: Path, tmp_path: Path) -> None:
    """The command the end-of-run summary prints: the step-0 checkpoint (the end of the SFT
    warm-up, kept by every keep_last) against the run's latest, one table and one plot."""
    assert (run_dir / "checkpoints" / "step_00000000" / "meta.json").exists()
    out = tmp_path / "compare"
    argv = [
        f"base={run_dir / 'checkpoints' / 'step_00000000'}",
        f"trained={run_dir}",
        *("--n", "2", "--kmax", "2", "--limit", "2", "--no-progress", "--reward-workers", "1"),
        *("--out", str(out)),
    ]
    (code,) = run_distributed(_evaluate, 1, args=(argv,), timeout=600)
    assert code == 0
    entries = json.loads((out / "passk.json").read_text())["checkpoints"]
    assert [e["label"] for e in entries] == ["base", "trained"]
    assert (out / "passk.png").exists() and "| trained |" in (out / "passk.md").read_text()


def test_resume_with_nothing_left_and_output_modes(run_dir: Path) -> None:
    """A finished run started again: "nothing to do", no empty progress bar; the resolved
    config.yaml has the mode of the run's other files (it was 0600)."""
    import os
    import stat
    import subprocess
    import sys

    modes = {
        stat.S_IMODE((run_dir / name).stat().st_mode) for name in ("config.yaml", "metrics.jsonl")
    }
    assert len(modes) == 1 and modes.pop() & 0o044 == 0o044  # group/other can read both
    proc = subprocess.run(
        [
            *(sys.executable, "-m", "reco_megatron.train", "examples/tiny_cpu.yaml", *TINY_RUN),
            *("sft.steps=2", "trainer.max_steps=1", "trainer.progress=true"),
            f"trainer.output_dir={run_dir}",
        ],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "nothing to do: the checkpoint is at step 1, trainer.max_steps=1" in proc.stderr
    assert "step/s" not in proc.stderr and "0/1" not in proc.stderr  # no progress bar


def _train_capturing(rank, world, out: str, extra: list[str]) -> tuple[int, str]:
    import io
    import sys

    from reco_megatron.train import main

    sys.stderr = io.StringIO()
    args = [*TINY_RUN, "sft.steps=2", "trainer.max_steps=2", f"trainer.output_dir={out}"]
    code = main(["examples/tiny_cpu.yaml", *args, *extra])
    return code, sys.stderr.getvalue()


def _both(rank, world, out: str, extra: list[str]) -> list[tuple[int, str]]:
    return [
        _train_capturing(rank, world, out, extra),
        _train_capturing(rank, world, out, [*extra, "trainer.allow_config_change=true"]),
    ]


def test_resuming_an_incompatible_checkpoint_exits_2_in_one_line(run_dir: Path) -> None:
    # The resume check names the change before anything is loaded; told to accept changes,
    # the checkpoint itself still refuses weights of another shape. One process for both.
    (results,) = run_distributed(
        _both, 1, args=(str(run_dir), ["model.hidden_size=64"]), timeout=600
    )
    (code, err), (code_allowed, err_allowed) = results
    assert code == code_allowed == 2, (err, err_allowed)
    assert "Traceback" not in err + err_allowed
    (line,) = [x for x in err.splitlines() if x.startswith("reco-train:")]
    assert line.startswith("reco-train: invalid configuration: resuming from step_")
    assert "model.hidden_size: 32 -> 64" in err
    (line,) = [x for x in err_allowed.splitlines() if x.startswith("reco-train:")]
    assert line.startswith("reco-train: unusable checkpoint: checkpoint does not match this run")
    assert "model.hidden_size: checkpoint 32 vs config 64" in err_allowed


def test_export_tokenizer_named_or_found(run_dir: Path, tmp_path: Path, caplog) -> None:
    """Named by --tokenizer, an unusable tokenizer is an error before any model is built;
    found in the run's config, it is skipped with a warning (the weights still export)."""
    from reco_megatron.export import _tokenizer_for, main

    package = logging.getLogger("reco_megatron")
    package.addHandler(caplog.handler)
    try:
        argv = [str(run_dir / "checkpoints"), str(tmp_path / "hf"), "--tokenizer", "nope.model"]
        assert main(argv) == 2
        assert "tokenizer 'nope.model' is neither a tokenizer directory" in caplog.text
        assert not (tmp_path / "hf").exists()
        run = {"data": {"tokenizer": "nope.model"}, "_run_dir": str(run_dir)}
        assert _tokenizer_for(None, run, tmp_path) is None
        assert "exporting without a tokenizer" in caplog.text
    finally:
        package.removeHandler(caplog.handler)
