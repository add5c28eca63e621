"""Deterministic inputs for the vocabulary-parallel statistics tests.

Lives in its own module so that ranks forked by ``run_distributed`` and the single-process
reference build bit-identical data from a seed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Case:
    """One test input: ``n_tokens`` positions over a true vocabulary ``vocab``."""

    name: str
    n_tokens: int
    vocab: int
    pad_multiple: int  # megatron pads the vocabulary to a multiple of this times TP
    seed: int = 0
    ignored_every: int = 0  # every k-th target is -1 (ignored position); 0 = none

    def padded_vocab(self, tp: int) -> int:
        step = self.pad_multiple * tp
        return int(math.ceil(self.vocab / step) * step)


CASES = [
    Case("divisible", n_tokens=24, vocab=256, pad_multiple=1),
    Case("padded_128", n_tokens=31, vocab=1000, pad_multiple=128),
    Case("tiny_vocab_empty_shards", n_tokens=9, vocab=129, pad_multiple=128),
    Case("odd_vocab_ignored_targets", n_tokens=40, vocab=257, pad_multiple=1, ignored_every=5),
]


def global_inputs(case: Case, tp: int) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """fp64 padded logits ``[N, V_pad]``, targets ``[N]`` and three upstream gradients ``[N]``.

    Padded columns hold large values: if any statistic included them the results would be
    far off, so the comparison with the true-vocabulary reference proves they are excluded.
    Targets are spread over the whole true vocabulary, so every shard owns some.
    """
    gen = torch.Generator().manual_seed(case.seed)
    v_pad = case.padded_vocab(tp)
    logits = torch.randn(case.n_tokens, v_pad, generator=gen, dtype=torch.float64) * 3.0
    logits[:, case.vocab :] = 40.0
    target = torch.linspace(0, case.vocab - 1, case.n_tokens).round().long()
    target = target[torch.randperm(case.n_tokens, generator=gen)]
    if case.ignored_every:
        target[:: case.ignored_every] = -1
    grads = [torch.randn(case.n_tokens, generator=gen, dtype=torch.float64) for _ in range(3)]
    return logits, target, grads
