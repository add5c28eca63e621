"""Tokenizers: the shipped countdown SentencePiece model, reproducible training, HF wrapper."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from reco_megatron.data.chat import PromptFormatter
from reco_megatron.data.countdown import generate
from reco_megatron.data.tokenizer import (
    HFTokenizer,
    SentencePieceTokenizer,
    Tokenizer,
    chat_template_of,
)

ROOT = Path(__file__).resolve().parents[2]
SP_MODEL = ROOT / "examples" / "tiny" / "countdown_sp.model"
SCRIPT = ROOT / "examples" / "tiny" / "train_tokenizer.py"


def test_shipped_model_round_trips_task_text() -> None:
    tok = SentencePieceTokenizer(SP_MODEL)
    assert isinstance(tok, Tokenizer)
    assert SP_MODEL.stat().st_size < 16_000
    assert (tok.vocab_size, tok.pad_id, tok.eos_id) == (128, 0, 3)
    unk = tok.sp.unk_id()
    for problem in generate(25, seed=2024):  # not the training seed
        for text in (problem.prompt, problem.gold, *(f"Answer: {s}" for s in problem.solutions)):
            ids = tok.encode(text)
            assert unk not in ids, text
            assert tok.decode(ids) == text
    assert len(tok.encode(problem.prompt)) < len(problem.prompt) / 2


def test_training_script_reproduces_the_shipped_model(tmp_path: Path) -> None:
    out = tmp_path / "sp.model"
    subprocess.run([sys.executable, str(SCRIPT), "--out", str(out)], check=True, timeout=120)
    assert out.read_bytes() == SP_MODEL.read_bytes()


def test_missing_model_file_is_explained(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"train_tokenizer\.py"):
        SentencePieceTokenizer(tmp_path / "nope.model")


class _FakeHF:
    """Stands in for a transformers tokenizer (not installed in CI)."""

    eos_token_id = 2
    pad_token_id = None
    name_or_path = "fake"
    chat_template = "{% for m in messages %}...{% endfor %}"

    def __len__(self) -> int:
        return 10

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        assert add_special_tokens is False
        return [ord(c) % 10 for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(str(i) for i in ids)

    def apply_chat_template(self, messages: list, tokenize: bool, add_generation_prompt: bool):
        assert tokenize is False and add_generation_prompt is True
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"


def test_hf_wrapper_and_chat_template() -> None:
    tok = HFTokenizer(_FakeHF())
    assert isinstance(tok, Tokenizer)
    assert (tok.eos_id, tok.pad_id, tok.vocab_size) == (2, 2, 10)  # pad falls back to eos
    assert tok.decode(tok.encode("ab")) == "78"
    fmt = PromptFormatter(tokenizer=tok, system="Be brief.")
    assert fmt.uses_chat_template
    assert fmt.format("2+2?") == "<system>Be brief.<user>2+2?<assistant>"
    no_template = _FakeHF()
    no_template.chat_template = None  # type: ignore[assignment]
    assert chat_template_of(HFTokenizer(no_template)) is None


def test_plain_template_without_chat_support() -> None:
    sp = SentencePieceTokenizer(SP_MODEL)
    fmt = PromptFormatter(tokenizer=sp, template="Q: {prompt}\nA:")
    assert not fmt.uses_chat_template
    assert fmt.format("use {braces} {prompt}") == "Q: use {braces} {prompt}\nA:"
    with pytest.raises(ValueError, match="exactly once"):
        PromptFormatter(template="no placeholder")


@pytest.mark.skipif(
    importlib.util.find_spec("transformers") is not None, reason="transformers is installed"
)
def test_hf_path_without_transformers_says_what_to_install() -> None:
    with pytest.raises(ImportError, match="pip install transformers"):
        HFTokenizer("/some/local/tokenizer")
