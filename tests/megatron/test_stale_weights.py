"""The engine's old-policy pass weighs responses by the policy that sampled them.

``ReCoEngine(response_weight_policy="behaviour")`` reads the rollout engine's log-probs mu
(``RolloutBatch.rollout_logprobs``) for the response weights, ``proximal`` the old-policy pass
(pi_old). One tiny engine (TP 1, one gloo process) prepares one batch both ways. The batch's
mu is near 0 (probable tokens) so the ``sequence`` weights act; the untrained model's pi_old
(about -log 100 per token) gives weight 1 everywhere. Tolerance of the hand formula: the
weights are fp32, relative 2^-23 (one rounding).
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from reco_megatron.algo import LossConfig
from reco_megatron.testing import run_distributed
from tests.megatron import _reco

pytestmark = pytest.mark.dist


def _prepare_body(rank, world_size):
    loss = LossConfig.preset("reco", kl_coef=0.0)
    batch = _reco.rollout_batch()
    gen = torch.Generator().manual_seed(7)
    mu = -0.02 * torch.rand(batch.rollout_logprobs.shape, generator=gen)
    mu = torch.where(batch.loss_mask.bool(), mu, torch.tensor(float("nan")))  # junk padding
    batch = replace(batch, rollout_logprobs=mu)
    out = {}
    for policy in ("proximal", "behaviour"):
        engine = _reco.build_engine(loss=loss, response_weight_policy=policy)
        prepared, _ = engine.prepare(batch)
        out[policy] = (prepared.weights, prepared.old_logprobs)
    try:
        engine.prepare(replace(batch, rollout_logprobs=None))
    except ValueError as err:
        out["missing"] = str(err)
    try:
        _reco.build_engine(loss=loss, response_weight_policy="auto")
    except ValueError as err:
        out["unresolved"] = str(err)
    out["mask"], out["mu"] = batch.loss_mask, mu
    return out


def _hand(lp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``1 / max(1, G exp(sum_t m log p))`` per response, in Python floats."""
    g = _reco.GROUP
    rows = []
    for i in range(lp.shape[0]):
        s = sum(float(lp[i, t]) for t in range(lp.shape[1]) if mask[i, t] > 0)
        rows.append(1.0 / max(1.0, g * math.exp(s)))
    return torch.tensor(rows, dtype=torch.float64)


def test_behaviour_weights_read_the_rollout_log_probs() -> None:
    got = run_distributed(_prepare_body, 1, timeout=180)[0]
    mask = got["mask"]
    w_beh, old_beh = got["behaviour"]
    w_prox, old_prox = got["proximal"]
    assert torch.equal(old_beh, old_prox)  # the old-policy pass does not depend on it
    torch.testing.assert_close(w_beh.double(), _hand(got["mu"], mask), atol=0, rtol=2.0**-23)
    torch.testing.assert_close(w_prox.double(), _hand(old_prox, mask), atol=0, rtol=2.0**-23)
    assert torch.isfinite(w_beh).all() and (w_beh < 1).all()
    assert torch.equal(w_prox, torch.ones_like(w_prox))
    assert "no rollout_logprobs" in got["missing"]
    assert "response_weight_policy=proximal" in got["missing"]
    assert "got 'auto'" in got["unresolved"]
