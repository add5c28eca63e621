"""The shipped SentencePiece tokenizer converted for Hugging Face gives the same ids, and a
model the conversion cannot reproduce is detected (so ``reco-export`` refuses it)."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="AutoTokenizer loads the converted tokenizer")

from reco_megatron.data.countdown import generate
from reco_megatron.data.hf_tokenizer import encoding_mismatches, sentencepiece_to_hf

SP_MODEL = Path(__file__).resolve().parents[2] / "examples" / "tiny" / "countdown_sp.model"


def _texts() -> list[str]:
    texts = ["", " ", "  two  spaces ", "a\tb", "Ünïcode ✓", "12345 + 678"]
    for p in generate(80, seed=3, max_number=12):  # other numbers than the training corpus
        texts += [p.prompt, p.prompt + "\n", p.gold, "Answer: " + " ".join(p.solutions)]
    return texts


def test_shipped_model_converts_exactly(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    assert sentencepiece_to_hf(SP_MODEL, tmp_path) == ["tokenizer.json", "tokenizer_config.json"]
    assert encoding_mismatches(SP_MODEL, tmp_path, _texts()) == 0
    hf = AutoTokenizer.from_pretrained(tmp_path)
    assert (hf.eos_token, hf.pad_token, hf.unk_token) == ("</s>", "<pad>", "<unk>")
    ids = hf.encode("Answer: (3+4)*5", add_special_tokens=False)
    assert hf.decode(ids) == "Answer: (3+4)*5"


def test_a_model_it_cannot_reproduce_is_detected(tmp_path: Path) -> None:
    import sentencepiece as spm

    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(  # unigram with a dummy prefix: not what the converter builds
        sentence_iterator=iter(_texts()[6:200]),
        model_writer=buf,
        model_type="unigram",
        vocab_size=60,
        num_threads=1,
        minloglevel=2,
    )
    model = tmp_path / "other.model"
    model.write_bytes(buf.getvalue())
    sentencepiece_to_hf(model, tmp_path / "hf")
    assert encoding_mismatches(model, tmp_path / "hf", _texts()[6:40]) > 0
