"""torch's fused attention (:mod:`reco_megatron.megatron.model.attention`) equals megatron's
local ``DotProductAttention``, forward and backward, in fp64.

* The core attention alone (one process): causal padded batches ``[s, b, h, d]``, grouped-query
  attention 32:8 and 4:2 and plain multi-head 4:4, a megatron mask of its own (``True`` =
  masked out), and a query shorter than the keys (the diagonal aligned to the last key, as a
  decode step with a KV cache sees it): outputs and the gradients of query, key and value.
* Whole ``GPTModel`` s built by ``model.build`` with ``model.attention_backend`` ``local`` and
  ``torch`` from the same weights: logits and every parameter gradient, at TP 1, and at TP 2
  with sequence parallelism (heads split over the ranks, the sequence gathered before the QKV
  projection), for 32:8 and 4:2.
* Packed rows (THD) against each sequence run alone through the padded path.

Tolerance 1e-10: the same fp64 math, summed in a different order (the fused kernel's online
softmax against megatron's materialised one); a wrong scale, mask or head grouping is off by
1e-2 or more.
"""

from __future__ import annotations

import types

import pytest
import torch

from reco_megatron.megatron.model.attention import (
    TorchDotProductAttention,
    resolve_attention_backend,
)
from reco_megatron.testing import run_distributed

ATOL = 1e-10


def _config(heads: int, groups: int, d: int = 8, tp: int = 1) -> types.SimpleNamespace:
    return types.SimpleNamespace(
        num_attention_heads=heads,
        num_query_groups=groups,
        kv_channels=d,
        context_parallel_size=1,
        attention_dropout=0.0,
        window_size=None,
        softmax_type="vanilla",
    )


class _TP:
    def __init__(self, size: int) -> None:
        self.tp = types.SimpleNamespace(size=lambda: size)


def _core_body(rank, world_size, heads, groups, case):
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from reco_megatron.megatron.distributed import ParallelConfig, initialize_parallel
    from reco_megatron.megatron.model.build import transformer_config
    from tests.megatron import _reco

    initialize_parallel(ParallelConfig(), seed=1)
    model = _reco.model_config(
        hidden_size=8 * heads, num_attention_heads=heads, num_query_groups=groups
    )
    config = transformer_config(model, ParallelConfig(), on_gpu=False)
    config.params_dtype = torch.float64
    kind = AttnMaskType.no_mask if case == "decode" else AttnMaskType.causal
    local = DotProductAttention(config, 1, kind, "self")
    fused = TorchDotProductAttention(config, 1, kind, "self")
    gen = torch.Generator().manual_seed(heads + groups)
    sq, sk, b, d = {"decode": (1, 9, 2, 8), "shorter": (4, 9, 2, 8)}.get(case, (11, 11, 3, 8))
    q = torch.randn(sq, b, heads, d, generator=gen, dtype=torch.float64)
    k = torch.randn(sk, b, groups, d, generator=gen, dtype=torch.float64)
    v = torch.randn(sk, b, groups, d, generator=gen, dtype=torch.float64)
    grad = torch.randn(sq, b, heads * d, generator=gen, dtype=torch.float64)
    mask = None
    if case == "mask":  # a padding mask: the last 3 keys of row 0 masked out, plus causal
        mask = torch.ones(sk, sk, dtype=torch.bool).triu(1).expand(b, 1, sk, sk).clone()
        mask[0, :, :, -3:] = True
        mask[0, :, -3:, :] = torch.ones(3, sk, dtype=torch.bool).triu(sk - 3 + 1)
    elif case == "shorter":  # megatron's own mask aligned to the last key
        i = torch.arange(sq)[:, None]
        mask = (torch.arange(sk)[None, :] > i + sk - sq).expand(b, 1, sq, sk)
    results = []
    for module, m in ((local, mask), (fused, mask if case != "shorter" else None)):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        out = module(*leaves, m)
        out.backward(grad)
        results.append((out.detach(), [x.grad for x in leaves]))
    return results


CORE_CASES = [(32, 8, "causal"), (4, 2, "causal"), (4, 4, "causal"), (4, 2, "mask")]
CORE_CASES += [(4, 2, "shorter"), (32, 8, "decode")]


@pytest.mark.dist
@pytest.mark.parametrize(("heads", "groups", "case"), CORE_CASES)
def test_core_attention_equals_megatron_local_in_fp64(heads, groups, case) -> None:
    (out0, grads0), (out1, grads1) = run_distributed(
        _core_body, 1, args=(heads, groups, case), timeout=120
    )[0]
    torch.testing.assert_close(out1, out0, atol=ATOL, rtol=0)
    for name, g1, g0 in zip("qkv", grads1, grads0, strict=True):
        torch.testing.assert_close(g1, g0, atol=ATOL, rtol=0, msg=name)
    assert float(out0.abs().max()) > 0.1 and float(grads0[1].abs().max()) > 1e-3


