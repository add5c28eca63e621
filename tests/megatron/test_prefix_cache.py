"""The megatron decoder's prefix cache (``reco_megatron/megatron/decoding/prefix.py``).

Multi-turn episodes call the engine once per turn with the whole context as the prompt; with
the prefix cache a turn prefills only its new tokens (the last action token and the
observation) on top of the keys and values the previous turn kept. The tests drive three
turns of four episodes by hand (``tests/megatron/_prefix.py``) on two decoders over the same
fp64 model, one with the cache and one without, and require identical tokens and log-probs
equal within 1e-12: the model computes in fp64 and the sampler's fp32 logits round the
~1e-15 differences of a forward of another shape away (0.0 measured at TP 1, TP 2, PP 2).
"""

from __future__ import annotations

import pytest
import torch

from reco_megatron.megatron.decoding.prefix import PrefixStore
from reco_megatron.testing import run_distributed
from tests.megatron import _prefix

TOL = 1e-12


def _gap(a: list, b: list) -> float:
    return max(
        abs(x - y)
        for ta, tb in zip(a, b, strict=True)
        for ra, rb in zip(ta, tb, strict=True)
        for x, y in zip(ra, rb, strict=True)
    )


@pytest.mark.dist
@pytest.mark.parametrize(
    ("tp", "pp", "stops"),
    [(1, 1, False), (2, 1, False), (1, 2, False), (1, 1, True)],
    ids=["tp1", "tp2", "pp2", "tp1-stops"],
)
def test_later_turns_prefill_only_their_new_tokens_and_decode_the_same(
    tp: int, pp: int, stops: bool
) -> None:
    # "stops": a third of the vocabulary stops and the host reads after every step, so rows
    # finish at different steps and leave the batch (kept before their slots are reused)
    kwargs = {"stops": tuple(range(0, 100, 3)), "sync_every": 1} if stops else {}
    args = (tp, pp)
    for got in run_distributed(
        _prefix.equality_body, tp * pp, args=args, kwargs=kwargs, timeout=400
    ):
        cached, plain = got["cached"], got["plain"]
        assert cached["tokens"] == plain["tokens"]
        assert _gap(cached["logprobs"], plain["logprobs"]) < TOL
        rows, new = len(_prefix.PROMPTS), 1 + len(_prefix.OBSERVATION)
        # turn 0 prefills the prompts in both; later turns: the last action token and the
        # observation of every row with the cache, the whole context without
        assert cached["prefilled"][0] == plain["prefilled"][0] == sum(map(len, _prefix.PROMPTS))
        assert cached["prefilled"][1:] == [rows * new] * (_prefix.TURNS - 1)
        for t in range(1, _prefix.TURNS):
            assert cached["prefilled"][t] + cached["reused"][t] == plain["prefilled"][t]
        assert plain["reused"] == [0] * _prefix.TURNS


@pytest.mark.dist
def test_a_weight_update_or_sleep_drops_the_prefix_cache() -> None:
    (got,) = run_distributed(_prefix.invalidation_body, 1, timeout=300)
    assert got["held"] == len(_prefix.PROMPTS)
    assert got["after_update"] == 0 and got["no_hit_after_update"]
    assert got["same_as_fresh"]  # the tokens of the new weights, not of stale keys
    assert got["after_sleep"] == 0


@pytest.mark.dist
def test_the_bound_evicts_and_decoding_stays_the_same() -> None:
    (got,) = run_distributed(_prefix.bound_body, 1, timeout=300)
    assert got["limit"] == 20 and got["positions"] <= 20
    assert got["nbytes"] == got["positions"] * got["per_position"]
    assert got["entries"] == 1  # four rows of 7-9 kept positions each, one fits at a time
    assert 0 < got["reused"][1] <= 20  # the row whose prefix survived reuses it
    assert got["same"]


@pytest.mark.dist
def test_a_prompt_sharing_part_of_a_kept_sequence_or_equal_to_one_decodes_the_same() -> None:
    (got,) = run_distributed(_prefix.partial_body, 1, timeout=300)
    assert got["reused"] == 0  # a miss each (a hit needs a whole kept sequence and a token more)
    assert got["same"] and got["gap"] < TOL


@pytest.mark.dist
def test_it_stays_off_while_recording_moe_routing() -> None:
    (got,) = run_distributed(_prefix.recording_body, 1, timeout=300)
    assert not got["enabled"] and got["store"] is None and got["reused"] == 0
    assert got["prompt_experts_recorded"]  # every prompt position fed, as before


def _kv(length: int) -> torch.Tensor:
    return torch.full((1, 2, 1, length, 2), float(length))


def test_the_store_matches_the_longest_kept_prefix_and_evicts_the_least_recently_used() -> None:
    store = PrefixStore(limit=10)
    store.put((1, 2), _kv(2))
    store.put((1, 2, 3, 4), _kv(4))
    assert store.match([1, 2, 3, 4, 5]) == (1, 2, 3, 4)  # the longest
    assert store.match([1, 2, 3, 4]) == (1, 2)  # a hit leaves a token to feed
    assert store.match([1, 3]) is None and store.match([1, 2]) is None
    store.put((7, 7, 7), _kv(3))  # 9 positions held
    store.match([1, 2, 3, 4, 9])  # (1, 2, 3, 4) used last; (1, 2) least recently
    store.put((8, 8), _kv(2))  # 11 > 10: evicts (1, 2)
    assert store.positions == 9 and store.match([1, 2, 9]) is None
    assert store.match([7, 7, 7, 0]) == (7, 7, 7)
    store.put(tuple(range(11)), _kv(11))  # longer than the bound: not kept, nothing evicted
    assert store.positions == 9 and len(store) == 3
    store.discard((7, 7, 7))
    assert store.positions == 6 and store.nbytes() == (4 + 2) * 2 * 2 * 4
    store.clear()
    assert store.positions == 0 and len(store) == 0 and store.match([1, 2, 3, 4, 5]) is None


def test_a_zero_bound_keeps_nothing_and_a_negative_one_is_refused() -> None:
    store = PrefixStore(limit=0)
    store.put((1,), _kv(1))
    assert len(store) == 0
    with pytest.raises(ValueError, match="-1"):
        PrefixStore(limit=-1)


def test_the_trainer_turns_it_on_for_episodes_only_unless_told() -> None:
    from reco_megatron.trainer.orchestration.engines import _prefix_cache_bytes
    from reco_megatron.trainer.rollout_config import RolloutConfig

    assert _prefix_cache_bytes(RolloutConfig()) == 0  # single-turn: nothing would hit
    assert _prefix_cache_bytes(RolloutConfig(env="calculator")) is None  # the decoder's default
    assert _prefix_cache_bytes(RolloutConfig(prefix_cache_gib=0.5)) == 2**29
    assert _prefix_cache_bytes(RolloutConfig(env="calculator", prefix_cache_gib=0)) == 0
    with pytest.raises(ValueError, match="prefix_cache_gib must be >= 0 GiB or null, got -1"):
        RolloutConfig(prefix_cache_gib=-1)
