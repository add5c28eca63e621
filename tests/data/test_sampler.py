"""PromptSampler: deterministic shuffled epochs, full batches, exact resume."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reco_megatron.data.sampler import PromptSampler


def test_each_epoch_is_a_permutation_and_seeds_differ() -> None:
    sampler = PromptSampler(10, 5, seed=1)
    first, second = sampler.next_batch() + sampler.next_batch(), next(sampler) + next(sampler)
    assert sorted(first) == sorted(second) == list(range(10))
    assert first != second  # a new order per epoch
    assert sampler.state_dict() == {"seed": 1, "epoch": 2, "position": 0, "num_items": 10}
    other = PromptSampler(10, 5, seed=2)
    assert other.next_batch() + other.next_batch() != first


def test_batches_run_across_epoch_boundaries() -> None:
    sampler = PromptSampler(5, 3, seed=0)
    batches = [sampler.next_batch() for _ in range(5)]
    assert all(len(b) == 3 for b in batches)
    flat = [i for b in batches for i in b]
    assert sorted(flat[:5]) == sorted(flat[5:10]) == sorted(flat[10:15]) == list(range(5))


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 30),
    batch=st.integers(1, 12),
    seed=st.integers(0, 2**31),
    cut=st.integers(0, 20),
)
def test_resume_gives_exactly_the_same_sequence(n: int, batch: int, seed: int, cut: int) -> None:
    reference = PromptSampler(n, batch, seed=seed)
    expected = [reference.next_batch() for _ in range(cut + 10)]
    run = PromptSampler(n, batch, seed=seed)
    for _ in range(cut):
        run.next_batch()
    state = json.loads(json.dumps(run.state_dict()))  # as a checkpoint would store it
    resumed = PromptSampler(n, batch, seed=12345)  # seed comes from the state
    resumed.load_state_dict(state)
    assert [resumed.next_batch() for _ in range(10)] == expected[cut:]


def test_bad_states_and_arguments() -> None:
    with pytest.raises(ValueError, match="batch_size=0"):
        PromptSampler(3, 0)
    sampler = PromptSampler(4, 2)
    with pytest.raises(ValueError, match="saved for 5 prompts but the dataset has 4"):
        sampler.load_state_dict({"seed": 0, "epoch": 0, "position": 0, "num_items": 5})
    with pytest.raises(ValueError, match="lacks \\['position'\\]"):
        sampler.load_state_dict({"seed": 0, "epoch": 0, "num_items": 4})
    with pytest.raises(ValueError, match="out of range"):
        sampler.load_state_dict({"seed": 0, "epoch": 0, "position": 4, "num_items": 4})
