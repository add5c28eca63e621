"""``vocab_parallel_stats(implementation="triton")`` against the fp64 reference.

On CPU the kernels run through Triton's interpreter, which must be switched on before Triton
is first imported (megatron-core imports it): all interpreted checks therefore run in one
child process started with ``TRITON_INTERPRET=1`` (``tests/parallel/_triton_interpreted.py``,
ranks over gloo at TP 1, 2 and 4); this module compares what it returns with the reference.
The variable never reaches the pytest process or other tests. Forward tiles of 4 sub-rows
(16 fp32 / 32 bf16 columns, two tiles per iteration) and 32-column backward tiles make the
small test vocabularies span several unmasked iterations, a masked last one and padding. The
same process counts the op's launches per forward + backward with a dispatch mode.

The same checks, compiled, run on CUDA under the ``gpu`` marker; on CPU the kernels' machine
code is compiled and checked in ``test_kernel_sass.py``.

Tolerances: fp32 accumulation, as ``test_vocab_stats.py``: atol 2e-5 on the statistics and on
fp32 gradients. bf16/fp16 gradients are returned in the input dtype, on gradients bounded by
~3: fp16 (11 significant bits, round to nearest) atol 2e-3; bf16 (8 bits) atol 1e-2 for half
an ulp where the conversion rounds to nearest (CUDA), 2e-2 for one ulp under the interpreter,
whose fp32 -> bf16 conversion truncates.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from reco_megatron.parallel import vocab_parallel_stats
from tests.parallel._hostile import check_hostile
from tests.parallel._triton_interpreted import ALL, HOSTILE_TPS, LINEAR_SPECS, SPECS, Spec, body
from tests.parallel._vocab_cases import reference

pytest.importorskip(
    "triton",
    reason="Triton is not installed (torch's CPU-only wheels, as on the compat stack, do not "
    "pull it); the kernels are tested where it is (the main stack)",
)

ROOT = Path(__file__).resolve().parents[2]
FP32_ATOL = 2e-5
GRAD_ATOL = {torch.float32: 2e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}
INTERPRETED_BF16_GRAD_ATOL = 2e-2


def _compare(results, spec: Spec, interpreted: bool) -> None:
    ref_outs, ref_grad = reference(spec.case, spec.tp, spec.dtype, spec.use)
    grad = torch.cat([g for _, g in results], dim=-1)
    for outs, _ in results:  # every rank holds the full per-token statistics
        for name, got, want in zip(("logprob", "entropy", "sum_p2"), outs, ref_outs, strict=True):
            torch.testing.assert_close(got, want, atol=FP32_ATOL, rtol=0, msg=name)
    atol = GRAD_ATOL[spec.dtype]
    if interpreted and spec.dtype == torch.bfloat16:
        atol = INTERPRETED_BF16_GRAD_ATOL
    torch.testing.assert_close(grad, ref_grad, atol=atol, rtol=0)


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory) -> dict[str, object]:
    """Every spec's per-rank results from one interpreter process (~1-2 min on 2 free cores;
    the timeout allows for a loaded machine)."""
    path = tmp_path_factory.mktemp("triton") / "results.pkl"
    code = "import sys; from tests.parallel._triton_interpreted import main; main(sys.argv[1])"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-c", code, str(path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    with open(path, "rb") as f:
        return pickle.load(f)


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("spec", SPECS, ids=[s.name for s in SPECS])
def test_interpreted_kernels_match_fp64_reference(interpreted, spec: Spec) -> None:
    result = interpreted[spec.name]
    assert not isinstance(result, str), result  # a rank's traceback
    _compare(result, spec, interpreted=True)


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("tp", HOSTILE_TPS)
def test_interpreted_kernels_on_hostile_inputs(interpreted, tp) -> None:
    # -inf logits (scattered, a whole shard, a first tile, a target's own logit) and an
    # expanded (stride-0) input with inplace_backward, against fp64 (tests/parallel/_hostile.py)
    result = interpreted[f"hostile-tp{tp}"]
    assert not isinstance(result, str), result
    check_hostile(result, tp)


@pytest.mark.dist
@pytest.mark.slow
def test_launches_per_forward_and_backward(interpreted) -> None:
    # Counted with a dispatch mode (reco_megatron.testing.launches): at TP 1 one kernel per
    # direction and nothing else; at TP 2 three forward kernels around the two all-reduces.
    # No host synchronisation (the target range check is a debug switch on a GPU).
    tp1, tp2 = interpreted["launches-tp1"], interpreted["launches-tp2"]
    assert not isinstance(tp1, str), tp1
    assert not isinstance(tp2, str), tp2
    assert tp1["launches"] <= 12, tp1
    assert (tp1["launches"], tp1["collectives"], tp1["host_syncs"]) == (2, 0, 0), tp1
    assert (tp2["launches"], tp2["collectives"], tp2["host_syncs"]) == (4, 2, 0), tp2


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize(
    ("tp", "sp", "dtype"),
    LINEAR_SPECS,
    ids=[
        f"tp{t}-{'sp' if s else 'nosp'}-{str(d).removeprefix('torch.')}" for t, s, d in LINEAR_SPECS
    ],
)
def test_interpreted_fused_layer_matches_eager(interpreted, tp, sp, dtype) -> None:
    # The fused output layer with the Triton kernels against the same layer with the eager
    # math (itself checked against megatron's layer + the op in test_linear_stats.py). fp32:
    # 2e-5. bf16: the blocks' logits are the same bf16 in both, but dz is truncated
    # (interpreter) vs rounded (eager) to bf16 before the matmuls, and dh, dw are bf16 with
    # dw accumulated in bf16 over 3 blocks: a few ulps of values up to ~4 (ulp 0.031 there;
    # measured 2026-11-30: 1 ulp), so atol 0.1 on dh and dw.
    result = interpreted[
        f"linear-tp{tp}-{'sp' if sp else 'nosp'}-{str(dtype).removeprefix('torch.')}"
    ]
    assert not isinstance(result, str), result
    # The loss-inside layer (3 matmuls) the same way, with loss = sum(stat * upstream).
    for rank_out in result:
        for layer in ("", "loss-"):
            t_stats, t_dh, t_dw = rank_out[f"{layer}triton"]
            e_stats, e_dh, e_dw = rank_out[f"{layer}eager"]
            for got, want in zip(t_stats, e_stats, strict=True):
                torch.testing.assert_close(got, want, atol=FP32_ATOL, rtol=0)
            grad_atol = FP32_ATOL if dtype == torch.float32 else 0.1
            torch.testing.assert_close(t_dh, e_dh, atol=grad_atol, rtol=0)
            torch.testing.assert_close(t_dw, e_dw, atol=grad_atol, rtol=0)


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") == "1", reason="this pytest process runs the interpreter"
)
def test_cpu_logits_without_the_interpreter_are_rejected() -> None:
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        vocab_parallel_stats(torch.randn(2, 5), torch.zeros(2).long(), 5, implementation="triton")


@pytest.mark.parametrize(
    ("dtype", "kwargs", "match"),
    [
        (torch.float64, {}, "implementation='eager'"),
        (torch.float32, {"chunk_size": 4}, "leave chunk_size unset"),
    ],
    ids=["fp64", "chunk_size"],
)
def test_unsupported_requests_name_the_fix(dtype, kwargs, match) -> None:
    logits = torch.randn(2, 5, dtype=dtype)
    with pytest.raises((TypeError, ValueError), match=match):
        vocab_parallel_stats(logits, torch.zeros(2).long(), 5, implementation="triton", **kwargs)


def test_auto_stays_eager_on_cpu() -> None:
    from reco_megatron.parallel.vocab_stats_kernels import resolve

    assert resolve("auto", torch.zeros(1)) == "eager"
    assert resolve("triton", torch.zeros(1)) == "triton"


# ---------------------------------------------------------------- compiled, on a GPU


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("spec", [s for s in SPECS if s.tp == 1], ids=lambda s: s.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_compiled_kernels_on_cuda(spec: Spec, dtype) -> None:
    # TP 1 in this process with the default tiles (gloo's CUDA all-reduce is not what
    # production uses; the combine across ranks is the interpreted TP 2/4 checks' code).
    for inplace in (False, True):
        case_spec = Spec(spec.name, spec.case, 1, dtype, ALL, inplace)
        _compare([body(0, 1, case_spec, "cuda", None)], case_spec, interpreted=False)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_compiled_kernels_at_a_real_vocabulary_with_default_tiles() -> None:
    # V = 128256 over several 4096-column tiles, bf16, against the eager op on the same GPU.
    gen = torch.Generator(device="cuda").manual_seed(0)
    logits = (torch.randn(64, 128256, device="cuda", generator=gen) * 4).to(torch.bfloat16)
    target = torch.randint(0, 128000, (64,), device="cuda", generator=gen)
    target[::7] = -1
    grads = torch.randn(3, 64, device="cuda", generator=gen)
    out = {}
    for impl in ("eager", "triton"):
        x = logits.clone().requires_grad_()
        stats = vocab_parallel_stats(x * 1, target, 128000, implementation=impl)
        sum((s * g).sum() for s, g in zip(stats, grads, strict=True)).backward()
        out[impl] = (stats, x.grad.float())
    for got, want in zip(out["triton"][0], out["eager"][0], strict=True):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(out["triton"][1], out["eager"][1], atol=1e-2, rtol=0)
    assert vocab_parallel_stats(logits, target, 128000).logprob.isfinite().all()  # auto


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fused_layer_on_cuda_matches_matmul_plus_op() -> None:
    # bf16, V = 128256 (several 4096-column tiles), blocks of 100 tokens vs the whole matmul
    # then the op: the same bf16 logits; dh / dw differ by the per-block bf16 rounding of dw.
    from reco_megatron.parallel.linear_stats import vocab_parallel_linear_stats

    gen = torch.Generator(device="cuda").manual_seed(0)
    n, h_size, vocab = 256, 512, 128256
    hidden = (torch.randn(n, h_size, device="cuda", generator=gen)).to(torch.bfloat16)
    weight = (torch.randn(vocab, h_size, device="cuda", generator=gen) * 0.05).to(torch.bfloat16)
    target = torch.randint(0, 128000, (n,), device="cuda", generator=gen)
    upstream = torch.randn(3, n, device="cuda", generator=gen)
    out = {}
    for fused in (True, False):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        if fused:
            stats = vocab_parallel_linear_stats(h, w, target, 128000, block_tokens=100)
        else:
            stats = vocab_parallel_stats(h @ w.t(), target, 128000, inplace_backward=True)
        sum((s * g).sum() for s, g in zip(stats, upstream, strict=True)).backward()
        out[fused] = (stats, h.grad.float(), w.grad.float())
    for got, want in zip(out[True][0], out[False][0], strict=True):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)
    for got, want in zip(out[True][1:], out[False][1:], strict=True):
        torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
