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
    hostile: bool = False  # -inf logits: see global_inputs

    def padded_vocab(self, tp: int) -> int:
        step = self.pad_multiple * tp
        return int(math.ceil(self.vocab / step) * step)


CASES = [
    Case("divisible", n_tokens=24, vocab=256, pad_multiple=1),
    Case("padded_128", n_tokens=31, vocab=1000, pad_multiple=128),
    Case("tiny_vocab_empty_shards", n_tokens=9, vocab=129, pad_multiple=128),
    Case("odd_vocab_ignored_targets", n_tokens=40, vocab=257, pad_multiple=1, ignored_every=5),
]
HOSTILE = Case("minus_inf", n_tokens=12, vocab=300, pad_multiple=64, seed=4, hostile=True)
"""-inf logits (masked vocabulary entries) everywhere the kernels could trip on them."""
MASKED_EVERY = 7
FIRST_TILE = 256


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
    if case.hostile:
        _mask(logits, target, case, v_pad)
    grads = [torch.randn(case.n_tokens, generator=gen, dtype=torch.float64) for _ in range(3)]
    return logits, target, grads


def _mask(logits: torch.Tensor, target: torch.Tensor, case: Case, v_pad: int) -> None:
    """-inf in place: every 7th column of every row (targets moved off them); row 1's columns
    from ``v_pad / 2`` on (at TP 2 all of rank 1's real columns, at TP 4 ranks 2-3: whole
    shards); row 2's first 256 columns (the first loop iteration of the interpreted tests'
    fp32 tiles, at TP 2 and 4 whole shards); row 3's target column (log p = -inf);
    row 4 is also an ignored position."""
    ninf = float("-inf")
    logits[:, 3 : case.vocab : MASKED_EVERY] = ninf
    on_mask = (target >= 0) & (target % MASKED_EVERY == 3)
    target[on_mask] += 1
    logits[1, v_pad // 2 : case.vocab] = ninf
    target[1] = int(target[1]) % (v_pad // 2 - 10)
    logits[2, :FIRST_TILE] = ninf
    target[2] = FIRST_TILE + int(target[2]) % (case.vocab - FIRST_TILE)
    target[2] += int(target[2] % MASKED_EVERY == 3)
    logits[3, int(target[3])] = ninf
    target[4] = -1
    logits[4, : case.vocab : 2] = ninf


def reference(case: Case, tp: int, dtype: torch.dtype, use: tuple[bool, bool, bool]):
    """fp64 single-process statistics and gradient of ``sum(stat * upstream)`` over the used
    statistics, on the unpadded logits rounded to ``dtype`` (what the op sees).

    Returns ``([logprob, entropy, sum_p2] each [N], grad [N, V_pad])``, padded columns 0.
    ``-inf`` logits get a zero gradient, except a ``-inf`` target's own column, where
    ``d log p_t / d z_t = 1 - p_t = 1``.
    """
    logits, target, grads = global_inputs(case, tp)
    return reference_on(logits.to(dtype).double(), target, grads, case.vocab, use)


def expanded_inputs(case: Case, tp: int):
    """Row 0 of ``case``'s logits repeated for every token (what ``expand`` gives, stride 0),
    with the case's targets and upstream gradients."""
    logits, target, grads = global_inputs(case, tp)
    return logits[:1].expand_as(logits).clone(), target, grads


def reference_on(logits, target, grads, vocab: int, use: tuple[bool, bool, bool]):
    """:func:`reference` of given fp64 padded logits ``[N, V_pad]``."""
    exact = logits[:, :vocab]
    # A -inf logit is a column that is not there: in fp64, -1e4 is the same (exp(-1e4 - m)
    # is exactly 0 and so is its gradient), except for log p of a -inf target, -inf below.
    minus_inf = exact == float("-inf")
    exact = exact.masked_fill(minus_inf, -1e4).requires_grad_()
    safe = target.clamp(min=0)
    stats = token_stats_reference(exact, safe)
    logprob = torch.where(target < 0, torch.zeros_like(stats.logprob), stats.logprob)
    target_masked = minus_inf.gather(-1, safe.unsqueeze(-1)).squeeze(-1) & (target >= 0)
    outs = (logprob, stats.entropy, stats.sum_p2)
    total = sum((o * g).sum() for o, g, u in zip(outs, grads, use, strict=True) if u)
    total.backward()
    grad = torch.zeros_like(logits)
    grad[:, :vocab] = exact.grad
    outs = (logprob.detach().masked_fill(target_masked, float("-inf")), *outs[1:])
    return [o.detach() for o in outs], grad
