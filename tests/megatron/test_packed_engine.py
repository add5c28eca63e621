"""Packed rows (``update.sequence_packing``) train exactly like the padded rows, on CPU, through
megatron's model with torch's attention (:mod:`reco_megatron.megatron.model.attention`).

The batch and weights of ``test_token_budget`` (8 groups x 4 responses, long-tailed lengths,
2 mini-batches so the second step runs with theta != theta_old): with a token budget of 64 and
packing on, every micro-batch is one row of several sequences (positions restarting per
sequence for RoPE, attention kept inside each sequence by ``cu_seqlens``), and the old-policy
pass (per-token log-probs and ``sum p^2`` of every sequence), both updates' losses and
metrics, the gradient norms and the parameters after the updates must equal the padded
single-process run with fixed micro-batches, at TP 1, TP 2 with sequence parallelism, and PP 2.
The padded path at PP 2 with megatron's own attention (``local``) must equal the same
single-process run with torch's attention. A control that runs each packed row as one sequence
(attention and RoPE across the boundaries) must differ.

Tolerances as in ``test_token_budget`` (fp32 summation order through Adam with eps 1e-3):
parameters 2e-5, losses and log-probs 1e-5; the loss denominator (an integer) exactly.
"""

from __future__ import annotations

import pytest
import torch

from reco_megatron.testing import run_distributed
from tests.megatron import _reco
from tests.megatron.test_token_budget import BUDGET, long_tailed_batch

pytestmark = pytest.mark.dist

PARAM_ATOL = 2e-5
LOSS_ATOL = 1e-5
PACKED = {"max_tokens_per_microbatch": BUDGET, "microbatch_length_multiple": 1}


def _body(rank, world_size, tp, pp, reference, update, sp=False, joined=False, backend=None):
    model = None if backend is None else _reco.model_config(attention_backend=backend)
    engine = _reco.build_engine(
        tp=tp, pp=pp, micro_batch_size=2, sequence_parallel=sp, model=model, **update
    )
    if reference is None:
        return _reco.full_params(engine)
    if joined:
        _one_segment_per_row()
    _reco.load_full(engine, reference)
    batch = _reco.dp_share(long_tailed_batch())
    prepared, prep = engine.prepare(batch)
    packed = engine.last_plan.packed
    steps = engine.train_on_rollout(prepared)
    return {
        "params": _reco.gather_stages(_reco.full_params(engine)),
        "steps": [engine.broadcast_metrics(m) for m in steps],
        "prep": engine.broadcast_metrics(prep),
        "old_logprobs": prepared.old_logprobs,
        "old_sum_p2": prepared.old_sum_p2,
        "mask": prepared.loss_mask,
        "packed": packed,
        "attention": engine.attention,
        "rows_per_microbatch": [len(r) for r in engine.last_plan.rows],
    }


def _one_segment_per_row() -> None:
    """The control: every packed row as one sequence (``cu_seqlens = [0, T]``), so attention
    and RoPE run across the sequences' boundaries."""
    from reco_megatron.megatron.step import packing

    def cu_seqlens(self, device="cpu"):
        return torch.tensor([0, self.total], dtype=torch.int32, device=device)

    packing.PackedLayout.cu_seqlens = cu_seqlens
    packing.PackedLayout.max_seqlen = property(lambda self: self.total)


@pytest.fixture(scope="module")
def reference_weights() -> dict[str, torch.Tensor]:
    return run_distributed(_body, 1, args=(1, 1, None, {}), timeout=120)[0]


@pytest.fixture(scope="module")
def padded(reference_weights) -> dict:
    return run_distributed(_body, 1, args=(1, 1, reference_weights, {}), timeout=120)[0]


def _compare(got: dict, want: dict) -> None:
    mask = want["mask"].bool()
    for key in ("old_logprobs", "old_sum_p2"):  # every sequence's per-token statistics
        if got[key] is None:  # pipeline stages before the last compute none
            continue
        gap = float((got[key] - want[key]).abs()[mask].max())
        assert gap < LOSS_ATOL, f"{key}: {gap}"
    assert got["params"].keys() == want["params"].keys()
    for name, value in want["params"].items():
        torch.testing.assert_close(got["params"][name], value, atol=PARAM_ATOL, rtol=0, msg=name)
    for got_step, want_step in zip(got["steps"], want["steps"], strict=True):
        assert got_step["loss_denominator"] == want_step["loss_denominator"]
        for key in ("loss", "clip_frac", "entropy", "token_ratio_max", "weight_mean", "kl_old_new"):
            if key in want_step:
                assert got_step[key] == pytest.approx(want_step[key], abs=LOSS_ATOL), key
        assert got_step["grad_norm"] == pytest.approx(want_step["grad_norm"], rel=1e-5)
    for key in ("old_entropy", "logprob_mismatch", "num_response_tokens"):
        assert got["prep"][key] == pytest.approx(want["prep"][key], abs=LOSS_ATOL), key


LAYOUTS = {"tp1": (1, 1, False), "tp2_sp": (2, 1, True), "pp2": (1, 2, False)}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_packed_rows_equal_the_padded_run(layout, reference_weights, padded) -> None:
    tp, pp, sp = LAYOUTS[layout]
    update = {**PACKED, "sequence_packing": True}
    results = run_distributed(
        _body, tp * pp, args=(tp, pp, reference_weights, update), kwargs={"sp": sp}, timeout=240
    )
    assert results[-1]["old_logprobs"] is not None  # the last stage's statistics compared
    for res in results:
        assert res["attention"] == "torch"
        assert res["packed"] and max(res["rows_per_microbatch"]) > 1  # several per row
        _compare(res, padded)


def test_megatron_local_attention_at_pp2_equals_the_torch_reference(
    reference_weights, padded
) -> None:
    """The padded path at PP 2 with megatron's own ``DotProductAttention`` (``local``) trains
    like the single-process run with torch's attention: the two attentions agree across a
    pipeline split too (the fp64 comparison of ``test_torch_attention`` runs at TP 1 and 2)."""
    assert padded["attention"] == "torch"
    results = run_distributed(
        _body, 2, args=(1, 2, reference_weights, {}), kwargs={"backend": "local"}, timeout=240
    )
    assert results[-1]["old_logprobs"] is not None
    for res in results:
        assert res["attention"] == "local" and not res["packed"]
        _compare(res, padded)


def test_without_the_sequence_boundaries_it_differs(reference_weights, padded) -> None:
    update = {**PACKED, "sequence_packing": True}
    res = run_distributed(
        _body, 1, args=(1, 1, reference_weights, update), kwargs={"joined": True}, timeout=120
    )[0]
    with pytest.raises(AssertionError):
        _compare(res, padded)
