"""One ReCo rollout update (old-policy pass + 2 optimizer steps) under TP, PP and DP.

Every layout trains the same tiny model (copied from one set of reference weights) on the same
global rollout batch: 4 groups x 4 responses, right-padded, 2 mini-batches so that the second
optimizer step runs with theta != theta_old and ReCo's token ratio c != 1. The losses and the
parameters after both steps must equal the single-process run.

Tolerances: TP splits matmuls (row-parallel partial sums are all-reduced) and DP splits the
gradient sum (reduce-scatter); both change the fp32 summation order, ~1e-7 relative on values
of order 1. Adam (eps 1e-3, see ``_reco.build_engine``) passes that on with a Lipschitz
constant lr/eps = 10, and two steps compound it: parameters agree to 2e-5, losses to 1e-5.
"""

from __future__ import annotations

import pytest
import torch

from reco_megatron.algo import LossConfig
from reco_megatron.testing import run_distributed
from tests.megatron import _reco

pytestmark = pytest.mark.dist

PARAM_ATOL = 2e-5
LOSS_ATOL = 1e-5


def _shared_openings(batch):
    """Row 2 of each group opens like rows 0 and 1 (identical) for its first response tokens,
    then goes its own way: per-token ``prefix_empirical`` weights of 1/3, 1/2 and 1."""
    tokens, mask = batch.tokens.clone(), batch.response_mask.clone()
    g = batch.group_size
    tokens[2::g, :8] = tokens[0::g, :8]
    mask[2::g, :8] = mask[0::g, :8]
    mask[2::g, 3:10] = 1.0  # contiguous response
    return type(batch)(
        tokens=tokens,
        response_mask=mask,
        advantages=batch.advantages,
        group_size=g,
        rollout_logprobs=batch.rollout_logprobs,
    )


def _update_body(
    rank, world_size, tp, pp, mbs, reference, preset, family="llama", fused=False, weight=None
):
    # a narrow trust region on c (eps_c 0.05) so that it masks tokens on the second step and
    # every layout must agree on which
    loss = LossConfig.preset(preset, kl_coef=0.0, c_trust_eps=0.05)
    if weight is not None:
        loss = LossConfig.preset(preset, kl_coef=0.0, c_trust_eps=0.05, response_weight=weight)
    model = _reco.model_config(family, tie_word_embeddings=family == "qwen2")
    engine = _reco.build_engine(
        tp=tp, pp=pp, micro_batch_size=mbs, loss=loss, model=model, fused_output_layer=fused
    )
    if reference is None:
        return _reco.full_params(engine)
    _reco.load_full(engine, reference)
    batch = _reco.rollout_batch()
    batch = _reco.dp_share(batch if weight is None else _shared_openings(batch))
    prepared, prep_metrics = engine.prepare(batch)
    steps = engine.train_on_rollout(prepared)
    return {
        "params": _reco.gather_stages(_reco.full_params(engine)),
        "steps": [engine.broadcast_metrics(m) for m in steps],
        "prep": engine.broadcast_metrics(prep_metrics),
    }


@pytest.fixture(scope="module")
def reference_weights() -> dict[str, torch.Tensor]:
    return run_distributed(_update_body, 1, args=(1, 1, 2, None, "reco"), timeout=120)[0]


@pytest.fixture(scope="module")
def single(reference_weights) -> dict:
    return run_distributed(_update_body, 1, args=(1, 1, 2, reference_weights, "reco"), timeout=120)[
        0
    ]


def _compare(got: dict, want: dict) -> None:
    assert got["params"].keys() == want["params"].keys()
    for name, value in want["params"].items():
        torch.testing.assert_close(got["params"][name], value, atol=PARAM_ATOL, rtol=0, msg=name)
    for got_step, want_step in zip(got["steps"], want["steps"], strict=True):
        for key in (
            "loss",
            "clip_frac",
            "clip_frac_c",
            "entropy",
            "token_ratio_max",
            "weight_mean",
        ):
            assert got_step[key] == pytest.approx(want_step[key], abs=LOSS_ATOL), key


LAYOUTS = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 2, 1), (2, 1, 2)]


@pytest.mark.parametrize(
    ("tp", "pp", "dp"), LAYOUTS[1:], ids=[f"tp{t}pp{p}dp{d}" for t, p, d in LAYOUTS[1:]]
)
def test_layout_equals_single_process(tp, pp, dp, reference_weights, single) -> None:
    results = run_distributed(
        _update_body, tp * pp * dp, args=(tp, pp, 2, reference_weights, "reco"), timeout=180
    )
    for res in results:
        _compare(res, single)


