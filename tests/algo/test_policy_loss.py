"""policy_loss: hand-computed values for every objective/aggregation, and exact gradients.

Everything runs in fp64 so closed forms hold to rounding (rtol 1e-12).
"""

import math

import pytest
import torch

from reco_megatron.algo import LossConfig, TokenStats, policy_loss

F64 = torch.float64
EXACT = {"rtol": 1e-12, "atol": 1e-14}


def _log(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=F64).log()


# r = p / p_old = [[2, 1], [0.5, 1]]; A = [+1, -1]; token (0,0) is clipped high (A>0, r>1.2),
# token (1,0) clipped low (A<0, r<0.8).
P = [[0.5, 0.3], [0.2, 0.4]]
P_OLD = [[0.25, 0.3], [0.4, 0.4]]
A = [1.0, -1.0]
L = math.log


def _run(cfg: LossConfig, mask=None, weights=None, **kw) -> tuple[torch.Tensor, dict]:
    logp = _log(P).requires_grad_()
    mask = torch.ones(2, 2) if mask is None else torch.tensor(mask)
    w = None if weights is None else torch.tensor(weights, dtype=F64)
    return policy_loss(logp, _log(P_OLD), torch.tensor(A, dtype=F64), mask, cfg, weights=w, **kw)


def _cfg(**kw) -> LossConfig:
    base = dict(response_weight="none", token_ratio="importance", kl_coef=0.0)
    return LossConfig(**{**base, **kw})


@pytest.mark.parametrize(
    ("cfg", "weights", "expected"),
    [
        # -min(rA, clip(r)A): -1.2, -1, +0.8, +1 -> sum -0.4 over 4 tokens.
        pytest.param(_cfg(objective="ppo_clip"), None, -0.4 / 4, id="ppo_clip-grpo"),
        # DAPO eps_high 0.28: token (0,0) -> -1.28.
        pytest.param(
            _cfg(objective="ppo_clip", eps_high=0.28), None, -0.48 / 4, id="ppo_clip-dapo"
        ),
        # weights multiply the per-token loss of each response.
        pytest.param(
            _cfg(objective="ppo_clip"), [0.5, 2.0], (0.5 * -2.2 + 2.0 * 1.8) / 4, id="ppo_clip-w"
        ),
        # reco: clipped tokens give 0; c = 1 on the others (p == p_old there).
        pytest.param(
            _cfg(objective="reco", token_ratio="bernoulli"),
            None,
            (-L(0.3) + L(0.4)) / 4,
            id="reco-bernoulli",
        ),
        pytest.param(
            _cfg(objective="reco", token_ratio="bernoulli", response_weight="sequence"),
            [0.5, 2.0],
            (-0.5 * L(0.3) + 2.0 * L(0.4)) / 4,
            id="reco-bernoulli-weighted",
        ),
        # cispo: sg(min(r, 1.2)) -> 1.2, 1, 0.5, 1 (no lower clip).
        pytest.param(
            _cfg(objective="cispo"),
            None,
            (-1.2 * L(0.5) - L(0.3) + 0.5 * L(0.2) + L(0.4)) / 4,
            id="cispo",
        ),
        # cispo with a lower clip at 1 - 0.2: token (1,0) coefficient 0.8.
        pytest.param(
            _cfg(objective="cispo", cispo_eps_low=0.2),
            None,
            (-1.2 * L(0.5) - L(0.3) + 0.8 * L(0.2) + L(0.4)) / 4,
            id="cispo-lower-clip",
        ),
    ],
)
def test_objective_closed_form(cfg: LossConfig, weights, expected: float) -> None:
    loss, _ = _run(cfg, weights=weights)
    torch.testing.assert_close(loss, torch.tensor(expected, dtype=F64), **EXACT)


def test_dual_clip() -> None:
    # A = -1, r = 4: ppo loss max(4, 1.2) = 4, dual clip at c = 3 -> 3 and no gradient.
    logp = torch.tensor([[math.log(0.8)]], dtype=F64, requires_grad=True)
    lp_old = torch.tensor([[math.log(0.2)]], dtype=F64)
    adv, mask = torch.tensor([-1.0], dtype=F64), torch.ones(1, 1)
    for c, expected, grad in ((None, 4.0, 4.0), (3.0, 3.0, 0.0)):
        logp.grad = None
        loss, _ = policy_loss(logp, lp_old, adv, mask, _cfg(objective="ppo_clip", dual_clip_c=c))
        loss.backward()
        torch.testing.assert_close(loss, torch.tensor(expected, dtype=F64), **EXACT)
        # d/dlogp of -rA = -rA = 4.
        torch.testing.assert_close(logp.grad, torch.tensor([[grad]], dtype=F64), **EXACT)


