"""Packed sequences (THD) bookkeeping on CPU, against the padded path.

The model here is a small reference transformer layer whose attention honours the segment
boundaries given by ``cu_seqlens`` (block-diagonal causal mask) and whose positions come from
the position ids. Packing the micro-batch, running the packed row, and unpacking the
per-token statistics must give the same statistics, loss, metrics and parameter gradients as
the right-padded rows: that checks the segment boundaries, the restarted positions, the label
alignment and the unpacking. The glue test runs the engine's packed ``forward_step`` with
megatron-core's ``PackedSeqParams``; ``test_packed_engine`` runs the whole engine packed.
Tolerance 1e-6: the same fp32 math in a different memory layout (softmax over masked keys).
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from reco_megatron.algo import LossConfig
from reco_megatron.megatron.step.loss_layer import (
    LossContext,
    make_forward_step,
    policy_loss_func,
    statistics_func,
)
from reco_megatron.megatron.step.microbatching import needed_lengths, take_rows
from reco_megatron.megatron.step.packing import (
    PackedLabels,
    PackedMicroBatch,
    make_packed_forward_step,
    pack_layout,
    packing_available,
)
from reco_megatron.parallel.batch import RolloutBatch

VOCAB, HIDDEN, ATOL = 40, 16, 1e-6


class ReferenceModel(torch.nn.Module):
    """Embedding + learned positions, one attention layer that attends only inside a segment
    and causally, and an output layer. ``forward(input_ids [b, s], position_ids [b, s], mask,
    packed_seq_params=None)`` like megatron's ``GPTModel``: segments from
    ``packed_seq_params.cu_seqlens_q`` when given, else one segment per row."""

    def __init__(self, fused: bool = False) -> None:
        super().__init__()
        self.fused = fused  # return the hidden states (update.fused_output_layer)
        gen = torch.Generator().manual_seed(0)
        self.emb = torch.nn.Parameter(torch.randn(VOCAB, HIDDEN, generator=gen) * 0.5)
        self.pos = torch.nn.Parameter(torch.randn(64, HIDDEN, generator=gen) * 0.5)
        self.qkv = torch.nn.Parameter(torch.randn(3 * HIDDEN, HIDDEN, generator=gen) * 0.3)
        self.out = torch.nn.Parameter(torch.randn(VOCAB, HIDDEN, generator=gen) * 0.3)

    def forward(self, input_ids, position_ids, attention_mask=None, packed_seq_params=None):
        assert attention_mask is None
        b, s = input_ids.shape
        x = self.emb[input_ids] + self.pos[position_ids]
        q, k, v = (x @ self.qkv.t()).chunk(3, dim=-1)
        segment = torch.zeros(b, s, dtype=torch.long)
        if packed_seq_params is not None:
            cu = packed_seq_params.cu_seqlens_q.long()
            segment = torch.searchsorted(cu[1:], torch.arange(s), right=True).expand(b, s)
        causal = torch.ones(s, s, dtype=torch.bool).tril()
        allowed = causal & (segment[:, :, None] == segment[:, None, :])
        scores = (q @ k.transpose(1, 2)) / math.sqrt(HIDDEN)
        attn = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
        hidden = attn @ v + x  # [b, s, H]
        return hidden if self.fused else hidden @ self.out.t()  # [b, s, V]


def _batch() -> RolloutBatch:
    """6 rows, one group: prompts of 2-4 tokens, responses of 1-9, right-padded to 16."""
    gen = torch.Generator().manual_seed(5)
    b, length = 6, 16
    tokens = torch.randint(1, VOCAB, (b, length), generator=gen)
    mask = torch.zeros(b, length)
    for i, (p, r) in enumerate([(2, 9), (3, 1), (4, 6), (2, 3), (3, 12), (4, 2)]):
        mask[i, p : p + r] = 1.0
        tokens[i, p + r :] = 0
    return RolloutBatch(
        tokens=tokens,
        response_mask=mask,
        advantages=torch.randn(b, generator=gen),
        group_size=b,
        rollout_logprobs=-torch.rand(b, length - 1, generator=gen),
        old_logprobs=-torch.rand(b, length - 1, generator=gen) * 3,
        old_sum_p2=torch.rand(b, length - 1, generator=gen) * 0.3,
        weights=torch.rand(b, generator=gen) + 0.5,
    )


def _ctx() -> LossContext:
    return LossContext(loss=LossConfig.preset("reco", kl_coef=0.0), vocab_size=VOCAB, tp_group=None)


def _micro_batch():
    batch = _batch()
    needed = needed_lengths(batch.loss_mask)
    mb = take_rows(batch, range(batch.num_sequences), max(needed))
    return mb, needed


def test_layout_boundaries_positions_and_label_alignment() -> None:
    mb, needed = _micro_batch()
    layout = pack_layout(needed, multiple=4, row_multiple=8)
    assert layout.starts[0] == 0 and layout.total % 8 == 0
    assert all(
        (e - s) % 4 == 0 or e == layout.total
        for s, e in zip(layout.starts, layout.ends, strict=True)
    )
    cu = layout.cu_seqlens()
    assert cu.dtype == torch.int32 and cu.tolist() == [*layout.starts, layout.total]
    pos = layout.position_ids()[0]
    ids, labels = layout.pack(mb.input_ids)[0], layout.pack(mb.labels)[0]
    for i, (s, n) in enumerate(zip(layout.starts, needed, strict=True)):
        assert pos[s : s + n].tolist() == list(range(n))
        assert torch.equal(ids[s : s + n], mb.input_ids[i, :n])
        # the label at packed position s + t is the sequence's token t + 1
        assert torch.equal(labels[s : s + n], mb.tokens[i, 1 : n + 1])
    # unpacking a packed per-token tensor gives each row its first n_i values back
    back = layout.unpack(layout.pack(mb.loss_mask), mb.seq_length)
    assert torch.equal(back, mb.loss_mask)


def _run(model, mb, needed, loss_func, packed: bool):
    ctx = _ctx()
    if model.fused:
        ctx = replace(ctx, fused_output_layer=True, output_weight=model.out)
    if not packed:
        logits = model(mb.input_ids, _positions(mb), None)
        return loss_func(mb, ctx, logits)
    layout = pack_layout(needed, multiple=4, row_multiple=8)
    params = _Params(layout.cu_seqlens())
    logits = model(layout.pack(mb.input_ids), layout.position_ids(), None, packed_seq_params=params)
    packed_ctx = replace(ctx, packed=PackedLabels(layout.pack(mb.labels), layout))
    return loss_func(mb, packed_ctx, logits)


class _Params:
    def __init__(self, cu):
        self.cu_seqlens_q = self.cu_seqlens_kv = cu


def _positions(mb: RolloutBatch) -> torch.Tensor:
    return torch.arange(mb.seq_length).expand(mb.num_sequences, -1)


def test_packed_statistics_equal_the_padded_ones() -> None:
    model = ReferenceModel()
    mb, needed = _micro_batch()
    with torch.no_grad():
        *_, padded = _run(model, mb, needed, statistics_func, packed=False)
        *_, packed = _run(model, mb, needed, statistics_func, packed=True)
    live = torch.zeros_like(mb.loss_mask, dtype=torch.bool)
    for i, n in enumerate(needed):
        live[i, :n] = True
    for key in ("logprob", "entropy", "sum_p2"):
        assert packed[key].shape == padded[key].shape == mb.labels.shape
        torch.testing.assert_close(packed[key][live], padded[key][live], atol=ATOL, rtol=0)
        assert (packed[key][~live] == 0).all()  # past a sequence's end: nothing computed


@pytest.mark.parametrize("fused", [False, True], ids=["logits", "fused_output_layer"])
def test_packed_loss_metrics_and_gradients_equal_the_padded_ones(fused: bool) -> None:
    mb, needed = _micro_batch()
    with torch.no_grad():  # an old policy close to the model: ratios near 1, inside the clip
        *_, stats = _run(ReferenceModel(), mb, needed, statistics_func, packed=False)
    noise = 0.05 * torch.randn(mb.labels.shape, generator=torch.Generator().manual_seed(1))
    mb = replace(mb, old_logprobs=stats["logprob"] + noise, old_sum_p2=stats["sum_p2"])
    results = []
    for packed in (False, True):
        model = ReferenceModel(fused=fused)
        numerator, count, metrics = _run(model, mb, needed, policy_loss_func, packed)
        numerator.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        results.append((numerator.detach(), count, metrics, grads))
    (n0, c0, m0, g0), (n1, c1, m1, g1) = results
    torch.testing.assert_close(n1, n0, atol=ATOL, rtol=0)
    assert int(c0) == int(c1) == int(mb.loss_mask.sum())
    for key in m0:
        torch.testing.assert_close(m1[key].float(), m0[key].float(), atol=ATOL, rtol=0, msg=key)
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], atol=ATOL, rtol=0, msg=name)
    assert max(float(g.abs().max()) for g in g0.values()) > 1e-3  # the test has teeth


def test_packed_forward_step_glue_with_megatron_packed_seq_params() -> None:
    pytest.importorskip("megatron.core")
    mb, needed = _micro_batch()
    layout = pack_layout(needed, 1, 8)
    device = torch.device("cpu")
    outs = []
    for packed in (False, True):
        model = ReferenceModel()
        if packed:
            step = make_packed_forward_step(policy_loss_func, _ctx(), device, False)
            output, loss = step(iter([PackedMicroBatch(mb, layout)]), model)
            assert output.shape[:2] == (1, layout.total)
        else:
            step = make_forward_step(policy_loss_func, _ctx(), device)
            output, loss = step(iter([mb]), model)
        numerator, _, _ = loss(output)
        numerator.backward()
        outs.append((numerator.detach(), model.qkv.grad.clone()))
    torch.testing.assert_close(outs[1][0], outs[0][0], atol=ATOL, rtol=0)
    torch.testing.assert_close(outs[1][1], outs[0][1], atol=ATOL, rtol=0)


def test_packing_runs_with_torch_and_te_attention_and_is_refused_with_local_in_one_line() -> None:
    assert packing_available("torch") == (True, "")
    assert packing_available("te") == (True, "")
    ok, why = packing_available("local")
    assert not ok and "\n" not in why and "model.attention_backend=local" in why
