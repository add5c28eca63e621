"""A SentencePiece BPE ``.model`` as a Hugging Face tokenizer directory (``tokenizer.json``).

The tiny default trains with ``examples/tiny/countdown_sp.model``; an exported model needs a
tokenizer ``transformers.AutoTokenizer`` loads. Transformers' own SentencePiece conversion
needs ``protobuf`` (not a dependency here), so this builds the ``tokenizers`` pipeline from the
SentencePiece API alone: the BPE vocabulary is the pieces, the merges are every split of a
piece into two pieces, ranked by the piece's id (SentencePiece ranks BPE pieces by merge
order); spaces become ``▁`` and are split off as word prefixes (``Metaspace``, no dummy
prefix), digits are single tokens (``split_digits``). That reproduces the shipped model's ids
exactly; :func:`encoding_mismatches` checks it on given texts, so a model trained with other
options (unigram, dummy prefix) is refused rather than exported wrong. One difference is
kept on purpose: text that spells a special token (``</s>``) is that token for Hugging Face
(added special tokens) and plain characters for SentencePiece.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

SPACE = "\u2581"
"""SentencePiece's whitespace symbol."""


def _merges(sp, vocab: dict[str, int]) -> list[tuple[str, str]]:
    ranked = []
    for piece, pid in vocab.items():
        if sp.is_control(pid) or sp.is_unknown(pid) or len(piece) < 2:
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                ranked.append((pid, vocab[left], vocab[right], left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def sentencepiece_to_hf(model_file: str | Path, out_dir: str | Path) -> list[str]:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` for ``model_file`` into
    ``out_dir`` (created); returns the file names written."""
    import sentencepiece as spm
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers

    sp = spm.SentencePieceProcessor(model_file=str(model_file))
    vocab = {sp.id_to_piece(i): i for i in range(sp.get_piece_size())}
    unk = sp.id_to_piece(sp.unk_id())
    tok = Tokenizer(
        models.BPE(vocab=vocab, merges=_merges(sp, vocab), unk_token=unk, fuse_unk=True)
    )
    tok.normalizer = normalizers.Replace(" ", SPACE)
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Metaspace(replacement=SPACE, prepend_scheme="never", split=True),
            pre_tokenizers.Digits(individual_digits=True),
        ]
    )
    tok.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.Fuse()])
    specials = {
        name: sp.id_to_piece(i)
        for name, i in (("bos", sp.bos_id()), ("eos", sp.eos_id()), ("pad", sp.pad_id()))
        if i >= 0
    }
    specials["unk"] = unk
    tok.add_special_tokens([AddedToken(t, special=True) for t in specials.values()])
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        **{f"{name}_token": text for name, text in specials.items()},
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return ["tokenizer.json", "tokenizer_config.json"]


def encoding_mismatches(model_file: str | Path, hf_dir: str | Path, texts: Iterable[str]) -> int:
    """How many of ``texts`` the HF tokenizer in ``hf_dir`` encodes to other ids than the
    SentencePiece model (0: the export is faithful on them)."""
    import sentencepiece as spm
    from transformers import AutoTokenizer

    sp = spm.SentencePieceProcessor(model_file=str(model_file))
    hf = AutoTokenizer.from_pretrained(str(hf_dir), local_files_only=True)
    return sum(sp.encode(t) != hf.encode(t, add_special_tokens=False) for t in texts)
