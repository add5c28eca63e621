"""Token-budget micro-batches and balanced data-parallel ranks train exactly like the fixed split.

Every run starts from copies of one set of weights and trains on the same global rollout batch
(8 groups x 4 responses with long-tailed lengths, 2 mini-batches, so the second optimizer step
runs with theta != theta_old): the old-policy pass, both updates' losses and metrics, and the
parameters after the two updates must equal the fixed split (2 sequences per micro-batch, every
micro-batch at the batch's length) in one process.

With a budget of 64 tokens and lengths rounded up to 4 the micro-batches hold 2 to 16 rows
at 4 to 28 positions, so rows are regrouped, cut short and reordered; at DP 2 the ranks also
exchange groups and split micro-batches to run the same count. Tolerances as in
``test_reco_step`` (fp32 summation order, passed through Adam with eps 1e-3 over two steps):
parameters 2e-5, losses 1e-5. The global response-token count (the loss's denominator) must be
equal exactly: a dropped or duplicated sequence changes it.
"""

from __future__ import annotations

import pytest
import torch

from reco_megatron.megatron.step.microbatching import needed_lengths
from reco_megatron.parallel.batch import RolloutBatch
from reco_megatron.testing import run_distributed
from tests.megatron import _reco

pytestmark = pytest.mark.dist

PARAM_ATOL = 2e-5
LOSS_ATOL = 1e-5
GROUPS, LENGTH, BUDGET, MULTIPLE = 8, 28, 64, 4


def long_tailed_batch(seed: int = 11) -> RolloutBatch:
    """8 groups x 4: prompts of 3-5 tokens, response lengths lognormal (median ~4, up to 24)."""
    gen = torch.Generator().manual_seed(seed)
    b = GROUPS * _reco.GROUP
    tokens = torch.randint(1, _reco.VOCAB, (b, LENGTH), generator=gen)
    mask = torch.zeros(b, LENGTH)
    draws = torch.exp(1.4 + 0.9 * torch.randn(b, generator=gen))
    for i in range(b):
        start = 3 + i % 3
        end = min(LENGTH, start + max(1, int(draws[i])))
        mask[i, start:end] = 1.0
        tokens[i, end:] = 0
    return RolloutBatch(
        tokens=tokens,
        response_mask=mask,
        advantages=torch.randn(b, generator=gen),
        group_size=_reco.GROUP,
        rollout_logprobs=-torch.rand(b, LENGTH - 1, generator=gen),
    )


def _digests(batch: RolloutBatch) -> list[int]:
    """One hash per row of its tokens up to the last response token (any cut of the padding
    leaves it unchanged)."""
    needed = needed_lengths(batch.loss_mask)
    return [hash(tuple(row[: n + 1].tolist())) for row, n in zip(batch.tokens, needed, strict=True)]


def _body(rank, world_size, tp, pp, reference, update, sp=False):
    engine = _reco.build_engine(tp=tp, pp=pp, micro_batch_size=2, sequence_parallel=sp, **update)
    if reference is None:
        return _reco.full_params(engine)
    _reco.load_full(engine, reference)
    batch = _reco.dp_share(long_tailed_batch())
    prepared, prep = engine.prepare(batch)
    steps = engine.train_on_rollout(prepared)
    return {
        "params": _reco.gather_stages(_reco.full_params(engine)),
        "steps": [engine.broadcast_metrics(m) for m in steps],
        "prep": engine.broadcast_metrics(prep),
        "rows": _digests(prepared),
        "plan_lengths": engine.last_plan.lengths,
    }


BUDGET_UPDATE = {"max_tokens_per_microbatch": BUDGET, "microbatch_length_multiple": MULTIPLE}


@pytest.fixture(scope="module")
def reference_weights() -> dict[str, torch.Tensor]:
    return run_distributed(_body, 1, args=(1, 1, None, {}), timeout=120)[0]


@pytest.fixture(scope="module")
def fixed(reference_weights) -> dict:
    return run_distributed(_body, 1, args=(1, 1, reference_weights, {}), timeout=120)[0]


def _compare(got: dict, want: dict) -> None:
    assert got["params"].keys() == want["params"].keys()
    for name, value in want["params"].items():
        torch.testing.assert_close(got["params"][name], value, atol=PARAM_ATOL, rtol=0, msg=name)
    for got_step, want_step in zip(got["steps"], want["steps"], strict=True):
        # every response token counted once: the global denominator is an exact integer
        assert got_step["loss_denominator"] == want_step["loss_denominator"]
        for key in ("loss", "clip_frac", "entropy", "token_ratio_max", "weight_mean"):
            assert got_step[key] == pytest.approx(want_step[key], abs=LOSS_ATOL), key
    for key in ("old_entropy", "logprob_mismatch", "num_response_tokens"):
        assert got["prep"][key] == pytest.approx(want["prep"][key], abs=LOSS_ATOL), key


LAYOUTS = {"tp1": (1, 1, 1), "tp2": (2, 1, 1), "pp2": (1, 2, 1), "dp2": (1, 1, 2)}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_token_budget_equals_the_fixed_split(layout, reference_weights, fixed) -> None:
    tp, pp, dp = LAYOUTS[layout]
    results = run_distributed(
        _body, tp * pp * dp, args=(tp, pp, reference_weights, BUDGET_UPDATE), timeout=180
    )
    for res in results:
        _compare(res, fixed)
        steps = res["steps"]
        assert all(m["tokens_computed"] < 0.7 * fixed["steps"][0]["tokens_computed"] for m in steps)
        assert all(m["rank_tokens_max"] <= BUDGET * m["microbatches"] for m in steps)
        assert all(length % MULTIPLE == 0 for length in res["plan_lengths"])
    if dp == 2:
        # both ranks hold whole groups of the same global mini-batches, none twice, none lost
        full = sorted(_digests(long_tailed_batch()))
        assert sorted(results[0]["rows"] + results[1]["rows"]) == full
        half = len(full) // 4  # rows per rank per mini-batch
        for k in range(2):
            got = (
                results[0]["rows"][k * half : (k + 1) * half]
                + results[1]["rows"][k * half : (k + 1) * half]
            )
            want = _digests(long_tailed_batch())[k * 2 * half : (k + 1) * 2 * half]
            assert sorted(got) == sorted(want), f"global mini-batch {k} changed"
        prep = results[0]["prep"]
        assert prep["balance_tokens_max"] - prep["balance_tokens_min"] <= (
            prep["balance_tokens_max_before"] - prep["balance_tokens_min_before"]
        )


def test_tp2_with_sequence_parallel_rounds_lengths_to_tp(reference_weights, fixed) -> None:
    update = {**BUDGET_UPDATE, "microbatch_length_multiple": 1}  # TP 2 alone decides: even
    results = run_distributed(
        _body, 2, args=(2, 1, reference_weights, update), kwargs={"sp": True}, timeout=180
    )
    for res in results:
        _compare(res, fixed)
        assert all(length % 2 == 0 for length in res["plan_lengths"])
