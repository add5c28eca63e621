"""Hypothesis: loss, gradient, weights and advantages stay finite on extreme inputs.

Inputs are fp32 (the production dtype), with probabilities near 0 and 1, long sequences,
large advantages and all-equal rewards. max_examples is modest to keep the suite fast on
2 CPU cores; deadline=None because the first call pays torch's warm-up.
"""

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from reco_megatron.algo import (
    LossConfig,
    TokenStats,
    group_advantages,
    policy_loss,
    response_weights,
)

SETTINGS = settings(max_examples=25, deadline=None)
# log-probs from "certain" (p = 1 - 1e-7) to "impossible" (p = e^-80, and -inf).
LOGP = st.one_of(
    st.floats(min_value=-80.0, max_value=-1e-7),
    st.sampled_from([-1e-7, -1e-3, -17.0, -80.0, -math.inf]),
)


@st.composite
def batches(draw):
    g = draw(st.sampled_from([1, 2, 4]))
    b = g * draw(st.integers(1, 2))
    t = draw(st.sampled_from([1, 3, 512]))
    # Draw a small palette and tile it: long sequences without drawing thousands of floats.
    palette = torch.tensor(draw(st.lists(LOGP, min_size=4, max_size=8)), dtype=torch.float32)
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    idx = torch.randint(0, len(palette), (2, b, t), generator=gen)
    logp, logp_old = palette[idx[0]], palette[idx[1]]
    # The current policy's log-probs come from log_softmax: finite on sampled tokens.
    logp = logp.clamp(min=-80.0)
    mask = (torch.arange(t).expand(b, t) < torch.randint(0, t + 1, (b, 1), generator=gen)).long()
    adv = torch.tensor(draw(st.lists(st.floats(-50, 50), min_size=b, max_size=b)))
    s2 = torch.tensor(draw(st.sampled_from([0.0, 0.5, 1.0 - 1e-7, 1.0]))).expand(b, t)
    return g, logp, logp_old, mask, adv, s2


@SETTINGS
@given(
    data=batches(),
    objective_ratio=st.sampled_from(
        [
            ("reco", "bernoulli"),
            ("reco", "categorical"),
            ("reco", "importance"),
            ("ppo_clip", "importance"),
            ("cispo", "importance"),
        ]
    ),
    weight_mode=st.sampled_from(
        ["sequence", "geometric", "empirical", "prefix", "prefix_empirical", "none"]
    ),
    aggregation=st.sampled_from(["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]),
    clamps=st.sampled_from([(None, None), (3.0, 10.0)]),
)
def test_loss_and_grad_finite(data, objective_ratio, weight_mode, aggregation, clamps) -> None:
    g, logp, logp_old, mask, adv, s2 = data
    objective, ratio = objective_ratio
    cfg = LossConfig(
        objective=objective,
        token_ratio=ratio,
        response_weight=weight_mode,
        aggregation=aggregation,
        loss_normalizer=512.0,
        dual_clip_c=clamps[0],
        kl_clamp=clamps[1],
        kl_coef=0.1,
        entropy_coef=0.01,
    )
    ids = (logp_old * 7).nan_to_num(neginf=-1).long()
    w = response_weights(logp_old, mask, g, weight_mode, response_ids=ids)
    assert torch.isfinite(w).all() and (w > 0).all()
    lp = logp.clone().requires_grad_()
    zero = torch.zeros_like(logp)
    loss, metrics = policy_loss(
        lp,
        logp_old,
        adv,
        mask,
        cfg,
        weights=w,
        stats=TokenStats(lp, zero + 1.0, s2),
        stats_old=TokenStats(logp_old, zero, s2.flip(0)),
        ref_logp=logp_old,
    )
    loss.backward()
    assert torch.isfinite(loss), loss
    assert torch.isfinite(lp.grad).all()
    assert (lp.grad[~mask.bool()] == 0).all()
    bad = {k: v for k, v in metrics.items() if not torch.isfinite(v)}
    assert not bad, bad


@SETTINGS
@given(
    g=st.sampled_from([1, 2, 8]),
    groups=st.integers(1, 3),
    value=st.floats(-1e6, 1e6),
    mode=st.sampled_from(["grpo", "dr_grpo", "rloo"]),
)
def test_all_equal_rewards_zero_advantage(g, groups, value, mode) -> None:
    adv, metrics = group_advantages(torch.full((g * groups,), value), g, mode)
    assert torch.equal(adv, torch.zeros(g * groups))
    assert metrics["zero_adv_groups/sum"].item() == groups


@SETTINGS
@given(
    rewards=st.lists(st.floats(-1e3, 1e3), min_size=8, max_size=8),
    mode=st.sampled_from(["grpo", "dr_grpo", "rloo"]),
)
def test_advantages_finite_and_centred(rewards, mode) -> None:
    adv, _ = group_advantages(torch.tensor(rewards, dtype=torch.float64), 4, mode)
    assert torch.isfinite(adv).all()
    # Every mode centres within the group (rloo is a rescaled centring).
    sums = adv.view(2, 4).sum(1)
    assert torch.allclose(
        sums, torch.zeros(2, dtype=torch.float64), atol=1e-6 * (1 + adv.abs().max())
    )
