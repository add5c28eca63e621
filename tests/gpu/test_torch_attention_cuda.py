"""torch's attention (``model.attention_backend=torch``) on CUDA in bf16 against an fp64
reference: padded causal rows through ``scaled_dot_product_attention`` (GQA 32:8, head width
128: the 8B layer's shape), and packed rows through ``varlen_attn`` where this torch has it
(else the per-sequence loop, whose reason the test prints).

Tolerance 1.5e-2 absolute on outputs of magnitude <= ~4: the reference uses the same
bf16-rounded inputs in fp64, so what remains is the kernels' bf16 rounding of the output
(2^-9 relative) and of the probabilities before the product with V (2^-9 relative per term,
averaging out over the keys); a wrong mask, scale or head grouping is off by 0.1 or more.
"""

from __future__ import annotations

import math
import types

import torch

from reco_megatron.megatron.model.attention import TorchDotProductAttention, varlen_reason
from tests.gpu._cuda import GPU

pytestmark = GPU
ATOL = 1.5e-2


def _module(heads: int, groups: int, d: int) -> TorchDotProductAttention:
    config = types.SimpleNamespace(
        num_attention_heads=heads,
        num_query_groups=groups,
        kv_channels=d,
        context_parallel_size=1,
        attention_dropout=0.0,
        window_size=None,
        softmax_type="vanilla",
    )
    tp = types.SimpleNamespace(tp=types.SimpleNamespace(size=lambda: 1))
    causal = types.SimpleNamespace(name="causal")
    return TorchDotProductAttention(config, 1, causal, "self", pg_collection=tp)


def _reference(q, k, v) -> torch.Tensor:
    """fp64 causal GQA attention, ``[s, b, h, d]`` -> ``[s, b, h * d]``."""
    q, k, v = (x.double().cpu().permute(1, 2, 0, 3) for x in (q, k, v))  # [b, h, s, d]
    ratio = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(ratio, 1), v.repeat_interleave(ratio, 1)
    s = q.shape[2]
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~torch.ones(s, s, dtype=torch.bool).tril(), float("-inf"))
    out = torch.softmax(scores, -1) @ v  # [b, h, s, d]
    return out.permute(2, 0, 1, 3).reshape(s, q.shape[0], -1)


def test_padded_rows_on_cuda_equal_fp64() -> None:
    gen = torch.Generator().manual_seed(0)
    s, b, heads, groups, d = 512, 2, 32, 8, 128
    q, k, v = (
        torch.randn(s, b, n, d, generator=gen).to(torch.bfloat16) for n in (heads, groups, groups)
    )
    module = _module(heads, groups, d)
    leaves = [x.cuda().requires_grad_() for x in (q, k, v)]
    out = module(*leaves, None)
    out.float().pow(2).sum().backward()
    gap = (out.double().cpu() - _reference(q, k, v)).abs().max()
    assert float(gap) < ATOL, float(gap)
    assert all(torch.isfinite(x.grad).all() for x in leaves)


def test_packed_rows_on_cuda_equal_each_sequence_alone_in_fp64() -> None:
    gen = torch.Generator().manual_seed(1)
    lengths, heads, groups, d = (300, 17, 1000, 731), 32, 8, 128
    total = sum(lengths)
    q, k, v = (
        torch.randn(total, n, d, generator=gen).to(torch.bfloat16) for n in (heads, groups, groups)
    )
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    params = types.SimpleNamespace(
        qkv_format="thd",
        cu_seqlens_q=cu.cuda(),
        cu_seqlens_kv=cu.cuda(),
        max_seqlen_q=max(lengths),
        max_seqlen_kv=max(lengths),
    )
    print("varlen_attn:", varlen_reason(True, torch.bfloat16, heads // groups) or "used")
    out = _module(heads, groups, d)(q.cuda(), k.cuda(), v.cuda(), None, packed_seq_params=params)
    assert out.shape == (total, heads * d)
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
        want = _reference(*(x[s:e].unsqueeze(1) for x in (q, k, v)))[:, 0]
        gap = (out[s:e].double().cpu() - want).abs().max()
        assert float(gap) < ATOL, (s, e, float(gap))
