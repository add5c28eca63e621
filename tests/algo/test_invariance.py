"""Micro-batch invariance: 1x8 == 8x1 == 2x4 for the summed loss and gradient.

With the global token / sequence counts passed in, each micro-batch returns its contribution,
so sums over any split equal the full-batch value. fp64: only summation order differs, 1e-12.
"""

import pytest
import torch

from reco_megatron.algo import LossConfig, TokenStats, policy_loss, response_weights

F64 = torch.float64
B, T, G = 8, 6, 4


def _data() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    logp_old = -torch.rand(B, T, generator=g, dtype=F64) * 2
    mask = (torch.rand(B, T, generator=g) > 0.3).long()
    mask[3] = 0  # an empty response in the batch
    lengths_differ = mask.sum(1)
    assert len(set(lengths_differ.tolist())) > 2
    return dict(
        logp=(logp_old + 0.4 * torch.randn(B, T, generator=g, dtype=F64)).clamp(max=-1e-3),
        logp_old=logp_old,
        ref=logp_old + 0.1 * torch.randn(B, T, generator=g, dtype=F64),
        mask=mask,
        adv=torch.randn(B, generator=g, dtype=F64),
        ent=torch.rand(B, T, generator=g, dtype=F64),
        s2=torch.rand(B, T, generator=g, dtype=F64) * 0.5,
        s2_old=torch.rand(B, T, generator=g, dtype=F64) * 0.5,
        # shared openings of 1-3 tokens within each group (prefix_empirical < 1 there)
        ids=torch.where(
            torch.arange(T) < 1 + torch.arange(B).unsqueeze(1) % 3,
            torch.arange(T),
            100 + torch.arange(B).unsqueeze(1),
        ),
    )


def _split_loss_and_grad(cfg: LossConfig, d: dict, num_micro: int):
    # Weights per complete group, before the split (as the trainer must do).
    w = response_weights(
        d["logp_old"], d["mask"], G, cfg.response_weight, response_ids=d["ids"]
    ).double()
    assert cfg.response_weight == "none" or (w < 1).any()  # the weights act on this data
    logp = d["logp"].clone().requires_grad_()
    n_tok, n_seq = d["mask"].sum(), B
    total = torch.zeros((), dtype=F64)
    for idx in torch.arange(B).chunk(num_micro):
        lp = logp[idx]
        loss, _ = policy_loss(
            lp,
            d["logp_old"][idx],
            d["adv"][idx],
            d["mask"][idx],
            cfg,
            weights=w[idx],
            stats=TokenStats(lp, d["ent"][idx], d["s2"][idx]),
            stats_old=TokenStats(d["logp_old"][idx], d["ent"][idx], d["s2_old"][idx]),
            ref_logp=d["ref"][idx],
            global_num_tokens=n_tok,
            global_num_seqs=n_seq,
        )
        loss.backward()
        total = total + loss.detach()
    return total, logp.grad


CONFIGS = [
    # the default: trust region on c, eps_c = 0.2 (bites on this data: see test_trust_region_bites)
    pytest.param(dict(objective="reco", token_ratio="bernoulli"), id="reco-bernoulli"),
    pytest.param(
        dict(objective="reco", token_ratio="bernoulli", c_trust=False), id="reco-bernoulli-plain"
    ),
    pytest.param(dict(objective="reco", token_ratio="categorical"), id="reco-categorical"),
    pytest.param(
        dict(objective="ppo_clip", token_ratio="importance", kl_coef=0.1, entropy_coef=0.01),
        id="ppo_clip-kl-entropy",
    ),
    pytest.param(dict(objective="cispo", token_ratio="importance"), id="cispo"),
    # per-token weights [B, T], split with the rows like every per-token tensor
    pytest.param(dict(objective="reco", response_weight="prefix"), id="reco-prefix"),
    pytest.param(
        dict(objective="reco", response_weight="prefix_empirical"), id="reco-prefix_empirical"
    ),
    pytest.param(
        dict(objective="ppo_clip", token_ratio="importance", response_weight="prefix"),
        id="ppo_clip-prefix",
    ),
]


@pytest.mark.parametrize(
    "aggregation", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]
)
@pytest.mark.parametrize("cfg_kw", CONFIGS)
def test_split_invariance(aggregation: str, cfg_kw: dict) -> None:
    cfg = LossConfig(aggregation=aggregation, loss_normalizer=float(T), **cfg_kw)
    d = _data()
    ref_loss, ref_grad = _split_loss_and_grad(cfg, d, 1)
    assert ref_grad.abs().sum() > 0
    for num_micro in (8, 2):  # 8x1 and 2x4
        loss, grad = _split_loss_and_grad(cfg, d, num_micro)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(grad, ref_grad, rtol=1e-12, atol=1e-14)


def test_local_counts_are_not_invariant() -> None:
    # Sanity check of the test itself: without global counts a per-micro-batch mean differs.
    cfg = LossConfig(objective="reco")
    d = _data()
    w = response_weights(d["logp_old"], d["mask"], G, "sequence").double()
    full, _ = policy_loss(d["logp"], d["logp_old"], d["adv"], d["mask"], cfg, weights=w)
    parts = sum(
        policy_loss(d["logp"][i], d["logp_old"][i], d["adv"][i], d["mask"][i], cfg, weights=w[i])[0]
        for i in torch.arange(B).chunk(2)
    )
    assert not torch.allclose(full, parts, rtol=1e-6)


def test_trust_region_bites() -> None:
    """The data of the split tests makes the trust region on c drop tokens (else the
    invariance with the option on would be vacuous)."""
    d = _data()
    cfg = LossConfig(objective="reco", token_ratio="bernoulli")
    w = response_weights(d["logp_old"], d["mask"], G, "sequence").double()
    _, m = policy_loss(d["logp"], d["logp_old"], d["adv"], d["mask"], cfg, weights=w)
    assert float(m["clip_frac_c/mean"]) > 0
