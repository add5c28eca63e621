"""Response weights: the examples of the spec, duplicates, and finiteness at the edges."""

import math

import pytest
import torch

from reco_megatron.algo import response_weights

G = 4


def _one_token(logps: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """Responses of one token each: the token's log-prob is the sequence log-prob."""
    lp = torch.tensor(logps, dtype=torch.float64).unsqueeze(1)
    return lp, torch.ones_like(lp)


@pytest.mark.parametrize(
    ("pi_old", "expected"),
    [
        pytest.param(0.1, 1.0, id="G*pi<1->1"),
        pytest.param(1.0 / G, 1.0, id="G*pi=1->1"),
        pytest.param(3.0 / G, 1.0 / 3.0, id="pi=3/G->1/3"),
        pytest.param(1.0, 1.0 / G, id="pi=1->1/G"),
    ],
)
def test_sequence_closed_form(pi_old: float, expected: float) -> None:
    lp, mask = _one_token([math.log(pi_old)] * G)
    w = response_weights(lp, mask, G, "sequence")
    # fp32 output of fp64 math: 1e-6 relative.
    torch.testing.assert_close(w, torch.full((G,), expected, dtype=torch.float32))


def test_sequence_sums_tokens_and_ignores_padding() -> None:
    # pi = 0.5 * 0.6 * 0.5 = 0.15, G = 10 -> w = 1/1.5; the padded -inf must be ignored.
    lp = torch.tensor([[math.log(0.5), math.log(0.6), math.log(0.5), -math.inf]] * 10)
    mask = torch.tensor([[1, 1, 1, 0]] * 10)
    w = response_weights(lp, mask, 10, "sequence")
    torch.testing.assert_close(w, torch.full((10,), 1 / 1.5))


def test_geometric_normalised_and_clipped() -> None:
    # Geometric-mean token probs 0.5, 0.25 (u ~ 2, 4) -> normalised to mean 1: 2/3, 4/3.
    lp = torch.tensor([[math.log(0.5)] * 3, [math.log(0.25)] * 3], dtype=torch.float64)
    w = response_weights(lp, torch.ones_like(lp), 2, "geometric", w_min=0.1, w_max=10.0)
    torch.testing.assert_close(w, torch.tensor([2 / 3, 4 / 3]))
    w = response_weights(lp, torch.ones_like(lp), 2, "geometric", w_min=0.9, w_max=1.2)
    torch.testing.assert_close(w, torch.tensor([0.9, 1.2]))


def test_empirical_counts_duplicates_per_group() -> None:
    ids = torch.tensor([[5, 6, 0], [5, 6, 0], [5, 7, 0], [5, 6, 9], [5, 6, 0], [1, 1, 1]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0], [1, 1, 0], [1, 1, 1], [1, 1, 1], [1, 1, 1]])
    # Group 1 = rows 0-2: rows 0, 1 identical. Group 2 = rows 3-5: row 4 is [5, 6, 0] with
    # mask 1 at position 2 -> differs from row 0 (and is in another group anyway).
    w = response_weights(torch.zeros(6, 3), mask, 3, "empirical", response_ids=ids)
    torch.testing.assert_close(w, torch.tensor([0.5, 0.5, 1.0, 1.0, 1.0, 1.0]))


def test_empirical_padding_ids_ignored() -> None:
    ids = torch.tensor([[3, 4, 0], [3, 4, 99]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    w = response_weights(torch.zeros(2, 3), mask, 2, "empirical", response_ids=ids)
    torch.testing.assert_close(w, torch.tensor([0.5, 0.5]))


def test_none_is_ones() -> None:
    w = response_weights(torch.randn(8, 3), torch.ones(8, 3), 4, "none")
    assert torch.equal(w, torch.ones(8))


@pytest.mark.parametrize("mode", ["sequence", "geometric", "empirical", "none"])
def test_edge_cases_finite(mode: str) -> None:
    lp = torch.tensor(
        [[-math.inf, -1.0], [0.0, 0.0], [-1e30, -1e30], [-0.1, -0.2]], dtype=torch.float32
    )
    mask = torch.tensor([[1, 1], [0, 0], [1, 1], [1, 1]])  # row 1 is an empty response
    ids = torch.tensor([[1, 2], [0, 0], [1, 2], [3, 3]])
    for g in (1, 2, 4):
        w = response_weights(lp, mask, g, mode, response_ids=ids)
        assert w.shape == (4,)
        assert torch.isfinite(w).all() and (w > 0).all(), (mode, g, w)
        if g == 1 and mode != "geometric":
            assert torch.equal(w, torch.ones(4))


def test_sequence_edge_values() -> None:
    lp = torch.tensor([[-math.inf], [0.0]])
    w = response_weights(lp, torch.tensor([[1], [0]]), 2, "sequence")
    # -inf: pi = 0 -> 1; empty: pi = 1 (empty product) -> 1/G.
    torch.testing.assert_close(w, torch.tensor([1.0, 0.5]))


def test_incomplete_group_error_quotes_values() -> None:
    with pytest.raises(ValueError, match=r"6 responses is not a multiple of group_size=4"):
        response_weights(torch.zeros(6, 2), torch.ones(6, 2), 4)


def test_empirical_needs_ids() -> None:
    with pytest.raises(ValueError, match="response_ids"):
        response_weights(torch.zeros(4, 2), torch.ones(4, 2), 4, "empirical")
