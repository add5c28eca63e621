"""SamplingParams validation and the sampling step (truncation, inverse CDF, log-probs)."""

from __future__ import annotations

import math

import pytest
import torch

from reco_megatron.rollout import Completion, SamplingParams
from reco_megatron.rollout.sampling import sample_next, truncation_mask


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"temperature": -0.5}, r"temperature must be >= 0 .* got -0.5"),
        ({"temperature": float("nan")}, r"temperature must be a finite number"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\] .* got 0.0"),
        ({"top_p": 1.5}, r"got 1.5"),
        ({"top_k": -1}, r"top_k must be an int >= 0 .* got -1"),
        ({"max_new_tokens": 0}, r"max_new_tokens must be an int >= 1, got 0"),
        ({"seed": 1.5}, r"seed must be an int or None, got 1.5"),
        ({"stop_token_ids": (3, -2)}, r"stop_token_ids must be non-negative ints, got \[-2\]"),
    ],
)
def test_sampling_params_errors_quote_the_value(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_sampling_params_keyword_only_and_frozen() -> None:
    with pytest.raises(TypeError):
        SamplingParams(1.0)  # type: ignore[misc]
    params = SamplingParams(stop_token_ids=[4, 5])  # type: ignore[arg-type]
    assert params.stop_token_ids == (4, 5)
    with pytest.raises(AttributeError):
        params.temperature = 2.0  # type: ignore[misc]


def test_completion_checks_lengths() -> None:
    with pytest.raises(ValueError, match="prompt 3: 2 tokens but 1 log-probs"):
        Completion(
            prompt_index=3, sample_index=0, token_ids=[1, 2], logprobs=[-1.0], finish_reason="stop"
        )
    with pytest.raises(ValueError, match="finish_reason"):
        Completion(prompt_index=0, sample_index=0, token_ids=[], logprobs=[], finish_reason="abort")  # type: ignore[arg-type]


def test_truncation_mask_hand_cases() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert truncation_mask(logits, 2, 1.0).tolist() == [[True, True, False, False]]
    assert truncation_mask(logits, 0, 0.5).tolist() == [[True, False, False, False]]
    assert truncation_mask(logits, 0, 0.8).tolist() == [[True, True, False, False]]
    assert truncation_mask(logits, 0, 0.81).tolist() == [[True, True, True, False]]
    assert truncation_mask(logits, 3, 0.99).tolist() == [[True, True, True, False]]
    assert truncation_mask(logits, 0, 1.0).all()


def test_inverse_cdf_frequencies_follow_the_truncated_distribution() -> None:
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1])
    logits = torch.log(probs).expand(1000, 4).clone()
    u = (torch.arange(1000, dtype=torch.float64) + 0.5) / 1000  # a uniform grid
    tokens, logp = sample_next(logits, u, SamplingParams(top_k=3))
    freq = torch.bincount(tokens, minlength=4).double() / 1000
    torch.testing.assert_close(
        freq, torch.tensor([4 / 9, 3 / 9, 2 / 9, 0.0]).double(), atol=2e-3, rtol=0
    )
    # Log-probs are of the untruncated distribution.
    torch.testing.assert_close(logp, torch.log(probs)[tokens], atol=1e-6, rtol=0)


def test_temperature_scales_logprobs() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0]])
    tokens, logp = sample_next(logits, torch.tensor([0.0]), SamplingParams(temperature=2.0))
    expected = torch.log_softmax(logits / 2.0, -1)[0, tokens[0]]
    assert tokens.tolist() == [0]
    assert logp.item() == pytest.approx(expected.item(), abs=1e-7)
    # u -> 1 from below never picks a zero-probability (truncated) token
    tokens, _ = sample_next(logits, torch.tensor([1 - 1e-16]), SamplingParams(top_k=2))
    assert tokens.tolist() == [1]
    assert math.isfinite(logp.item())
