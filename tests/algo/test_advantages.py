"""Group advantages: closed forms computed by hand (fp64, so exact up to rounding: 1e-12)."""

import math

import pytest
import torch

from reco_megatron.algo import group_advantages

R = [1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0]  # two groups of 4; the second is all-equal
STD1 = math.sqrt(1.0 / 3.0)  # unbiased std of [1, 0, 0, 1] = sqrt((4 * 0.25) / 3)


@pytest.mark.parametrize(
    ("mode", "expected_first_group"),
    [
        pytest.param("grpo", [0.5 / STD1, -0.5 / STD1, -0.5 / STD1, 0.5 / STD1], id="grpo"),
        pytest.param("dr_grpo", [0.5, -0.5, -0.5, 0.5], id="dr_grpo"),
        # R_i - mean of the other three: 1 - 1/3, 0 - 2/3.
        pytest.param("rloo", [2 / 3, -2 / 3, -2 / 3, 2 / 3], id="rloo"),
    ],
)
def test_closed_form(mode: str, expected_first_group: list[float]) -> None:
    adv, metrics = group_advantages(torch.tensor(R, dtype=torch.float64), 4, mode, eps=0.0)
    expected = torch.tensor([*expected_first_group, 0, 0, 0, 0], dtype=torch.float64)
    torch.testing.assert_close(adv, expected, rtol=1e-12, atol=1e-12)
    assert metrics["zero_adv_groups/sum"].item() == 1.0
    assert metrics["num_groups/sum"].item() == 2.0
    assert metrics["zero_adv_frac/mean"].item() == 0.5


def test_grpo_eps_in_denominator() -> None:
    adv, _ = group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0], dtype=torch.float64), 4, eps=0.1)
    torch.testing.assert_close(adv[0], torch.tensor(0.5 / (STD1 + 0.1), dtype=torch.float64))


@pytest.mark.parametrize("mode", ["grpo", "dr_grpo", "rloo"])
def test_all_equal_rewards_give_exact_zero(mode: str) -> None:
    # 0.1 is not representable: a float mean minus the values is ~1e-17, and /(0 + eps) would
    # blow it up to ~1e-11 in grpo. The all-equal test must make it exactly 0.
    adv, metrics = group_advantages(torch.full((6,), 0.1), 3, mode)
    assert torch.equal(adv, torch.zeros(6))
    assert metrics["zero_adv_groups/sum"].item() == 2.0


@pytest.mark.parametrize("mode", ["grpo", "dr_grpo", "rloo"])
def test_group_size_one_is_zero(mode: str) -> None:
    adv, metrics = group_advantages(torch.tensor([1.0, 0.0, 3.0]), 1, mode)
    assert torch.equal(adv, torch.zeros(3))
    assert metrics["zero_adv_groups/sum"].item() == 3.0


def test_incomplete_group_error_quotes_values() -> None:
    with pytest.raises(ValueError, match=r"7 rewards is not a multiple of group_size=4"):
        group_advantages(torch.zeros(7), 4)


def test_unknown_mode() -> None:
    with pytest.raises(ValueError, match="'ppo'"):
        group_advantages(torch.zeros(4), 4, "ppo")
