"""The statistics op, compiled (``torch.compile`` -> Triton) on CUDA, against fp64 on the CPU.

Same inputs and fp64 reference as ``tests/parallel/test_vocab_stats.py`` (TP 1: the whole
vocabulary on one GPU), plus a Llama-size vocabulary.

Tolerances (not yet observed on a GPU: stated from the arithmetic):
* statistics, fp32 and bf16 logits: the op computes in fp32 either way (bf16 logits are
  upcast; the reference sees the same bf16-rounded values). GPU ``exp``/``log`` differ from
  the CPU's by a few ulp and the reductions run in another order: ~1e-6 relative over <= 1000
  columns, ~1e-5 over 32000. atol 5e-5 (small vocabularies) and 2e-4 (32000) on values of
  order 1-10.
* gradients: fp32 logits get fp32 gradients (same atol); bf16 logits get bf16 gradients,
  rounded to 8 significant bits: atol 1e-2 for gradients bounded by ~3.
"""

from __future__ import annotations

import pytest
import torch

from reco_megatron.parallel import vocab_parallel_stats
from tests.gpu._cuda import GPU
from tests.parallel._vocab_cases import CASES, Case, global_inputs, reference

pytestmark = GPU

BIG = Case("llama_vocab", n_tokens=96, vocab=32000, pad_multiple=128, ignored_every=7)
BF16_GRAD_ATOL = 1e-2


def _atol(case: Case) -> float:
    return 2e-4 if case.vocab > 1000 else 5e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", [*CASES, BIG], ids=lambda c: c.name)
def test_compiled_on_cuda_matches_fp64(case: Case, dtype: torch.dtype) -> None:
    logits, target, grads = global_inputs(case, tp=1)
    want, want_grad = reference(case, 1, dtype, (True, True, True))
    x = logits.to(dtype).cuda().requires_grad_()
    stats = vocab_parallel_stats(x, target.cuda(), case.vocab, implementation="compiled")
    total = sum((s.double() * g.cuda()).sum() for s, g in zip(stats, grads, strict=True))
    total.backward()
    atol = _atol(case)
    for name, got, ref in zip(("logprob", "entropy", "sum_p2"), stats, want, strict=True):
        assert got.dtype == torch.float32, name
        torch.testing.assert_close(got.double().cpu(), ref, atol=atol, rtol=0, msg=name)
    grad_atol = atol if dtype == torch.float32 else BF16_GRAD_ATOL
    assert x.grad.dtype == dtype
    torch.testing.assert_close(x.grad.double().cpu(), want_grad, atol=grad_atol, rtol=0)
