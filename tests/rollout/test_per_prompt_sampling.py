"""One batched ``generate`` with one ``SamplingParams`` per prompt (per-request seeds).

The trainer seeds every prompt on its own so a prompt's responses do not depend on which
data-parallel rank generates it. These tests pin down that one batched call gives each prompt
the random numbers a call of its own would give, and that prompts never share noise.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from reco_megatron.rollout import EmbeddedEngine, SamplingParams
from reco_megatron.rollout.requests import per_prompt_sampling
from reco_megatron.rollout.sampling import draw_noise, group_by_setting
from reco_megatron.rollout.vllm_engine import request_seeds
from reco_megatron.trainer.orchestration import RolloutClient

PROMPTS = [[5, 6, 7], [1, 9, 10, 11], [4], [3, 3, 3, 3, 3, 3, 3], [8, 2]]
SEEDS = [101, 7, 55, 7_000_003, 12]


def _tokens(results) -> list[list[list[int]]]:
    return [[c.token_ids for c in group] for group in results]


def test_draw_noise_one_stream_per_seed() -> None:
    own = [SamplingParams(max_new_tokens=5, seed=s) for s in (3, 4)]
    noise = draw_noise(own, 2, default_seed=0)
    assert [tuple(x.shape) for x in noise] == [(2, 5), (2, 5)]
    for x, p in zip(noise, own, strict=True):
        alone = draw_noise([p], 2, default_seed=0)[0]
        assert torch.equal(x, alone)
    # A shared seed continues one stream: the second prompt does not repeat the first's noise.
    shared = draw_noise([SamplingParams(max_new_tokens=5, seed=3)] * 2, 2, default_seed=0)
    assert torch.equal(shared[0], noise[0]) and not torch.equal(shared[0], shared[1])
    # No seed: the call's default stream, same rule.
    unseeded = draw_noise([SamplingParams(max_new_tokens=5)] * 2, 2, default_seed=3)
    assert torch.equal(unseeded[0], noise[0]) and torch.equal(unseeded[1], shared[1])
    # Per-prompt lengths.
    mixed = draw_noise([SamplingParams(max_new_tokens=3), SamplingParams(max_new_tokens=7)], 4, 1)
    assert [tuple(x.shape) for x in mixed] == [(4, 3), (4, 7)]


def test_group_by_setting_ignores_only_the_seed() -> None:
    base = SamplingParams(max_new_tokens=4)
    params = [
        replace(base, seed=1),
        replace(base, seed=2, temperature=0.5),
        replace(base, seed=3),
        replace(base, max_new_tokens=9),
    ]
    groups = group_by_setting(params)
    assert list(groups.values()) == [[0, 2], [1], [3]]
    assert all(key.seed is None for key in groups)


def test_batched_call_equals_one_call_per_prompt(engine) -> None:
    params = [SamplingParams(max_new_tokens=12, seed=s) for s in SEEDS]
    batched = engine.generate(PROMPTS, 4, params)
    alone = [engine.generate([p], 4, sp)[0] for p, sp in zip(PROMPTS, params, strict=True)]
    assert _tokens(batched) == [[c.token_ids for c in g] for g in alone]
    for got, ref in zip(batched, alone, strict=True):
        for a, b in zip(got, ref, strict=True):
            assert (a.prompt_index, a.sample_index) != (None, None)
            assert a.finish_reason == b.finish_reason
            # Left padding changes the kernels' shapes, not the math: fp32 summation order.
            torch.testing.assert_close(
                torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0
            )
    assert [[c.prompt_index for c in g] for g in batched] == [[i] * 4 for i in range(5)]
    # A prompt's responses do not depend on its neighbours or on the chunking.
    reordered = engine.generate(PROMPTS[::-1], 4, params[::-1])
    assert _tokens(reordered)[::-1] == _tokens(batched)


def test_mixed_settings_in_one_call(engine) -> None:
    params = [
        SamplingParams(max_new_tokens=3, seed=1),
        SamplingParams(max_new_tokens=9, seed=2, temperature=0.0),
        SamplingParams(max_new_tokens=5, seed=3, top_k=4),
    ]
    mixed = engine.generate(PROMPTS[:3], 2, params)
    for i, (group, p) in enumerate(zip(mixed, params, strict=True)):
        assert all(len(c.token_ids) <= p.max_new_tokens for c in group)
        assert _tokens([group]) == _tokens(engine.generate([PROMPTS[i]], 2, p))
    greedy = mixed[1]
    assert greedy[0].token_ids == greedy[1].token_ids  # temperature 0: both samples agree


def test_shared_seed_gives_prompts_different_noise(engine) -> None:
    same = [[4, 4, 4]] * 2
    one = engine.generate(same, 3, SamplingParams(max_new_tokens=10, seed=9))
    assert _tokens(one)[0] != _tokens(one)[1]
    listed = engine.generate(same, 3, [SamplingParams(max_new_tokens=10, seed=9)] * 2)
    assert _tokens(listed) == _tokens(one)


@pytest.mark.parametrize(
    ("sampling", "error", "match"),
    [
        ([SamplingParams()] * 2, ValueError, r"got 2 SamplingParams for 3 prompts"),
        ([SamplingParams(), {"seed": 1}, SamplingParams()], TypeError, r"sampling\[1\] must be"),
        ({"temperature": 1.0}, TypeError, r"SamplingParams or a list of them.*got dict"),
        ("greedy", TypeError, r"got str"),
    ],
)
def test_bad_sampling_lists(engine, sampling, error, match) -> None:
    with pytest.raises(error, match=match):
        engine.generate(PROMPTS[:3], 1, sampling)


def test_per_prompt_limits_are_checked_per_prompt(engine) -> None:
    # 60 prompt tokens fit with 4 new tokens but not with 8 (max_model_len 64).
    params = [SamplingParams(max_new_tokens=8), SamplingParams(max_new_tokens=4)]
    engine.generate([[1, 2], [3] * 60], 1, params)
    with pytest.raises(ValueError, match=r"prompt 0 has 60 tokens; with max_new_tokens=8"):
        engine.generate([[3] * 60, [1, 2]], 1, params)
    with pytest.raises(ValueError, match=r"stop_token_ids \[99\] \(prompt 1\)"):
        short = SamplingParams(max_new_tokens=2)
        engine.generate([[1], [2]], 1, [short, replace(short, stop_token_ids=(99,))])


def test_per_prompt_sampling_repeats_a_single_setting() -> None:
    p = SamplingParams(seed=1)
    assert per_prompt_sampling([[1], [2]], p) == [p, p]
    assert per_prompt_sampling([[1]], (p,)) == [p]


def test_request_seeds_make_repeats_distinct() -> None:
    params = [SamplingParams(seed=s) for s in (5, 5, 6, 5)] + [SamplingParams()]
    seeds = request_seeds(params)
    assert seeds[4] is None
    assert len({seeds[0], seeds[1], seeds[2], seeds[3]}) == 4
    assert request_seeds(params) == seeds  # deterministic
    assert request_seeds([SamplingParams(seed=5)]) == [seeds[0]]  # a prompt's seed alone


def test_request_seeds_keep_vllm_child_seeds_apart() -> None:
    """vLLM seeds child j of a request ``seed + j``: prompts seeded s, s + 1, ... (the natural
    choice of a caller) must not share any child seed once spread."""
    n = 16
    seeds = request_seeds([SamplingParams(seed=s) for s in range(64)])
    children = [seed + j for seed in seeds for j in range(n)]
    assert len(set(children)) == len(children)
    assert all(0 <= s < 2**63 for s in seeds)  # fits vLLM's / torch's generator seed


class _CountingEngine:
    """Forwards to an engine and records every ``generate`` call."""

    def __init__(self, inner: EmbeddedEngine) -> None:
        self.inner = inner
        self.calls: list[tuple[int, object]] = []

    def generate(self, prompts, n, sampling):
        self.calls.append((len(prompts), sampling))
        return self.inner.generate(prompts, n, sampling)

    def close(self) -> None:
        pass


def test_rollout_client_makes_one_batched_call(engine) -> None:
    counting = _CountingEngine(engine)
    client = RolloutClient(counting, SamplingParams(max_new_tokens=6, temperature=0.9))
    out = client.generate_seeded(PROMPTS, 3, SEEDS)
    assert len(counting.calls) == 1 and counting.calls[0][0] == len(PROMPTS)
    sent = counting.calls[0][1]
    assert [p.seed for p in sent] == SEEDS and {p.temperature for p in sent} == {0.9}
    for i, (prompt, seed) in enumerate(zip(PROMPTS, SEEDS, strict=True)):
        alone = engine.generate(
            [prompt], 3, SamplingParams(max_new_tokens=6, temperature=0.9, seed=seed)
        )
        assert _tokens([out[i]]) == _tokens(alone)
    with pytest.raises(ValueError, match="2 seeds for 5 prompts"):
        client.generate_seeded(PROMPTS, 3, SEEDS[:2])
