"""Sequence parallelism on megatron's local layer spec (``parallel.sequence_parallel: true``).

Two parts:

* :class:`~reco_megatron.megatron.model.norm.SequenceParallelNorm` against an fp64 reference
  (forward and backward, RMSNorm and LayerNorm, fp32 and bf16): in fp32 it is bit-identical to
  torch's norms (what the local spec built before), in bf16 its output is the fp64 result
  rounded once (fp32 statistics: a bf16 mean of squares would be off by several bf16 steps).
* One ReCo update (old-policy pass + 2 optimizer steps, the rollout batch of
  ``test_reco_step``) at TP 2 with sequence parallelism equals the same update at TP 2 without
  it and the single-process run: per-token old log-probs, losses and metrics, the gradient
  norm of each step, and every parameter after both steps; for Llama (untied) and Qwen2 (QKV
  bias, tied embeddings), and with ``update.fused_output_layer`` (hidden states arrive
  sequence-sharded at the loss layer). The batch has 13 positions, so the padding of the
  micro-batches to a multiple of TP runs too.
  A control run without the norms' ``sequence_parallel`` mark must differ: each TP rank's norm
  weights would then see only their half of the sequence's gradient (the check bites).

Tolerances as in ``test_reco_step``: fp32 summation order (SP reduce-scatters where TP alone
all-reduces) passed through Adam with eps 1e-3: parameters 2e-5, losses 1e-5; log-probs of the
first pass 1e-5 (measured ~5e-7).
"""

from __future__ import annotations

import types

import pytest
import torch

from reco_megatron.algo import LossConfig
from reco_megatron.megatron.model.norm import SequenceParallelNorm
from reco_megatron.testing import run_distributed
from tests.megatron import _reco

PARAM_ATOL = 2e-5
LOSS_ATOL = 1e-5
LOGPROB_ATOL = 1e-5
H = 64


# ---------------------------------------------------------------- the norm, one process
def _norm(kind: str, dtype: torch.dtype, sp: bool = True) -> SequenceParallelNorm:
    cfg = types.SimpleNamespace(normalization=kind, params_dtype=dtype, sequence_parallel=sp)
    norm = SequenceParallelNorm(cfg, H, eps=1e-5)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.5 * torch.randn(H, generator=gen))
        if norm.bias is not None:
            norm.bias.copy_(0.1 * torch.randn(H, generator=gen))
    return norm


def _reference(kind: str, x, w, b):
    if kind == "RMSNorm":
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w
    mu = x.mean(-1, keepdim=True)
    var = (x - mu).pow(2).mean(-1, keepdim=True)
    return (x - mu) * torch.rsqrt(var + 1e-5) * w + b