def test_update_moves_weights_and_token_ratio_acts_on_second_step(reference_weights, single):
    first, second = single["steps"]
    # theta == theta_old at the first mini-batch: both ratios are exactly 1, nothing clipped.
    assert first["ratio_max"] == 1.0 and first["token_ratio_max"] == 1.0
    assert first["clip_frac"] == 0.0
    # After one step the Bernoulli ratio differs from 1 somewhere.
    assert second["token_ratio_max"] != 1.0
    assert first["clip_frac_c"] == 0.0 and second["clip_frac_c"] > 0.0
    moved = max(
        float((single["params"][k] - reference_weights[k]).abs().max()) for k in reference_weights
    )
    assert moved > 1e-3, "the two optimizer steps did not move the weights"


@pytest.mark.parametrize(("tp", "pp"), [(1, 1), (2, 1), (1, 2)], ids=["tp1", "tp2", "pp2"])
def test_fused_output_layer_equals_the_unfused_update(tp, pp, reference_weights, single) -> None:
    # update.fused_output_layer: the model returns hidden states and the loss layer runs the
    # output layer fused with the statistics (parallel.linear_stats); the old-policy pass, the
    # losses and the parameters after two steps must equal the unfused single-process run.
    results = run_distributed(
        _update_body,
        tp * pp,
        args=(tp, pp, 2, reference_weights, "reco"),
        kwargs={"fused": True},
        timeout=180,
    )
    for res in results:
        _compare(res, single)


@pytest.mark.parametrize("mbs", [1, 8], ids=["8x1", "1x8"])
def test_micro_batching_does_not_change_the_update(mbs, reference_weights, single) -> None:
    # Each mini-batch holds 8 sequences: 8 micro-batches of 1, or 1 of 8, vs 4 of 2.
    res = run_distributed(
        _update_body, 1, args=(1, 1, mbs, reference_weights, "reco"), timeout=120
    )[0]
    _compare(res, single)


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_qwen2_family_tied_embeddings_and_qkv_bias(tp, pp) -> None:
    # Qwen2: bias on the QKV projection (sharded with it) and tied input/output embeddings
    # (with PP the first and last stage hold copies kept in sync by megatron's embedding group).
    ref = run_distributed(_update_body, 1, args=(1, 1, 2, None, "reco", "qwen2"), timeout=120)[0]
    assert any(k.endswith("linear_qkv.bias") for k in ref)
    assert not any(k.startswith("output_layer") for k in ref)
    want = run_distributed(_update_body, 1, args=(1, 1, 2, ref, "reco", "qwen2"), timeout=120)[0]
    got = run_distributed(
        _update_body, tp * pp, args=(tp, pp, 2, ref, "reco", "qwen2"), timeout=180
    )
    for res in got:
        _compare(res, want)


@pytest.fixture(scope="module")
def single_prefix(reference_weights) -> dict:
    res = run_distributed(
        _update_body,
        1,
        args=(1, 1, 2, reference_weights, "reco"),
        kwargs={"weight": "prefix_empirical"},
        timeout=120,
    )[0]
    # the per-token weights act on this batch (rows 0, 1 and the opening of row 2 of each
    # group), so that the layouts must agree on [B, S] weights, not on ones
    for step in res["steps"]:
        assert 0.0 < step["weight_active_tokens"] < step["weight_active"] < 1.0, step
    return res


@pytest.mark.parametrize(
    ("tp", "pp", "dp", "mbs"),
    [(2, 1, 1, 2), (1, 2, 1, 2), (1, 1, 2, 2), (1, 1, 1, 1)],
    ids=["tp2", "pp2", "dp2", "8x1"],
)
def test_per_token_prefix_weights_equal_single_process(
    tp, pp, dp, mbs, reference_weights, single_prefix
) -> None:
    # per-token weights [B, S] computed on complete groups in the old-policy pass, then cut
    # with the rows into DP shares and micro-batches: every layout trains the same update
    results = run_distributed(
        _update_body,
        tp * pp * dp,
        args=(tp, pp, mbs, reference_weights, "reco"),
        kwargs={"weight": "prefix_empirical"},
        timeout=180,
    )
    for res in results:
        _compare(res, single_prefix)
        for got, want in zip(res["steps"], single_prefix["steps"], strict=True):
            assert got["weight_active_tokens"] == pytest.approx(want["weight_active_tokens"])
