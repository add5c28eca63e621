"""``vocab_parallel_stats`` at TP 1, 2, 4 against a single-process fp64 reference.

Every parallel result is compared with ``token_stats_reference`` run in fp64 on the gathered,
unpadded logits, forward (all three statistics) and backward (random upstream gradients on
all three at once, and on each one alone).

Tolerances:
* fp32 logits: the op computes in fp32; the sums over <= 1000 columns of terms of order 1 have
  a rounding error of ~1e-6 relative, so atol 2e-5 on statistics of order 1-10 and gradients
  of order 1.
* bf16 logits: the reference sees the same bf16-rounded values, so the statistics still agree
  to fp32 accuracy; the *gradient* is returned in bf16 (the caller's dtype), i.e. rounded to 8
  significant bits: atol 1e-2 for gradients bounded by ~3 in magnitude.
* fp64 logits (TP 1): the op then computes in fp64, so torch.autograd.gradcheck applies.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from reco_megatron.algo.token_stats import token_stats_reference
from reco_megatron.parallel import vocab_parallel_stats
from reco_megatron.parallel.vocab_stats_kernels import triton_available
from reco_megatron.testing import run_distributed
from tests.parallel._hostile import check_hostile, hostile_body
from tests.parallel._vocab_cases import CASES, Case, global_inputs, reference

FP32_ATOL = 2e-5
BF16_GRAD_ATOL = 1e-2


def _tp_body(
    rank: int, world_size: int, case: Case, dtype: torch.dtype, use, chunk_size, inplace=False
):
    logits, target, grads = global_inputs(case, world_size)
    v_local = logits.shape[1] // world_size
    shard = logits[:, rank * v_local : (rank + 1) * v_local].to(dtype).contiguous()
    before = shard.clone()
    shard.requires_grad_()
    output = shard * 1 if inplace else shard  # in place: a non-leaf, like the layer's logits
    stats = vocab_parallel_stats(
        output,
        target,
        case.vocab,
        tp_group=dist.group.WORLD,
        chunk_size=chunk_size,
        inplace_backward=inplace,
    )
    total = sum((o.double() * g).sum() for o, g, u in zip(stats, grads, use, strict=True) if u)
    total.backward()
    if inplace:  # the gradient overwrote the logits
        assert torch.equal(output.detach(), shard.grad), "gradient not written in place"
    else:
        assert torch.equal(shard.detach(), before), "the op modified its input logits"
    return [s.detach().double() for s in stats], shard.grad.double()


def _check(
    case: Case, tp: int, dtype: torch.dtype, use=(True, True, True), chunk_size=7, inplace=False
):
    args = (case, dtype, use, chunk_size, inplace)
    results = run_distributed(_tp_body, tp, args=args, timeout=60)
    ref_outs, ref_grad = reference(case, tp, dtype, use)
    grad = torch.cat([g for _, g in results], dim=-1)
    for outs, _ in results:  # every rank holds the full per-token statistics
        for name, got, want in zip(("logprob", "entropy", "sum_p2"), outs, ref_outs, strict=True):
            torch.testing.assert_close(got, want, atol=FP32_ATOL, rtol=0, msg=name)
    atol = FP32_ATOL if dtype == torch.float32 else BF16_GRAD_ATOL
    torch.testing.assert_close(grad, ref_grad, atol=atol, rtol=0)


@pytest.mark.dist
@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_matches_fp64_reference(case: Case, tp: int) -> None:
    _check(case, tp, torch.float32)


@pytest.mark.dist
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_bf16_logits(tp: int) -> None:
    _check(CASES[1], tp, torch.bfloat16)


@pytest.mark.dist
@pytest.mark.parametrize(
    "use",
    [(True, False, False), (False, True, False), (False, False, True)],
    ids=["logprob_only", "entropy_only", "sum_p2_only"],
)
def test_gradient_of_each_output_alone(use) -> None:
    _check(CASES[3], 2, torch.float32, use=use)


@pytest.mark.dist
@pytest.mark.parametrize("chunk_size", [1, 5, None], ids=["chunk1", "chunk5", "default"])
def test_chunking_does_not_change_results(chunk_size) -> None:
    _check(CASES[1], 2, torch.float32, chunk_size=chunk_size)


@pytest.mark.dist
@pytest.mark.parametrize(
    ("case", "use"),
    [(CASES[1], (True, True, True)), (CASES[3], (False, True, False))],
    ids=["padded_all", "ignored_entropy_only"],
)
def test_inplace_gradient(case: Case, use) -> None:
    _check(case, 2, torch.float32, use=use, chunk_size=5, inplace=True)


@pytest.mark.dist
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_hostile_inputs_match_fp64_reference(tp: int) -> None:
    # -inf logits: scattered, a whole shard (TP 2/4), a first tile, a target's own logit
    # (log p = -inf, finite gradient); an expand()-ed input with inplace_backward (the
    # gradient cannot overwrite shared memory: it goes to a new buffer). The summed row
    # gradient adds 24 token gradients: 10x the fp32 tolerance.
    check_hostile(run_distributed(hostile_body, tp, args=("eager",), timeout=60), tp)


def _megatron_body(rank: int, world_size: int, case: Case):
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world_size)
    try:
        logits, target, _ = global_inputs(case, world_size)
        v_local = logits.shape[1] // world_size
        shard = logits[:, rank * v_local : (rank + 1) * v_local].float().contiguous()
        # megatron's cross entropy works on [S, B, V/TP]; its in-place max subtraction is
        # why it gets a clone.
        ours = vocab_parallel_stats(
            shard, target, case.vocab, tp_group=parallel_state.get_tensor_model_parallel_group()
        ).logprob
        theirs = vocab_parallel_cross_entropy(shard.clone()[:, None, :], target[:, None])[:, 0]
        return ours, -theirs
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.dist
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_logprob_equals_megatron_cross_entropy(tp: int) -> None:
    # Megatron's op does not exclude padded columns, so this uses the unpadded case.
    for ours, theirs in run_distributed(_megatron_body, tp, args=(CASES[0],), timeout=60):
        torch.testing.assert_close(ours, theirs, atol=FP32_ATOL, rtol=0)


def _two_groups_body(rank: int, world_size: int):
    # Two independent TP groups of 2 with different data; megatron's global state is never
    # initialised, so only the explicit group can produce the right answer.
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine = rank // 2
    case = Case(f"group{mine}", n_tokens=12, vocab=300, pad_multiple=128, seed=10 + mine)
    logits, target, _ = global_inputs(case, 2)
    v_local = logits.shape[1] // 2
    local = rank % 2
    shard = logits[:, local * v_local : (local + 1) * v_local].float()
    stats = vocab_parallel_stats(shard, target, case.vocab, tp_group=groups[mine])
    return mine, [s.double() for s in stats]


@pytest.mark.dist
def test_uses_the_explicit_group_not_global_state() -> None:
    for mine, outs in run_distributed(_two_groups_body, 4, timeout=60):
        case = Case(f"group{mine}", n_tokens=12, vocab=300, pad_multiple=128, seed=10 + mine)
        ref, _ = reference(case, 2, torch.float32, (True, True, True))
        for got, want in zip(outs, ref, strict=True):
            torch.testing.assert_close(got, want, atol=FP32_ATOL, rtol=0)


def test_fp64_gradcheck_single_process() -> None:
    logits = torch.randn(6, 11, dtype=torch.float64, requires_grad=True)
    target = torch.tensor([0, 3, 8, -1, 5, 7])

    def fn(z):
        return tuple(vocab_parallel_stats(z, target, vocab_size=9, chunk_size=4))

    assert torch.autograd.gradcheck(fn, (logits,))


def test_leading_dimensions_and_empty_input() -> None:
    logits = torch.randn(3, 4, 10, requires_grad=True)
    target = torch.randint(0, 10, (3, 4))
    stats = vocab_parallel_stats(logits, target, 10)
    ref = token_stats_reference(logits.double(), target)
    for got, want in zip(stats, ref, strict=True):
        assert got.shape == (3, 4)
        torch.testing.assert_close(got.double(), want, atol=FP32_ATOL, rtol=0)
    empty = vocab_parallel_stats(torch.zeros(0, 10, requires_grad=True), torch.zeros(0).long(), 10)
    assert empty.logprob.shape == (0,)


@pytest.mark.parametrize(
    ("logits_shape", "target", "vocab", "match"),
    [
        ((4, 10), torch.zeros(5).long(), 10, "trailing vocabulary"),
        ((4, 10), torch.zeros(4).long(), 11, "vocab_size=11"),
        ((4, 10), torch.tensor([0, 1, 2, 10]), 10, "token id 10"),
        ((4, 10), torch.zeros(4), 10, "integer token ids"),
    ],
    ids=["shape_mismatch", "vocab_too_large", "target_out_of_vocab", "float_target"],
)
def test_bad_input_names_the_problem(logits_shape, target, vocab, match) -> None:
    with pytest.raises((ValueError, TypeError), match=match):
        vocab_parallel_stats(torch.randn(*logits_shape), target, vocab)


def _compiled_body(rank: int, world_size: int, case: Case):
    logits, target, grads = global_inputs(case, world_size)
    v_local = logits.shape[1] // world_size
    shard = logits[:, rank * v_local : (rank + 1) * v_local].float().contiguous()
    out = {}
    for impl in ("eager", "compiled"):
        x = shard.clone().requires_grad_()
        stats = vocab_parallel_stats(
            x, target, case.vocab, tp_group=dist.group.WORLD, chunk_size=8, implementation=impl
        )
        sum((o.double() * g).sum() for o, g in zip(stats, grads, strict=True)).backward()
        out[impl] = ([s.detach().double() for s in stats], x.grad.double())
    return out


@pytest.mark.dist
@pytest.mark.slow
def test_compiled_kernels_match_eager_and_reference() -> None:
    # torch.compile fuses each chunk (C++ on CPU, Triton on GPU); same math, other summation
    # order, so the same fp32 tolerance applies. One TP=2 case: each rank compiles once.
    case = CASES[3]
    results = run_distributed(_compiled_body, 2, args=(case,), timeout=300)
    ref_outs, ref_grad = reference(case, 2, torch.float32, (True, True, True))
    for impl in ("eager", "compiled"):
        grad = torch.cat([r[impl][1] for r in results], dim=-1)
        torch.testing.assert_close(grad, ref_grad, atol=FP32_ATOL, rtol=0)
        for got, want in zip(results[0][impl][0], ref_outs, strict=True):
            torch.testing.assert_close(got, want, atol=FP32_ATOL, rtol=0)


def test_unknown_implementation_is_rejected() -> None:
    with pytest.raises(ValueError, match="'fused'"):
        vocab_parallel_stats(torch.randn(2, 5), torch.zeros(2).long(), 5, implementation="fused")


@pytest.mark.skipif(triton_available(), reason="Triton is installed here")
def test_triton_without_triton_says_what_is_missing() -> None:
    with pytest.raises(ImportError, match="needs Triton"):
        vocab_parallel_stats(torch.randn(2, 5), torch.zeros(2).long(), 5, implementation="triton")