@pytest.mark.parametrize("kind", ["RMSNorm", "LayerNorm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_norm_equals_fp64_reference(kind: str, dtype: torch.dtype) -> None:
    norm = _norm(kind, dtype)
    gen = torch.Generator().manual_seed(2)
    # [S, B, H] with a large mean and spread: where low-precision statistics would show
    x = (3 * torch.randn(6, 3, H, generator=gen) + 2).to(dtype).requires_grad_()
    grad = torch.randn(6, 3, H, generator=gen).to(dtype)
    y = norm(x)
    y.backward(grad)
    assert y.dtype == dtype and norm.weight.grad.dtype == dtype

    params = [norm.weight] + ([norm.bias] if norm.bias is not None else [])
    x64 = x.detach().double().requires_grad_()
    p64 = [p.detach().double().requires_grad_() for p in params]
    y64 = _reference(kind, x64, p64[0], p64[1] if len(p64) > 1 else 0.0)
    y64.backward(grad.double())

    if dtype == torch.float32:
        torch.testing.assert_close(y.double(), y64, atol=2e-6, rtol=0)
        torch.testing.assert_close(x.grad.double(), x64.grad, atol=2e-6, rtol=0)
        for p, ref in zip(params, p64, strict=True):  # sums over 18 tokens
            torch.testing.assert_close(p.grad.double(), ref.grad, atol=2e-5, rtol=0)
        torch_norm = torch.nn.RMSNorm(H, eps=1e-5) if kind == "RMSNorm" else torch.nn.LayerNorm(H)
        torch_norm.load_state_dict(norm.state_dict())
        assert torch.equal(torch_norm(x), y), "fp32 must stay bit-identical to torch's norm"
    else:
        # One rounding of the fp64 result (half a bf16 step, 2^-9 relative), plus a little
        # for the fp32 product: statistics in bf16 would be off by several steps.
        step = y64.abs() * 2.0**-8
        assert bool(((y.double() - y64).abs() <= step + 1e-6).all())
        # Gradients: bf16 inputs and output, fp32 inside; sums of 18 bf16-rounded terms.
        scale = x64.grad.abs().max()
        assert float((x.grad.double() - x64.grad).abs().max()) < 2e-2 * float(scale)
        for p, ref in zip(params, p64, strict=True):
            assert float((p.grad.double() - ref.grad).abs().max()) < 2e-2 * float(
                ref.grad.abs().max()
            )


def test_norm_marks_its_parameters_and_refuses_what_it_cannot_do() -> None:
    assert all(p.sequence_parallel for p in _norm("LayerNorm", torch.float32).parameters())
    assert not any(p.sequence_parallel for p in _norm("RMSNorm", torch.float32, False).parameters())
    assert _norm("RMSNorm", torch.bfloat16).weight.dtype == torch.bfloat16
    bad = types.SimpleNamespace(normalization="L2Norm", params_dtype=torch.float32)
    with pytest.raises(ValueError, match="normalization='L2Norm'"):
        SequenceParallelNorm(bad, H)
    gamma = types.SimpleNamespace(normalization="RMSNorm", layernorm_zero_centered_gamma=True)
    with pytest.raises(ValueError, match="layernorm_zero_centered_gamma"):
        SequenceParallelNorm(gamma, H)


# ---------------------------------------------------------------- one update at TP 2 + SP
def _update_body(rank, world_size, tp, sp, reference, family="llama", fused=False, mark=True):
    model = _reco.model_config(family, tie_word_embeddings=family == "qwen2")
    engine = _reco.build_engine(
        tp=tp,
        loss=LossConfig.preset("reco", kl_coef=0.0),
        model=model,
        fused_output_layer=fused,
        sequence_parallel=sp,
    )
    norms = [
        m for c in engine.unwrapped() for m in c.modules() if "norm" in type(m).__name__.lower()
    ]
    assert norms and all(isinstance(m, SequenceParallelNorm) for m in norms), norms
    assert len(norms) == 2 * model.num_layers + 1  # input, pre-MLP per layer; final
    if not mark:  # the control: without the mark megatron does not sum the norms' gradients
        for m in norms:
            for p in m.parameters():
                p.sequence_parallel = False
    if reference is None:
        return _reco.full_params(engine)
    _reco.load_full(engine, reference)
    batch = _reco.dp_share(_reco.rollout_batch())
    assert batch.seq_length % 2 == 1  # micro-batches are padded to a multiple of TP
    prepared, _ = engine.prepare(batch)
    steps = engine.train_on_rollout(prepared)
    norm_weights = {
        name: p.detach().clone()
        for c in engine.unwrapped()
        for name, p in c.named_parameters()
        if "norm" in name
    }
    return {
        "params": _reco.full_params(engine),
        "norms": norm_weights,
        "steps": steps,
        "old_logprobs": prepared.old_logprobs,
        "old_sum_p2": prepared.old_sum_p2,
        "mask": prepared.loss_mask,
    }


@pytest.fixture(scope="module")
def baseline():
    """``baseline(family)``: reference weights and the single-process update (cached)."""
    cache: dict[str, dict] = {}

    def get(family: str) -> dict:
        if family not in cache:
            ref = run_distributed(_update_body, 1, args=(1, False, None, family), timeout=120)[0]
            one = run_distributed(_update_body, 1, args=(1, False, ref, family), timeout=120)[0]
            cache[family] = {"reference": ref, "single": one}
        return cache[family]

    return get


def _compare(got: dict, want: dict, param_atol: float = PARAM_ATOL) -> None:
    mask = want["mask"].bool()
    for key in ("old_logprobs", "old_sum_p2"):
        gap = (got[key] - want[key]).abs()[mask].max()
        assert float(gap) < LOGPROB_ATOL, f"{key}: {float(gap)}"
    assert got["params"].keys() == want["params"].keys()
    for name, value in want["params"].items():
        torch.testing.assert_close(got["params"][name], value, atol=param_atol, rtol=0, msg=name)
    for got_step, want_step in zip(got["steps"], want["steps"], strict=True):
        for key in ("loss", "clip_frac", "entropy", "token_ratio_max", "weight_mean"):
            assert got_step[key] == pytest.approx(want_step[key], abs=LOSS_ATOL), key
        # the gradient before clipping, over every parameter (norm weights once, not per rank)
        assert got_step["grad_norm"] == pytest.approx(want_step["grad_norm"], rel=1e-5)


CASES = [("llama", False), ("llama", True), ("qwen2", False)]


@pytest.mark.dist
@pytest.mark.parametrize(
    ("family", "fused"), CASES, ids=["llama", "llama_fused_output_layer", "qwen2"]
)
def test_tp2_sequence_parallel_equals_tp2_and_one_process(baseline, family, fused) -> None:
    base = baseline(family)
    with_sp = run_distributed(
        _update_body,
        2,
        args=(2, True, base["reference"], family),
        kwargs={"fused": fused},
        timeout=180,
    )
    without = run_distributed(
        _update_body,
        2,
        args=(2, False, base["reference"], family),
        kwargs={"fused": fused},
        timeout=180,
    )
    for got, plain in zip(with_sp, without, strict=True):
        _compare(got, base["single"])
        _compare(got, plain)
    # Summed over TP, the norms' gradients (and so their weights) agree on both ranks.
    for name, value in with_sp[0]["norms"].items():
        assert torch.equal(value, with_sp[1]["norms"][name]), name


@pytest.mark.dist
def test_without_the_mark_the_norm_weights_diverge(baseline) -> None:
    base = baseline("llama")
    got = run_distributed(
        _update_body, 2, args=(2, True, base["reference"]), kwargs={"mark": False}, timeout=180
    )
    name = "decoder.final_layernorm.weight"
    gap = (got[0]["norms"][name] - got[1]["norms"][name]).abs().max()
    assert float(gap) > 1e-3, "the TP ranks' norm weights agree even without the gradient sum"
    with pytest.raises(AssertionError):
        _compare(got[0], base["single"])
