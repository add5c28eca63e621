"""``vocab_parallel_linear_loss`` (3 matmuls) against megatron's layer + the op + the loss.

The unfused path is what the engine runs without ``update.fused_output_layer``: megatron's
input mapping (``copy_to_tensor_model_parallel_region``: backward all-reduces the input
gradient; under sequence parallelism an all-gather whose backward reduce-scatters, here
``torch.distributed.nn.functional.all_gather`` since megatron's allocates on CUDA only), then
``F.linear`` with this rank's rows, :func:`vocab_parallel_stats`, and the loss on the
statistics. The loss here is token-separable and uses all three statistics non-linearly.

Tolerances: both paths see the same fp32 inputs; the fused one computes the logits in blocks
of 3 tokens (several blocks, a ragged last one) and does the backward in its forward, so only
summation orders differ: atol 1e-5 on statistics, loss and gradients of order 1-10 (fp32).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from reco_megatron.algo.token_stats import TokenStats
from reco_megatron.parallel import vocab_parallel_stats
from reco_megatron.parallel.linear_loss import vocab_parallel_linear_loss
from reco_megatron.parallel.linear_stats import vocab_parallel_linear_stats
from reco_megatron.testing import run_distributed

ATOL = 1e-5
SEQ, BATCH, HIDDEN, VOCAB, PAD = 8, 2, 16, 250, 64


def _inputs(tp: int):
    gen = torch.Generator().manual_seed(11)
    v_pad = -(-VOCAB // (PAD * tp)) * PAD * tp
    hidden = torch.randn(SEQ, BATCH, HIDDEN, generator=gen)
    weight = torch.randn(v_pad, HIDDEN, generator=gen) * 0.5
    target = torch.randint(0, VOCAB, (SEQ, BATCH), generator=gen)
    target[::3, 0] = -1
    coef = torch.randn(4, SEQ * BATCH, generator=gen)
    return hidden, weight, target, coef


def _loss_fn(coef: torch.Tensor):
    """A token-separable loss of ``[N]`` statistics (the flattened ``[S, B]``)."""

    def loss(stats: TokenStats) -> torch.Tensor:
        logprob, entropy, sum_p2 = (s.reshape(-1) for s in stats)
        per_token = coef[0] * logprob + coef[1] * entropy + coef[2] * sum_p2.square()
        return (per_token + coef[3] * logprob.exp()).sum()

    return loss


def _body(rank: int, world_size: int, sequence_parallel: bool):
    import torch.distributed.nn.functional as dist_fn
    from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

    hidden, weight, target, coef = _inputs(world_size)
    group = dist.group.WORLD if world_size > 1 else None
    rows = weight.shape[0] // world_size
    w_shard = weight[rank * rows : (rank + 1) * rows]
    s_local = SEQ // world_size
    h_local = hidden[rank * s_local : (rank + 1) * s_local] if sequence_parallel else hidden
    out = {}
    for path in ("fused", "unfused"):
        h = h_local.clone().requires_grad_()
        w = w_shard.clone().requires_grad_()
        if path == "fused":
            loss, stats = vocab_parallel_linear_loss(
                h, w, target, _loss_fn(coef), VOCAB, group, sequence_parallel, block_tokens=3
            )
        else:
            if world_size == 1:
                x = h
            elif sequence_parallel:
                x = torch.cat(dist_fn.all_gather(h, group=group), dim=0)
            else:
                x = copy_to_tensor_model_parallel_region(h, group=group)
            stats = vocab_parallel_stats(F.linear(x, w), target, VOCAB, group)
            loss = _loss_fn(coef)(stats)
        (loss * 0.5).backward()  # the backward scales by grad_output
        out[path] = (loss.detach(), [s.detach() for s in stats], h.grad, w.grad)
    return out


@pytest.mark.dist
@pytest.mark.parametrize(
    ("tp", "sequence_parallel"), [(1, False), (2, False), (2, True)], ids=["tp1", "tp2", "tp2_sp"]
)
def test_equals_megatron_layer_plus_op_plus_loss(tp, sequence_parallel) -> None:
    for out in run_distributed(_body, tp, args=(sequence_parallel,), timeout=120):
        (f_loss, f_stats, fh, fw), (u_loss, u_stats, uh, uw) = out["fused"], out["unfused"]
        torch.testing.assert_close(f_loss, u_loss, atol=ATOL, rtol=0)
        for got, want in zip(f_stats, u_stats, strict=True):
            assert got.shape == want.shape == (SEQ, BATCH)
            torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
        torch.testing.assert_close(fh, uh, atol=ATOL, rtol=0)
        torch.testing.assert_close(fw, uw, atol=ATOL, rtol=0)


def _matmul_flops(fn) -> int:
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


def test_three_matmuls_counted_by_the_flop_counter() -> None:
    # One matmul of N x H x V/TP is 2 N H V/TP FLOPs. The fused loss layer: 3 (logits, dh, dW);
    # the statistics layer followed by a loss: 4 (its backward recomputes the logits); the
    # unfused layer: 3 as well, but with the whole logits (and their gradient) in memory.
    hidden, weight, target, coef = _inputs(1)
    one = 2 * SEQ * BATCH * HIDDEN * weight.shape[0]

    def fused():
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        loss, _ = vocab_parallel_linear_loss(h, w, target, _loss_fn(coef), VOCAB, block_tokens=5)
        loss.backward()

    def stats_layer():
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        stats = vocab_parallel_linear_stats(h, w, target, VOCAB, block_tokens=5)
        _loss_fn(coef)(stats).backward()

    def unfused():
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        _loss_fn(coef)(vocab_parallel_stats(F.linear(h, w), target, VOCAB)).backward()

    assert _matmul_flops(fused) == 3 * one
    assert _matmul_flops(stats_layer) == 4 * one
    assert _matmul_flops(unfused) == 3 * one


def test_forward_only_runs_one_matmul_and_gives_the_value() -> None:
    hidden, weight, target, coef = _inputs(1)
    with torch.no_grad():
        flops = _matmul_flops(
            lambda: vocab_parallel_linear_loss(hidden, weight, target, _loss_fn(coef), VOCAB)
        )
        loss, _ = vocab_parallel_linear_loss(hidden, weight, target, _loss_fn(coef), VOCAB)
        want = _loss_fn(coef)(vocab_parallel_stats(F.linear(hidden, weight), target, VOCAB))
    assert flops == 2 * SEQ * BATCH * HIDDEN * weight.shape[0]
    torch.testing.assert_close(loss, want, atol=ATOL, rtol=0)


def test_a_second_backward_is_refused() -> None:
    hidden, weight, target, coef = _inputs(1)
    w = weight.clone().requires_grad_()
    loss, _ = vocab_parallel_linear_loss(hidden, w, target, _loss_fn(coef), VOCAB)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward"):
        loss.backward()


def test_bad_fill_names_the_problem() -> None:
    hidden, weight, target, coef = _inputs(1)
    short = torch.zeros(3)
    with pytest.raises(ValueError, match="fill must hold 16 values"):
        vocab_parallel_linear_loss(
            hidden, weight, target, _loss_fn(coef), VOCAB, fill=TokenStats(short, short, short)
        )
