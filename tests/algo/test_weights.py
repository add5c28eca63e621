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


def _edge_case_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Log-probs with -inf, a huge negative sum, an empty response (row 1); mask; token ids."""
    lp = torch.tensor(
        [[-math.inf, -1.0], [0.0, 0.0], [-1e30, -1e30], [-0.1, -0.2]], dtype=torch.float32
    )
    mask = torch.tensor([[1, 1], [0, 0], [1, 1], [1, 1]])
    ids = torch.tensor([[1, 2], [0, 0], [1, 2], [3, 3]])
    return lp, mask, ids


@pytest.mark.parametrize("mode", ["sequence", "geometric", "empirical", "none"])
def test_edge_cases_finite(mode: str) -> None:
    lp, mask, ids = _edge_case_batch()
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


# ---------------------------------------------------------------- per-token prefix weights


def test_prefix_hand_values_and_last_token_equals_sequence() -> None:
    # One response of G = 4, token probs 0.5, 0.5, 0.5, 0.25 (pad after): the prefix
    # probabilities are 1/2, 1/4, 1/8, 1/32 -> G * pi = 2, 1, 1/2, 1/8 -> w = 1/2, 1, 1, 1.
    lp = torch.log(torch.tensor([[0.5, 0.5, 0.5, 0.25, 1.0]] * G, dtype=torch.float64))
    lp[:, 4] = -math.inf  # padding: ignored
    mask = torch.tensor([[1, 1, 1, 1, 0]] * G)
    w = response_weights(lp, mask, G, "prefix")
    assert w.shape == (G, 5) and w.dtype == torch.float32
    torch.testing.assert_close(w[:, :4], torch.tensor([[0.5, 1.0, 1.0, 1.0]] * G))
    # prompt-free 2-token responses with a likely opening: 0.9, then 0.9 * 0.6
    lp = torch.log(torch.tensor([[0.9, 0.6], [0.9, 0.9]], dtype=torch.float64))
    w = response_weights(lp, torch.ones_like(lp), 2, "prefix")
    want = [[1 / 1.8, 1 / (2 * 0.54)], [1 / 1.8, 1 / (2 * 0.81)]]
    # fp32 output of fp64 math: 1e-6 relative.
    torch.testing.assert_close(w, torch.tensor(want))


def test_prefix_last_token_equals_sequence_on_random_groups() -> None:
    gen = torch.Generator().manual_seed(0)
    lp = -torch.rand(12, 7, generator=gen, dtype=torch.float64) * 0.3
    mask = torch.ones(12, 7, dtype=torch.long)
    for i in range(12):
        mask[i, 7 - i % 4 :] = 0  # responses of 7, 6, 5, 4 tokens
    last = mask.sum(1) - 1
    for g in (1, 3, 4, 12):
        per_tok = response_weights(lp, mask, g, "prefix")
        seq = response_weights(lp, mask, g, "sequence")
        # identical arithmetic up to summation order of the same fp64 terms: 1e-6 of fp32.
        torch.testing.assert_close(per_tok[torch.arange(12), last], seq)
        # and after the response ends the weight stays the sequence weight (finite padding)
        torch.testing.assert_close(per_tok[:, -1], seq)
    assert (response_weights(lp, mask, 4, "prefix") < 1).any()  # not vacuous


def test_prefix_empirical_counts_shared_prefixes() -> None:
    # group of 4: rows 0, 1 identical; row 2 shares the first 2 tokens; row 3 only the first
    ids = torch.tensor([[5, 6, 7], [5, 6, 7], [5, 6, 8], [5, 9, 7]])
    mask = torch.ones_like(ids)
    w = response_weights(torch.zeros(4, 3), mask, 4, "prefix_empirical", response_ids=ids)
    want = [[1 / 4, 1 / 3, 1 / 2], [1 / 4, 1 / 3, 1 / 2], [1 / 4, 1 / 3, 1.0], [1 / 4, 1.0, 1.0]]
    torch.testing.assert_close(w, torch.tensor(want))
    emp = response_weights(torch.zeros(4, 3), mask, 4, "empirical", response_ids=ids)
    torch.testing.assert_close(w[:, -1], emp)  # last token: the empirical weight


def test_prefix_empirical_padding_and_groups() -> None:
    # ids under padding are ignored; a response that ended differs from one that goes on;
    # two groups never share counts.
    ids = torch.tensor([[3, 4, 0], [3, 4, 99], [3, 4, 5], [3, 4, 0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0], [1, 1, 1], [1, 1, 0]])
    w = response_weights(torch.zeros(4, 3), mask, 2, "prefix_empirical", response_ids=ids)
    torch.testing.assert_close(w[:2], torch.full((2, 3), 0.5))
    torch.testing.assert_close(w[2:, :2], torch.full((2, 2), 0.5))
    torch.testing.assert_close(w[2:, 2], torch.ones(2))


def test_prefix_empirical_chunking_matches_one_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    from reco_megatron.algo import weights as weights_mod

    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 3, (24, 5), generator=gen)  # vocabulary of 3: many shared prefixes
    mask = torch.ones_like(ids)
    full = weights_mod.prefix_counts(ids, mask, 4)
    monkeypatch.setattr(weights_mod, "PREFIX_COUNT_CHUNK_ELEMENTS", 1)  # one group at a time
    assert torch.equal(weights_mod.prefix_counts(ids, mask, 4), full)
    assert (full > 1).any() and (full[:, 0] >= full[:, -1]).all()  # counts only fall along t


@pytest.mark.parametrize("mode", ["prefix", "prefix_empirical"])
def test_prefix_edge_cases_finite(mode: str) -> None:
    lp, mask, ids = _edge_case_batch()
    for g in (1, 2, 4):
        w = response_weights(lp, mask, g, mode, response_ids=ids)
        assert w.shape == (4, 2)
        assert torch.isfinite(w).all() and (w > 0).all(), (mode, g, w)
        if g == 1:
            assert torch.equal(w, torch.ones(4, 2))
    # -inf from the first token on: pi_old(prefix) = 0 -> weight 1 on every token
    w = response_weights(lp, mask, 2, "prefix")
    assert torch.equal(w[0], torch.ones(2))


def test_prefix_empirical_needs_ids() -> None:
    with pytest.raises(ValueError, match="'prefix_empirical' needs response_ids"):
        response_weights(torch.zeros(4, 2), torch.ones(4, 2), 4, "prefix_empirical")


def test_bf16_log_probs_are_summed_in_fp32() -> None:
    """A sequence log-prob sums T tokens: in bf16 (8 bits of mantissa) 300 tokens of -0.01
    would drift far from -3; the sum is taken in fp32 on the bf16 values, and fp32 is what the
    weights come out in."""
    from reco_megatron.algo.weights import prefix_log_prob, sequence_log_prob

    lp = torch.full((1, 300), -0.01).bfloat16()
    mask = torch.ones(1, 300)
    got = sequence_log_prob(lp, mask)
    assert got.dtype == torch.float32
    assert got.item() == pytest.approx(lp.float().sum().item(), rel=1e-6)
    assert prefix_log_prob(lp, mask)[0, -1].item() == pytest.approx(got.item(), rel=1e-6)


@pytest.mark.parametrize("mode", ["empirical", "prefix_empirical"])
def test_a_padded_position_never_matches_a_token_id(mode: str) -> None:
    """Responses (5, 1) and (5) + padding differ: padded positions get a key no token id can
    have (-1), so a pad is not taken for token 1 (or any id >= 0). Each response is alone."""
    ids = torch.tensor([[5, 1], [5, 7]])
    mask = torch.tensor([[1, 1], [1, 0]])
    w = response_weights(torch.zeros(2, 2), mask, 2, mode, response_ids=ids)
    last = w if mode == "empirical" else w[:, -1]
    torch.testing.assert_close(last, torch.ones(2))
    ids_pad_one = torch.tensor([[5, 1], [5, 1]])  # the padded id equals the other's token
    w = response_weights(torch.zeros(2, 2), mask, 2, mode, response_ids=ids_pad_one)
    last = w if mode == "empirical" else w[:, -1]
    torch.testing.assert_close(last, torch.ones(2))


def test_prefix_counts_of_no_rows_is_empty() -> None:
    """No groups: a [0, T] count tensor, not an error from concatenating no chunks."""
    from reco_megatron.algo.weights import prefix_counts

    got = prefix_counts(torch.zeros(0, 3, dtype=torch.long), torch.zeros(0, 3), 4)
    assert got.shape == (0, 3)


def test_prefix_counts_do_not_depend_on_the_chunking(monkeypatch: pytest.MonkeyPatch) -> None:
    """Groups processed two per chunk (the chunk bound set to two groups' G * G * T) give the
    same counts as all at once: the chunks are concatenated along the group axis, in order."""
    from reco_megatron.algo import weights

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 2, (16, 5), generator=gen)  # 4 groups of 4, many shared prefixes
    mask = torch.ones(16, 5)
    whole = weights.prefix_counts(ids, mask, 4)
    monkeypatch.setattr(weights, "PREFIX_COUNT_CHUNK_ELEMENTS", 2 * 4 * 4 * 5)
    assert torch.equal(weights.prefix_counts(ids, mask, 4), whole)
    assert not torch.equal(whole[:4], whole[4:8])  # the groups differ: an order mix-up shows


def test_none_weights_are_fp32_whatever_the_default_dtype() -> None:
    """The docstring promises fp32 weights; ``torch.set_default_dtype(float64)`` in a caller
    must not change that."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        w = response_weights(torch.zeros(4, 2), torch.ones(4, 2), 4, "none")
    finally:
        torch.set_default_dtype(old)
    assert w.dtype == torch.float32


def test_geometric_mean_of_a_one_token_response_is_its_log_prob() -> None:
    """The per-token mean divides by the response length, 1 here: a one-token response with
    log-prob -1 and a two-token one with -1, -1 have the same geometric mean, so equal
    weights (1, 1 after normalising to mean 1)."""
    lp = torch.tensor([[-1.0, 0.0], [-1.0, -1.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 0], [1, 1]])
    w = response_weights(lp, mask, 2, "geometric")
    torch.testing.assert_close(w, torch.ones(2), rtol=1e-6, atol=0)
