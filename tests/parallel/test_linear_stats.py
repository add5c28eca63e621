"""``vocab_parallel_linear_stats`` against megatron's output layer + ``vocab_parallel_stats``.

The unfused path is what ``ColumnParallelLinear(parallel_output=True)`` computes: its input
goes through megatron's own mapping ``copy_to_tensor_model_parallel_region`` (backward:
all-reduce of the input gradient), then ``F.linear`` with this rank's rows, then the
statistics op. Under sequence parallelism megatron's ``gather_from_sequence_parallel_region``
allocates on CUDA only, so the reference uses ``torch.distributed.nn.functional.all_gather``,
which has the same semantics (forward: gather along dim 0; backward: reduce-scatter).

Both paths see the same fp32 inputs; the fused one computes the logits in blocks of 3 tokens
(several blocks and a ragged last one), so only the summation order of the partial sums
differs (rescaled per block and rank): atol 1e-5 on statistics and gradients of order 1.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from reco_megatron.parallel import vocab_parallel_stats
from reco_megatron.parallel.linear_stats import vocab_parallel_linear_stats
from reco_megatron.testing import run_distributed

ATOL = 1e-5
SEQ, BATCH, HIDDEN, VOCAB, PAD = 8, 2, 16, 250, 64


def _inputs(tp: int):
    gen = torch.Generator().manual_seed(3)
    v_pad = -(-VOCAB // (PAD * tp)) * PAD * tp
    hidden = torch.randn(SEQ, BATCH, HIDDEN, generator=gen)
    weight = torch.randn(v_pad, HIDDEN, generator=gen) * 0.5
    target = torch.randint(0, VOCAB, (SEQ, BATCH), generator=gen)
    target[::3, 0] = -1
    upstream = [torch.randn(SEQ, BATCH, generator=gen) for _ in range(3)]
    return hidden, weight, target, upstream


def _body(rank: int, world_size: int, sequence_parallel: bool, use):
    import torch.distributed.nn.functional as dist_fn
    from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

    hidden, weight, target, upstream = _inputs(world_size)
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
            stats = vocab_parallel_linear_stats(
                h, w, target, VOCAB, group, sequence_parallel=sequence_parallel, block_tokens=3
            )
        else:
            if world_size == 1:
                x = h
            elif sequence_parallel:
                x = torch.cat(dist_fn.all_gather(h, group=group), dim=0)
            else:
                x = copy_to_tensor_model_parallel_region(h, group=group)
            stats = vocab_parallel_stats(F.linear(x, w), target, VOCAB, group)
        used = [(s, g) for s, g, u in zip(stats, upstream, use, strict=True) if u]
        sum((s * g).sum() for s, g in used).backward()
        out[path] = ([s.detach() for s in stats], h.grad, w.grad)
    return out


@pytest.mark.dist
@pytest.mark.parametrize(
    ("tp", "sequence_parallel"), [(1, False), (2, False), (2, True)], ids=["tp1", "tp2", "tp2_sp"]
)
@pytest.mark.parametrize(
    "use", [(True, True, True), (True, False, False)], ids=["all_three", "logprob_only"]
)
def test_fused_layer_equals_column_parallel_linear_plus_op(tp, sequence_parallel, use) -> None:
    for out in run_distributed(_body, tp, args=(sequence_parallel, use), timeout=120):
        (fused_stats, fh, fw), (ref_stats, rh, rw) = out["fused"], out["unfused"]
        for got, want in zip(fused_stats, ref_stats, strict=True):
            torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
        torch.testing.assert_close(fh, rh, atol=ATOL, rtol=0)
        torch.testing.assert_close(fw, rw, atol=ATOL, rtol=0)


@pytest.mark.parametrize(
    ("hidden", "weight", "target", "kwargs", "match"),
    [
        ((4, 8), (10, 6), (4,), {}, "share the hidden size"),
        ((4, 8), (10, 8), (5,), {}, "leading shape"),
        ((4, 8), (10, 8), (4,), {"sequence_parallel": True}, "size > 1"),
        ((4, 8), (10, 8), (4,), {"vocab_size": 11}, "vocab_size=11"),
    ],
    ids=["hidden_size", "target_shape", "sp_without_tp", "vocab_too_large"],
)
def test_bad_input_names_the_problem(hidden, weight, target, kwargs, match) -> None:
    kwargs = {"vocab_size": 10, **kwargs}
    with pytest.raises(ValueError, match=match):
        vocab_parallel_linear_stats(
            torch.randn(*hidden), torch.randn(*weight), torch.zeros(target).long(), **kwargs
        )


def test_mixed_dtypes_say_how_to_fix() -> None:
    with pytest.raises(TypeError, match="cast hidden"):
        vocab_parallel_linear_stats(
            torch.randn(4, 8), torch.randn(10, 8).to(torch.bfloat16), torch.zeros(4).long(), 10
        )
