"""Hostile inputs of the statistics op, shared by the eager and the interpreted Triton tests.

``-inf`` logits (``_vocab_cases.HOSTILE``: scattered, a whole shard at TP 2/4, a first
tile, a target's own logit) with every gradient and ``inplace_backward``, then an
``expand``-ed (stride-0) input with ``inplace_backward``: its rows share memory, so the
gradient must go to a new buffer (it would otherwise be summed over the overwritten rows).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tests.parallel._vocab_cases import (
    CASES,
    HOSTILE,
    expanded_inputs,
    global_inputs,
    reference,
    reference_on,
)

ALL = (True, True, True)
FP32_ATOL = 2e-5


def hostile_body(rank: int, world_size: int, implementation: str):
    """``(minus_inf, expanded)``: each ``(statistics, gradient)`` of this rank, fp64 on CPU."""
    from reco_megatron.parallel import vocab_parallel_stats

    group = dist.group.WORLD if world_size > 1 else None
    chunk = 5 if implementation != "triton" else None
    logits, target, grads = global_inputs(HOSTILE, world_size)
    v_local = logits.shape[1] // world_size
    shard = logits[:, rank * v_local : (rank + 1) * v_local].float().requires_grad_()
    output = shard * 1  # a non-leaf, like the output layer's logits: overwritten in place
    stats = vocab_parallel_stats(
        output, target, HOSTILE.vocab, group, chunk, implementation, inplace_backward=True
    )
    sum((o.double() * g).sum() for o, g in zip(stats, grads, strict=True)).backward()
    minus_inf = ([s.detach().double() for s in stats], shard.grad.double())

    logits, target, grads = expanded_inputs(CASES[3], world_size)
    v_local = logits.shape[1] // world_size
    row = logits[:1, rank * v_local : (rank + 1) * v_local].float().requires_grad_()
    expanded = row.expand(logits.shape[0], row.shape[1])  # every token reads the same memory
    stats = vocab_parallel_stats(
        expanded, target, CASES[3].vocab, group, chunk, implementation, inplace_backward=True
    )
    sum((o.double() * g).sum() for o, g in zip(stats, grads, strict=True)).backward()
    return minus_inf, ([s.detach().double() for s in stats], row.grad.double())


def check_hostile(results, tp: int, atol: float = FP32_ATOL) -> None:
    """Every rank's :func:`hostile_body` result against the fp64 reference. The expanded
    row's gradient sums 40 token gradients: 10x the fp32 tolerance there."""
    ref_outs, ref_grad = reference(HOSTILE, tp, torch.float32, ALL)
    grad = torch.cat([r[0][1] for r in results], dim=-1)
    assert grad.isfinite().all(), "a -inf logit made the gradient non-finite"
    torch.testing.assert_close(grad, ref_grad, atol=atol, rtol=0)
    logits, target, grads = expanded_inputs(CASES[3], tp)
    exp_outs, exp_grad = reference_on(logits, target, grads, CASES[3].vocab, ALL)
    row_grad = torch.cat([r[1][1] for r in results], dim=-1)
    torch.testing.assert_close(row_grad, exp_grad.sum(0, keepdim=True), atol=atol * 10, rtol=0)
    for (outs, _), (exp_stats, _) in results:
        for got, want in zip(outs, ref_outs, strict=True):
            torch.testing.assert_close(got, want, atol=atol, rtol=0)  # -inf == -inf passes
        for got, want in zip(exp_stats, exp_outs, strict=True):
            torch.testing.assert_close(got, want, atol=atol, rtol=0)