@pytest.mark.parametrize(
    ("objective", "ratio_mode", "loss_no_dual", "grad_no_dual"),
    [
        # r = e^1.5 = 4.48; ppo_clip: max(rA, clip(r)A) with A = -1 -> loss r, grad r.
        pytest.param("ppo_clip", "importance", math.exp(1.5), math.exp(1.5), id="ppo_clip"),
        # reco: -c A log p = c * (-0.5); d/dlogp = c.
        pytest.param("reco", "importance", -0.5 * math.exp(1.5), math.exp(1.5), id="reco-is"),
        pytest.param("cispo", "importance", -0.5 * 1.2, 1.2, id="cispo"),
    ],
)
def test_dual_clip_issue_example(objective, ratio_mode, loss_no_dual, grad_no_dual) -> None:
    # The issue's token: A = -1, logp_old = -2, logp = -0.5. With dual_clip_c = 3 every
    # objective has gradient 0 there (ppo_clip's loss is the constant -c A = 3, as in verl);
    # before the fix reco and cispo ignored the setting (reco's gradient stayed 4.48).
    logp = torch.tensor([[-0.5]], dtype=F64, requires_grad=True)
    lp_old = torch.tensor([[-2.0]], dtype=F64)
    adv, mask = torch.tensor([-1.0], dtype=F64), torch.ones(1, 1)
    dual_loss = 3.0 if objective == "ppo_clip" else 0.0
    for c, loss_exp, grad_exp in ((None, loss_no_dual, grad_no_dual), (3.0, dual_loss, 0.0)):
        logp.grad = None
        cfg = _cfg(objective=objective, token_ratio=ratio_mode, dual_clip_c=c)
        loss, metrics = policy_loss(logp, lp_old, adv, mask, cfg)
        loss.backward()
        torch.testing.assert_close(loss, torch.tensor(loss_exp, dtype=F64), **EXACT)
        torch.testing.assert_close(logp.grad, torch.tensor([[grad_exp]], dtype=F64), **EXACT)
        assert ("clip_frac_dual/mean" in metrics) == (c is not None)
        if c is not None:
            assert metrics["clip_frac_dual/mean"].item() == 1.0


# Per-token ppo_clip losses [[-1.2, -1], [0.8, 1]] with mask [[1, 1], [1, 0]].
@pytest.mark.parametrize(
    ("aggregation", "extra", "expected"),
    [
        pytest.param("token_mean", {}, (-1.2 - 1 + 0.8) / 3, id="token_mean"),
        pytest.param("seq_mean_token_mean", {}, ((-2.2 / 2) + 0.8) / 2, id="seq_mean_token_mean"),
        pytest.param(
            "seq_mean_token_sum_norm",
            {"loss_normalizer": 4.0},
            (-2.2 / 4 + 0.8 / 4) / 2,
            id="seq_mean_token_sum_norm",
        ),
    ],
)
def test_aggregation_closed_form(aggregation: str, extra: dict, expected: float) -> None:
    cfg = _cfg(objective="ppo_clip", aggregation=aggregation, **extra)
    loss, metrics = _run(cfg, mask=[[1, 1], [1, 0]])
    torch.testing.assert_close(loss, torch.tensor(expected, dtype=F64), **EXACT)
    assert metrics["num_tokens/sum"].item() == 3


def test_global_counts_replace_local() -> None:
    loss, _ = _run(_cfg(objective="ppo_clip"), global_num_tokens=40)
    torch.testing.assert_close(loss, torch.tensor(-0.4 / 40, dtype=F64), **EXACT)
    cfg = _cfg(objective="ppo_clip", aggregation="seq_mean_token_mean")
    loss, _ = _run(cfg, global_num_seqs=20)
    torch.testing.assert_close(loss, torch.tensor((-2.2 / 2 + 1.8 / 2) / 20, dtype=F64), **EXACT)


@pytest.mark.parametrize(
    ("estimator", "per_token"),
    [
        pytest.param("k1", lambda lp, ref: lp - ref, id="k1"),
        pytest.param("k3", lambda lp, ref: math.exp(ref - lp) - (ref - lp) - 1, id="k3"),
    ],
)
def test_kl_term(estimator: str, per_token) -> None:
    ref = [[0.4, 0.3], [0.2, 0.1]]
    cfg = _cfg(objective="ppo_clip", kl_coef=0.5, kl_estimator=estimator)
    loss, metrics = _run(cfg, ref_logp=_log(ref))
    kl = [per_token(L(P[i][j]), L(ref[i][j])) for i in range(2) for j in range(2)]
    torch.testing.assert_close(loss, torch.tensor((-0.4 + 0.5 * sum(kl)) / 4, dtype=F64), **EXACT)
    assert metrics["kl_ref/mean"].item() == pytest.approx(sum(kl) / 4, rel=1e-6)


