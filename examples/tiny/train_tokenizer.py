"""Train the tiny SentencePiece tokenizer of the synthetic countdown task.

Run (CPU, about a second)::

    python examples/tiny/train_tokenizer.py                 # -> examples/tiny/countdown_sp.model
    python examples/tiny/train_tokenizer.py --out /tmp/sp.model --vocab-size 96

The corpus is generated, not downloaded: countdown prompts, answer lines ("Answer: <expr>")
and gold strings from :mod:`reco_megatron.data.countdown` with a fixed seed. The model is a
BPE over that text with identity normalisation (spaces are kept exactly, so decode(encode(x))
== x for any single-line text over the task's characters), ids pad=0 unk=1 bos=2 eos=3, and a
single training thread, so re-running the script writes an identical model.
"""

from __future__ import annotations

import argparse
import io
from pathlib import Path

from reco_megatron.data.countdown import generate

DEFAULT_OUT = Path(__file__).resolve().parent / "countdown_sp.model"


def corpus(n_problems: int = 400, seed: int = 1234) -> list[str]:
    """Task text: prompts, ``Answer: <expr>`` lines for every solution, gold strings."""
    lines: list[str] = []
    for problem in generate(n_problems, seed=seed):
        lines.append(problem.prompt)
        lines.append(problem.gold)
        lines.extend(f"Answer: {s}" for s in problem.solutions)
    # Every character the task can produce, so nothing maps to <unk>.
    lines.append("0123456789 +-*()=[],.:' ")
    return lines


def train(vocab_size: int = 128, n_problems: int = 400, seed: int = 1234) -> bytes:
    """Serialized SentencePiece model trained on :func:`corpus`."""
    import sentencepiece as spm

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus(n_problems, seed)),
        model_writer=model,
        model_type="bpe",
        vocab_size=vocab_size,
        character_coverage=1.0,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=False,
        split_digits=True,
        pad_id=0,
        unk_id=1,
        bos_id=2,
        eos_id=3,
        num_threads=1,
        minloglevel=2,
    )
    return model.getvalue()


def main() -> None:
    ap = argparse.ArgumentParser(description="train the countdown SentencePiece tokenizer")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--vocab-size", type=int, default=128)
    ap.add_argument("--n-problems", type=int, default=400)
    ap.add_argument("--seed", type=int, default=1234)
    args = ap.parse_args()
    args.out.write_bytes(train(args.vocab_size, args.n_problems, args.seed))


if __name__ == "__main__":
    main()
