"""Deterministic inputs for the vocabulary-parallel statistics tests.

Lives in its own module so that ranks forked by ``run_distributed`` and the single-process
reference build bit-identical data from a seed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from reco_megatron.algo.token_stats import token_stats_reference


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


def reference(case: Case, tp: int, dtype: torch.dtype, use: tuple[bool, bool, bool]):
    """fp64 single-process statistics and gradient of ``sum(stat * upstream)`` over the used
    statistics, on the unpadded logits rounded to ``dtype`` (what the op sees).

    Returns ``([logprob, entropy, sum_p2] each [N], grad [N, V_pad])``, padded columns 0.
    """
    logits, target, grads = global_inputs(case, tp)
    exact = logits.to(dtype).double()[:, : case.vocab].clone().requires_grad_()
    safe = target.clamp(min=0)
    stats = token_stats_reference(exact, safe)
    logprob = torch.where(target < 0, torch.zeros_like(stats.logprob), stats.logprob)
    outs = (logprob, stats.entropy, stats.sum_p2)
    total = sum((o * g).sum() for o, g, u in zip(outs, grads, use, strict=True) if u)
    total.backward()
    grad = torch.zeros_like(logits)
    grad[:, : case.vocab] = exact.grad
    return [o.detach() for o in outs], grad