@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_kl_clamp(estimator: str) -> None:
    # log p = -1, log p_ref = -14: k3 = e^-13 + 13 - 1 ~ 12.0 and k1 = 13 exceed 10; the clamp
    # caps them at 10 with zero gradient (as verl's k3 / NeMo-RL's kl_output_clamp_value); the
    # second token (k3 = e^0.5 - 1.5 ~ 0.149, k1 = -0.5) is untouched.
    logp = torch.tensor([[-1.0, -1.0]], dtype=F64, requires_grad=True)
    ref = torch.tensor([[-14.0, -0.5]], dtype=F64)
    adv, mask = torch.tensor([0.0], dtype=F64), torch.ones(1, 2)
    exact = {"k1": lambda d: -d, "k3": lambda d: math.exp(d) - d - 1}[estimator]
    dk = {"k1": lambda d: 1.0, "k3": lambda d: 1.0 - math.exp(d)}[estimator]  # d KL / d logp
    for clamp in (None, 10.0):
        logp.grad = None
        cfg = _cfg(objective="ppo_clip", kl_coef=1.0, kl_estimator=estimator, kl_clamp=clamp)
        loss, _ = policy_loss(logp, logp.detach(), adv, mask, cfg, ref_logp=ref)
        loss.backward()
        first = exact(-13.0) if clamp is None else 10.0
        torch.testing.assert_close(loss, torch.tensor((first + exact(0.5)) / 2, dtype=F64), **EXACT)
        g0 = dk(-13.0) / 2 if clamp is None else 0.0
        expected = torch.tensor([[g0, dk(0.5) / 2]], dtype=F64)
        torch.testing.assert_close(logp.grad, expected, **EXACT)


def test_entropy_bonus_and_metric() -> None:
    ent = torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=F64)
    stats = TokenStats(logprob=_log(P), entropy=ent, sum_p2=torch.zeros(2, 2, dtype=F64))
    loss, metrics = _run(_cfg(objective="ppo_clip", entropy_coef=0.1), stats=stats)
    torch.testing.assert_close(loss, torch.tensor((-0.4 - 0.1 * 10) / 4, dtype=F64), **EXACT)
    assert metrics["entropy/mean"].item() == pytest.approx(2.5)


@pytest.mark.parametrize(
    ("kwargs", "cfg_kw", "match"),
    [
        pytest.param({}, {"entropy_coef": 0.1}, "entropy_coef=0.1 needs stats=", id="entropy"),
        pytest.param({}, {"kl_coef": 0.1}, "kl_coef=0.1 needs ref_logp=", id="kl"),
        pytest.param({}, {"response_weight": "sequence"}, "needs weights=", id="weights"),
        pytest.param(
            {},
            {"objective": "reco", "token_ratio": "categorical"},
            "needs stats= and stats_old=",
            id="categorical",
        ),
    ],
)
def test_missing_inputs_raise(kwargs: dict, cfg_kw: dict, match: str) -> None:
    cfg_kw = {"objective": "ppo_clip", **cfg_kw}
    with pytest.raises(ValueError, match=match):
        _run(_cfg(**cfg_kw), **kwargs)


def test_metrics_clip_fractions_and_quantiles() -> None:
    _, m = _run(_cfg(objective="reco", token_ratio="bernoulli"))
    assert m["clip_frac_high/mean"].item() == 0.25
    assert m["clip_frac_low/mean"].item() == 0.25
    assert m["clip_frac/mean"].item() == 0.5
    assert m["ratio_max/max"].item() == pytest.approx(2.0)
    assert m["ratio_p50/mean"].item() == pytest.approx(1.0)
    # Bernoulli c: 0.25/0.1875, 1, 0.16/0.24, 1.
    assert m["token_ratio_max/max"].item() == pytest.approx(0.25 / 0.1875)
    assert all(not v.requires_grad for v in m.values())
    assert all(k.rsplit("/", 1)[1] in ("sum", "mean", "min", "max") for k in m)


def test_weight_metrics() -> None:
    _, m = _run(_cfg(objective="ppo_clip"), weights=[0.5, 1.5])
    assert m["weight_mean/mean"].item() == 1.0
    assert m["weight_min/min"].item() == 0.5 and m["weight_max/max"].item() == 1.5
    # ESS = (2)^2 / (0.25 + 2.25) / 2 = 0.8
    assert m["weight_ess/mean"].item() == pytest.approx(0.8)
    assert m["weight_active/mean"].item() == 0.5  # 0.5 < 1 acts, 1.5 does not


def test_padding_inf_does_not_leak() -> None:
    logp = torch.tensor([[-1.0, -math.inf]], dtype=F64, requires_grad=True)
    lp_old = torch.tensor([[-1.2, math.nan]], dtype=F64)
    for objective, ratio in (
        ("ppo_clip", "importance"),
        ("reco", "bernoulli"),
        ("cispo", "importance"),
    ):
        logp.grad = None
        cfg = _cfg(objective=objective, token_ratio=ratio)
        loss, m = policy_loss(
            logp, lp_old, torch.tensor([1.0], dtype=F64), torch.tensor([[1, 0]]), cfg
        )
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(logp.grad).all()
        assert logp.grad[0, 1].item() == 0.0
        assert all(torch.isfinite(v) for v in m.values())
