"""``reco-eval`` end to end on a tiny random HF Llama with the shipped SentencePiece tokenizer,
and its errors on bad inputs (exit status 2 and a message naming the problem)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="the embedded engine needs transformers")

from reco_megatron.data.countdown import generate, to_record
from reco_megatron.evaluate import main, parse_checkpoint

ROOT = Path(__file__).resolve().parents[2]
SP_MODEL = ROOT / "examples" / "tiny" / "countdown_sp.model"


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from reco_megatron.data.tokenizer import SentencePieceTokenizer

    tok = SentencePieceTokenizer(SP_MODEL)
    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=128,
        eos_token_id=tok.eos_id,
        pad_token_id=tok.pad_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)
    out = tmp_path_factory.mktemp("hf") / "tiny"
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    problems = generate(3, seed=0, n_numbers=3, max_number=6, target_range=(5, 20))
    path = tmp_path_factory.mktemp("data") / "eval.jsonl"
    path.write_text(
        "".join(json.dumps(to_record(p, i, "eval")) + "\n" for i, p in enumerate(problems))
    )
    return path


def _args(ckpts, data, out, *extra):
    return [
        *ckpts, "--data", str(data), "--tokenizer", str(SP_MODEL), "--reward", "countdown",
        "--reward-workers", "1", "--n", "4", "--kmax", "4", "--max-new-tokens", "8",
        "--out", str(out), "--no-progress", *extra,
    ]  # fmt: skip


def test_end_to_end_two_checkpoints(hf_dir, data, tmp_path, capsys) -> None:
    out = tmp_path / "eval"
    assert main(_args([f"a={hf_dir}", f"b={hf_dir}"], data, out)) == 0
    table = json.loads((out / "passk.json").read_text())["checkpoints"]
    assert [e["label"] for e in table] == ["a", "b"]
    for entry in table:
        assert set(entry["summary"]) >= {"pass@1", "pass@2", "pass@4", "rare_correct_frac"}
        assert [p["n"] for p in entry["problems"]] == [4, 4, 4]
        assert entry["protocol"]["temperature"] == 0.6
    # Same checkpoint, same per-problem seeds: identical counts.
    assert table[0]["problems"] == table[1]["problems"]
    assert (out / "passk.md").read_text().startswith("| checkpoint | pass@1")
    assert (out / "passk.png").stat().st_size > 1000
    assert "| a |" in capsys.readouterr().out


def test_missing_checkpoint(data, tmp_path, caplog) -> None:
    with caplog.at_level(logging.ERROR):
        assert main(_args([str(tmp_path / "nope")], data, tmp_path / "o")) == 2
    assert "does not exist" in caplog.text


def test_not_a_checkpoint(data, tmp_path, caplog) -> None:
    (tmp_path / "empty").mkdir()
    with caplog.at_level(logging.ERROR):
        assert main(_args([str(tmp_path / "empty")], data, tmp_path / "o")) == 2
    assert "neither a Hugging Face model directory" in caplog.text


def test_empty_dataset(hf_dir, tmp_path, caplog) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with caplog.at_level(logging.ERROR):
        assert main(_args([str(hf_dir)], empty, tmp_path / "o")) == 2
    assert "no valid rows" in caplog.text


def test_kmax_above_n(hf_dir, data, tmp_path, caplog) -> None:
    with caplog.at_level(logging.ERROR):
        assert main(_args([str(hf_dir)], data, tmp_path / "o", "--kmax", "8")) == 2
    assert "kmax=8 > n=4" in caplog.text


def test_parse_checkpoint() -> None:
    assert parse_checkpoint("reco=runs/x/checkpoints") == ("reco", "runs/x/checkpoints")
    assert parse_checkpoint("runs/x/checkpoints/") == ("x/checkpoints", "runs/x/checkpoints/")


def test_positional_typo_first_and_nothing_created(tmp_path, caplog) -> None:
    """``reco-eval runs/tiny_cpuu``: the typo is the first and only error (not "--data is
    required"), with the directory meant; no output folder appears."""
    runs = tmp_path / "runs"
    (runs / "tiny_cpu" / "checkpoints").mkdir(parents=True)
    with caplog.at_level(logging.ERROR):
        assert main([str(runs / "tiny_cpuu")]) == 2
    assert "checkpoint" in caplog.text and "does not exist" in caplog.text
    assert f"did you mean {str(runs / 'tiny_cpu')!r}" in caplog.text
    assert "--data" not in caplog.text
    assert sorted(p.name for p in runs.iterdir()) == ["tiny_cpu"]


def test_bad_data_leaves_no_output_folder(hf_dir, tmp_path, caplog) -> None:
    out = tmp_path / "o"
    with caplog.at_level(logging.ERROR):
        assert main(_args([str(hf_dir)], tmp_path / "missing.jsonl", out)) == 2
    assert "missing.jsonl" in caplog.text and "not a file" in caplog.text
    assert not out.exists()
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert main(_args([str(hf_dir)], empty, out)) == 2  # fails after the folder was made
    assert not out.exists()
