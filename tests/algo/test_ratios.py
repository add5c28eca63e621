"""Token ratios: closed forms, c == 1 at the old policy, clamps and caps."""

import math

import pytest
import torch

from reco_megatron.algo import token_ratio


def _lp(*ps: float) -> torch.Tensor:
    return torch.tensor([math.log(p) for p in ps], dtype=torch.float64)


@pytest.mark.parametrize(
    ("mode", "p", "p_old", "expected"),
    [
        pytest.param("importance", 0.6, 0.3, 2.0, id="importance-2x"),
        # 0.5*0.5 / (0.2*0.8) = 0.25/0.16
        pytest.param("bernoulli", 0.5, 0.2, 0.25 / 0.16, id="bernoulli-open-decision"),
        # saturating token: 0.99*0.01 / (0.9*0.1)
        pytest.param("bernoulli", 0.99, 0.9, 0.0099 / 0.09, id="bernoulli-saturating"),
        # 0.1*0.9 / (0.05*0.95) = 0.09/0.0475 (vs r = 2)
        pytest.param("bernoulli", 0.1, 0.05, 0.09 / 0.0475, id="bernoulli-rare"),
    ],
)
def test_closed_form(mode: str, p: float, p_old: float, expected: float) -> None:
    out = token_ratio(_lp(p), _lp(p_old), mode, c_max=100.0)
    # fp64 throughout: 1e-12 relative.
    torch.testing.assert_close(
        out.ratio, torch.tensor([expected], dtype=torch.float64), rtol=1e-12, atol=0
    )


def test_categorical_closed_form() -> None:
    s, s_old = torch.tensor([0.5, 0.9]), torch.tensor([0.75, 0.5])
    out = token_ratio(torch.zeros(2), torch.zeros(2), "categorical", sum_p2=s, sum_p2_old=s_old)
    torch.testing.assert_close(out.ratio, torch.tensor([0.5 / 0.25, 0.1 / 0.5]))


@pytest.mark.parametrize("mode", ["importance", "bernoulli", "categorical"])
def test_c_is_one_at_old_policy(mode: str) -> None:
    lp = torch.log(torch.rand(64)).clamp(max=-1e-9)
    lp[0], lp[1] = -1e-12, -60.0  # p ~ 1 and p ~ 0: the clamps apply equally on both sides
    s = torch.rand(64)
    s[0] = 1.0
    out = token_ratio(lp, lp.clone(), mode, sum_p2=s, sum_p2_old=s.clone())
    assert torch.equal(out.ratio, torch.ones(64))


def test_cap_and_raw() -> None:
    # p_old ~ 0 (clamped to 1e-6): raw c = 0.25 / (1e-6 * (1 - 1e-6)) ~ 2.5e5, capped at 10.
    out = token_ratio(_lp(0.5), torch.tensor([-50.0], dtype=torch.float64), "bernoulli", c_max=10.0)
    assert out.ratio.item() == 10.0
    assert out.raw.item() == pytest.approx(0.25 / (1e-6 * (1 - 1e-6)), rel=1e-9)


def test_bernoulli_near_one_uses_expm1() -> None:
    # p = 1 - 1e-4: 1 - p from -expm1 is accurate; p(1-p) ratio vs p_old = 1 - 2e-4 ~ 1/2.
    lp, lp_old = torch.tensor([math.log1p(-1e-4)]), torch.tensor([math.log1p(-2e-4)])
    out = token_ratio(lp, lp_old, "bernoulli")  # fp32: 1 - p would lose ~3 digits without expm1
    assert out.ratio.item() == pytest.approx(0.5, rel=1e-3)


def test_categorical_needs_sum_p2() -> None:
    with pytest.raises(ValueError, match="sum_p2"):
        token_ratio(torch.zeros(2), torch.zeros(2), "categorical")


def test_importance_differentiable_others_detached() -> None:
    lp = torch.tensor([-1.0], requires_grad=True)
    assert token_ratio(lp, torch.tensor([-2.0]), "importance").ratio.requires_grad
    assert not token_ratio(lp, torch.tensor([-2.0]), "bernoulli").ratio.requires_grad


def test_the_default_token_ratio_is_bernoulli() -> None:
    """``token_ratio(logp, logp_old)`` is the ReCo default, the Bernoulli variance ratio."""
    lp, lp_old = _lp(0.3, 0.9), _lp(0.5, 0.6)
    default = token_ratio(lp, lp_old)
    bern = token_ratio(lp, lp_old, "bernoulli")
    assert torch.equal(default.raw, bern.raw)
    assert default.raw[0].item() == pytest.approx(0.3 * 0.7 / 0.25, rel=1e-9)


def test_the_importance_ratio_takes_the_given_max_log_ratio() -> None:
    """``max_log_ratio`` reaches the importance ratio: a log-ratio of 3 clamped at 1 gives e."""
    got = token_ratio(_lp(0.5), _lp(0.5 * math.exp(-3)), "importance", max_log_ratio=1.0)
    assert got.ratio.item() == pytest.approx(math.e, rel=1e-12)