def _model_body(rank, world_size, heads, groups, sp):
    from megatron.core import parallel_state as ps

    from reco_megatron.megatron.distributed import ParallelConfig, initialize_parallel
    from reco_megatron.megatron.hf.convert import gather_tp, global_names
    from reco_megatron.megatron.model.build import build_model, transformer_config
    from tests.megatron import _reco

    parallel = ParallelConfig(tensor_model_parallel_size=world_size, sequence_parallel=sp)
    initialize_parallel(parallel, seed=1)
    out = {}
    state = None
    for backend in ("local", "torch"):
        model = _reco.model_config(
            hidden_size=8 * heads,
            num_attention_heads=heads,
            num_query_groups=groups,
            attention_backend=backend,
        )
        config = transformer_config(model, parallel, on_gpu=False)
        torch.manual_seed(7)
        gpt = build_model(model, config, pre_process=True, post_process=True, on_gpu=False)
        kinds = {type(m).__name__ for m in gpt.modules()}
        want = "DotProductAttention" if backend == "local" else "TorchDotProductAttention"
        assert want in kinds, kinds
        gpt = gpt.double()
        if state is None:
            state = gpt.state_dict()
        gpt.load_state_dict(state)
        gen = torch.Generator().manual_seed(3)
        tokens = torch.randint(0, _reco.VOCAB, (2, 12), generator=gen)
        positions = torch.arange(12).expand(2, -1)
        logits = gpt(tokens, positions, None)  # [b, s, V/TP]
        weight = torch.randn(logits.shape, generator=gen, dtype=logits.dtype)
        (logits * weight).sum().backward()
        if sp:  # the norms' sequence-parallel gradients are summed over TP by DDP; here by hand
            for p in gpt.parameters():
                if getattr(p, "sequence_parallel", False):
                    torch.distributed.all_reduce(p.grad, group=ps.get_tensor_model_parallel_group())
        grads = {key: gather_tp(p.grad, name) for name, key, p in global_names(gpt)}
        out[backend] = (logits.detach(), grads)
    return out


@pytest.mark.dist
@pytest.mark.parametrize(
    ("tp", "heads", "groups", "sp"),
    [(1, 32, 8, False), (1, 4, 2, False), (2, 32, 8, True), (2, 4, 2, True)],
    ids=["tp1-32:8", "tp1-4:2", "tp2-sp-32:8", "tp2-sp-4:2"],
)
def test_model_with_torch_attention_equals_local_in_fp64(tp, heads, groups, sp) -> None:
    for res in run_distributed(_model_body, tp, args=(heads, groups, sp), timeout=180):
        (logits0, grads0), (logits1, grads1) = res["local"], res["torch"]
        torch.testing.assert_close(logits1, logits0, atol=ATOL, rtol=0)
        assert grads1.keys() == grads0.keys()
        for key, g0 in grads0.items():
            torch.testing.assert_close(grads1[key], g0, atol=ATOL, rtol=0, msg=key)


def test_packed_rows_equal_each_sequence_alone() -> None:
    """THD ``[T, h, d]`` with segments of 5, 1, 7 and a padded tail of 3 (owned by the last
    segment, as ``packing.pack_layout`` makes it): each segment's output and gradients equal
    that sequence run alone through the padded path of the same module."""
    config = _config(4, 2)
    attention = TorchDotProductAttention(config, 1, _Causal(), "self", pg_collection=_TP(1))
    lengths, tail = (5, 1, 7), 3
    total = sum(lengths) + tail
    cu = torch.tensor([0, 5, 6, total], dtype=torch.int32)
    params = types.SimpleNamespace(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(total, 4, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(total, 2, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    v = torch.randn(total, 2, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    out = attention(q, k, v, None, packed_seq_params=params)
    assert out.shape == (total, 32)
    grad = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    grad[-tail:] = 0  # the padded tail carries no loss (it sees the last sequence's keys)
    out.backward(grad)
    for s, e in ((0, 5), (5, 6), (6, 13)):
        leaves = [x.detach()[s:e].unsqueeze(1).requires_grad_() for x in (q, k, v)]
        alone = attention(*leaves, None)  # [n, 1, 32]
        alone.backward(grad[s:e].unsqueeze(1))
        torch.testing.assert_close(out[s:e], alone[:, 0], atol=ATOL, rtol=0)
        for packed, single in zip((q, k, v), leaves, strict=True):
            torch.testing.assert_close(packed.grad[s:e], single.grad[:, 0], atol=ATOL, rtol=0)


class _Causal:
    name = "causal"


def test_backend_choice_and_refusals() -> None:
    assert resolve_attention_backend("auto", on_gpu=False, te_importable=False) == "torch"
    assert resolve_attention_backend("auto", on_gpu=True, te_importable=False) == "torch"
    assert resolve_attention_backend("auto", on_gpu=True, te_importable=True) == "te"
    assert resolve_attention_backend("local", on_gpu=True, te_importable=True) == "local"
    with pytest.raises(ValueError, match=r"model\.attention_backend=te but the model runs on CPU"):
        resolve_attention_backend("te", on_gpu=False, te_importable=True)
    with pytest.raises(ValueError, match="transformer-engine is not importable"):
        resolve_attention_backend("te", on_gpu=True, te_importable=False)
    with pytest.raises(ValueError, match="got 'flash'"):
        resolve_attention_backend("flash", on_gpu=False, te_importable=False)
    bad = types.SimpleNamespace(**{**vars(_config(4, 2)), "context_parallel_size": 2})
    with pytest.raises(ValueError, match="context_parallel_size=2 needs transformer-engine"):
        TorchDotProductAttention(bad, 1, _Causal(), "self", pg_collection=_TP(1))
    drop = types.SimpleNamespace(**{**vars(_config(4, 2)), "attention_dropout": 0.1})
    with pytest.raises(ValueError, match="attention dropout"):
        TorchDotProductAttention(drop, 1, _Causal(), "self", pg_collection=_TP(1))
