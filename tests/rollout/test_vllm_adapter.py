"""``VLLMEngine`` driven end to end against ``fake_vllm`` (vLLM 0.33's API, replayed on CPU).

What vLLM would receive is checked here without a GPU: the engine arguments, one
``SamplingParams`` per prompt with a seed, the HF weight stream through ``load_weights`` into
fused parameters, and what comes back (log-probs aligned with a teacher-forced forward of the
pushed weights). The real engine runs only in the ``vllm``-marked test.
"""

from __future__ import annotations

import random

import pytest
import torch

from reco_megatron.rollout import SamplingParams, VLLMEngine, VLLMEngineConfig
from reco_megatron.rollout.vllm_requests import request_seeds
from tests.rollout import fake_vllm
from tests.rollout._tiny import teacher_forced_logprobs, tiny_model

PROMPTS = [[5, 6, 7], [1, 9, 10, 11], [4]]


def _engine(model_dir, **kw) -> VLLMEngine:
    return VLLMEngine(VLLMEngineConfig(model=str(model_dir), max_model_len=64, **kw))


def test_generations_follow_the_pushed_weights(fake) -> None:
    engine = _engine(fake)
    with pytest.raises(RuntimeError, match="call update_weights"):
        engine.generate(PROMPTS, 2, SamplingParams(max_new_tokens=4, seed=1))
    model = tiny_model(seed=0)
    engine.update_weights(model.state_dict().items())
    params = [SamplingParams(max_new_tokens=8, seed=s) for s in (11, 12, 13)]
    results = engine.generate(PROMPTS, 3, params)
    llm = fake_vllm.LLM.instances[-1]
    sent = [(3, s, 1.0) for s in request_seeds(params)]  # spread seeds, see request_seeds
    assert llm.calls[-1] == ("generate", sent)
    for i, group in enumerate(results):
        assert [c.sample_index for c in group] == [0, 1, 2]
        for comp in group:
            ref = teacher_forced_logprobs(model, PROMPTS[i], comp.token_ids, 1.0)
            # fp32 KV-cached decode vs one fp64-softmax forward of the same weights.
            torch.testing.assert_close(
                torch.tensor(comp.logprobs, dtype=torch.float64), ref, atol=1e-5, rtol=0
            )
    # The weights went through the fused layout: other weights, other generations.
    engine.update_weights(tiny_model(seed=1).state_dict().items())
    assert engine.generate(PROMPTS, 3, params) != results
    assert llm.calls.count("reset_prefix_cache") == 2


def test_missing_weight_is_named_not_left_random(fake) -> None:
    engine = _engine(fake)
    state = {k: v for k, v in tiny_model(seed=0).state_dict().items() if "1.mlp.down" not in k}
    with pytest.raises(ValueError, match=r"1 vLLM parameter.*layers\.1\.mlp\.down_proj\.weight"):
        engine.update_weights(state.items())
    with pytest.raises(RuntimeError, match="call update_weights"):
        engine.generate(PROMPTS, 1, SamplingParams(max_new_tokens=2, seed=0))


def test_building_the_engine_keeps_the_trainers_rngs(fake) -> None:
    torch.manual_seed(1234)
    random.seed(99)
    before = (torch.get_rng_state(), random.getstate())
    _engine(fake, seed=7)  # the fake re-seeds the globals, as vLLM's workers do
    assert torch.equal(before[0], torch.get_rng_state()) and before[1] == random.getstate()


def test_unseeded_calls_get_derived_seeds_and_resume(fake) -> None:
    engine = _engine(fake, seed=3)
    engine.update_weights(tiny_model(seed=0).state_dict().items())
    llm = fake_vllm.LLM.instances[-1]
    first = engine.generate(PROMPTS, 2, SamplingParams(max_new_tokens=5))
    sent = llm.calls[-1][1]
    assert all(seed is not None for _, seed, _ in sent)
    assert len({seed for _, seed, _ in sent}) == 3  # one shared default, made distinct
    state = engine.state_dict()
    second = engine.generate(PROMPTS, 2, SamplingParams(max_new_tokens=5))
    assert second != first
    other = _engine(fake, seed=3)
    other.update_weights(tiny_model(seed=0).state_dict().items())
    other.load_state_dict(state)
    assert other.generate(PROMPTS, 2, SamplingParams(max_new_tokens=5)) == second


def test_greedy_with_n_samples_asks_once_and_copies(fake) -> None:
    engine = _engine(fake)
    engine.update_weights(tiny_model(seed=0).state_dict().items())
    mixed = [SamplingParams(temperature=0.0, max_new_tokens=6, seed=1)] + [
        SamplingParams(max_new_tokens=6, seed=s) for s in (2, 3)
    ]
    out = engine.generate(PROMPTS, 4, mixed)
    sent = fake_vllm.LLM.instances[-1].calls[-1][1]
    assert [n for n, _, _ in sent] == [1, 4, 4]
    assert [c.sample_index for c in out[0]] == [0, 1, 2, 3]
    assert len({tuple(c.token_ids) for c in out[0]}) == 1
    assert all(len(group) == 4 for group in out)


@pytest.mark.parametrize(
    ("temperature", "match"),
    [
        (2.5, r"vLLM rejected the sampling settings \(VLLMValidationError: temperature must be"),
        (0.005, r"below 0.01: vLLM would"),
    ],
)
def test_temperatures_vllm_would_reject_or_change(fake, temperature, match) -> None:
    engine = _engine(fake)
    engine.update_weights(tiny_model(seed=0).state_dict().items())
    with pytest.raises(ValueError, match=match):
        engine.generate(PROMPTS, 2, SamplingParams(temperature=temperature, max_new_tokens=2))


def test_sleep_wake_close_and_prefix_cache(fake) -> None:
    engine = _engine(fake)
    llm = fake_vllm.LLM.instances[-1]
    engine.sleep()
    with pytest.raises(RuntimeError, match=r"wake_weights\(\) before update_weights"):
        engine.update_weights(tiny_model(seed=0).state_dict().items())
    engine.wake()
    fake_vllm.LLM.reset_result = False
    with pytest.raises(RuntimeError, match="could not reset its prefix cache"):
        engine.update_weights(tiny_model(seed=0).state_dict().items())
    engine.close()
    engine.close()  # idempotent
    assert llm.calls[:3] == ["sleep(1)", "wake_up(weights)", "wake_up(kv_cache)"]
    assert llm.calls[-1] == "shutdown"


def test_launcher_env_is_taken_from_torch_distributed_or_named(fake, monkeypatch) -> None:
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("LOCAL_RANK")
    # an earlier in-process run may have left this process's default group initialised
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    if torch.cuda.is_available():  # pragma: no cover - CPU CI
        pytest.skip("LOCAL_RANK comes from the CUDA device here")
    with pytest.raises(RuntimeError, match=r"needs \['RANK', 'LOCAL_RANK'\]"):
        _engine(fake)


def test_engine_arguments_vllm_does_not_know_fail_at_build(fake) -> None:
    with pytest.raises(TypeError, match="swap_space"):
        _engine(fake, extra_llm_kwargs={"swap_space": 4})
    _engine(fake, extra_llm_kwargs={"max_num_seqs": 8})
