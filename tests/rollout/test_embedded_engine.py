"""Embedded engine behaviour: seeds and resume, weight updates, stops, lengths, bad input."""

from __future__ import annotations

import pytest
import torch

from reco_megatron.rollout import EmbeddedEngine, EmbeddedEngineConfig, SamplingParams
from tests.rollout._tiny import TINY_LLAMA, tiny_model

PROMPTS = [[5, 6, 7], [1, 9, 10, 11], [4]]


def _tokens(results) -> list[list[list[int]]]:
    return [[c.token_ids for c in group] for group in results]


def _fresh(ref_model, **cfg) -> EmbeddedEngine:
    eng = EmbeddedEngine(TINY_LLAMA, EmbeddedEngineConfig(**cfg))
    eng.update_weights(ref_model.state_dict().items())
    return eng


def test_fixed_seed_reproducible_other_seed_differs(engine) -> None:
    a = engine.generate(PROMPTS, 4, SamplingParams(max_new_tokens=10, seed=1))
    b = engine.generate(PROMPTS, 4, SamplingParams(max_new_tokens=10, seed=1))
    c = engine.generate(PROMPTS, 4, SamplingParams(max_new_tokens=10, seed=2))
    assert _tokens(a) == _tokens(b)
    assert _tokens(a) != _tokens(c)
    # The n samples of one prompt are not copies of each other.
    assert len({tuple(t) for t in _tokens(a)[0]}) > 1


def test_engine_seed_and_call_index_reproducible_and_resumable(ref_model) -> None:
    sampling = SamplingParams(max_new_tokens=8)
    first = _fresh(ref_model, seed=5)
    call0 = first.generate(PROMPTS, 2, sampling)
    state = first.state_dict()
    assert state == {"seed": 5, "call_index": 1}
    call1 = first.generate(PROMPTS, 2, sampling)
    assert _tokens(call0) != _tokens(call1)

    replay = _fresh(ref_model, seed=5)
    assert _tokens(replay.generate(PROMPTS, 2, sampling)) == _tokens(call0)
    resumed = _fresh(ref_model, seed=999)
    resumed.load_state_dict(state)
    assert _tokens(resumed.generate(PROMPTS, 2, sampling)) == _tokens(call1)
    with pytest.raises(ValueError, match="call_index"):
        resumed.load_state_dict({"seed": 1})


def test_generate_does_not_touch_global_rng(engine) -> None:
    torch.manual_seed(123)
    before = torch.get_rng_state()
    engine.generate(PROMPTS, 2, SamplingParams(max_new_tokens=4))
    assert torch.equal(before, torch.get_rng_state())
    EmbeddedEngine(TINY_LLAMA)  # building one (random init) leaves it untouched too
    assert torch.equal(before, torch.get_rng_state())


def test_update_weights_changes_generations(engine) -> None:
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8)
    before = engine.generate(PROMPTS, 1, greedy)
    engine.update_weights(tiny_model(seed=1).state_dict().items())
    after = engine.generate(PROMPTS, 1, greedy)
    assert _tokens(before) != _tokens(after)


def test_stop_token_ends_response_and_keeps_its_logprob(ref_model) -> None:
    engine = _fresh(ref_model, eos_token_ids=())
    sampling = SamplingParams(max_new_tokens=16, seed=4)
    free = engine.generate(PROMPTS, 3, sampling)
    assert all(c.finish_reason == "length" and len(c.token_ids) == 16 for g in free for c in g)
    stop = free[0][0].token_ids[5]
    stopped = engine.generate(
        PROMPTS, 3, SamplingParams(max_new_tokens=16, seed=4, stop_token_ids=(stop,))
    )
    for g_free, g_stop in zip(free, stopped, strict=True):
        for c_free, c_stop in zip(g_free, g_stop, strict=True):
            if stop in c_free.token_ids:
                cut = c_free.token_ids.index(stop) + 1
                assert c_stop.finish_reason == "stop"
                assert c_stop.token_ids == c_free.token_ids[:cut]
                assert c_stop.token_ids[-1] == stop
                assert c_stop.logprobs == pytest.approx(c_free.logprobs[:cut], abs=1e-5)
            else:
                assert c_stop.finish_reason == "length"
                assert c_stop.token_ids == c_free.token_ids


def test_eos_from_hf_config(ref_model) -> None:
    probe = _fresh(ref_model, eos_token_ids=())
    greedy = SamplingParams(temperature=0.0, max_new_tokens=6)
    tokens = probe.generate([PROMPTS[0]], 1, greedy)[0][0].token_ids
    eos = tokens[2]
    engine = EmbeddedEngine({**TINY_LLAMA, "eos_token_id": [eos, 63]})
    assert engine.eos_token_ids == (eos, 63)
    engine.update_weights(ref_model.state_dict().items())
    comp = engine.generate([PROMPTS[0]], 1, greedy)[0][0]
    assert comp.finish_reason == "stop"
    assert comp.token_ids == tokens[: tokens.index(eos) + 1]


def test_length_finish_at_max_new_tokens(ref_model) -> None:
    engine = _fresh(ref_model, eos_token_ids=())
    for comp in engine.generate(PROMPTS, 2, SamplingParams(max_new_tokens=5, seed=0))[1]:
        assert comp.finish_reason == "length"
        assert len(comp.token_ids) == len(comp.logprobs) == 5


def test_prompt_may_fill_max_model_len_exactly(ref_model) -> None:
    engine = _fresh(ref_model, max_model_len=10, eos_token_ids=())
    comp = engine.generate([[3] * 7], 1, SamplingParams(max_new_tokens=3, seed=0))[0][0]
    assert len(comp.token_ids) == 3 and comp.finish_reason == "length"


@pytest.mark.parametrize(
    ("prompts", "n", "max_new", "match"),
    [
        ([[1, 2], [3] * 70], 1, 4, r"prompt 1 has 70 tokens, more than .*max_model_len 64"),
        ([[1, 2], [3] * 60], 1, 8, r"prompt 1 has 60 tokens; with max_new_tokens=8 .* 68 > "),
        ([[1, 2], []], 1, 4, r"prompt 1 is empty"),
        ([[1, 2], [3, 64]], 1, 4, r"prompt 1, position 1: token id 64 .*vocab_size=64"),
        ([[1, 2], [-1]], 1, 4, r"prompt 1, position 0: token id -1"),
        ([[1, 2], "hello"], 1, 4, r"prompt 1 is a string"),
        ([[1, 2]], 0, 4, r"n \(responses per prompt\) must be an int >= 1, got 0"),
        ([], 1, 4, r"non-empty list"),
    ],
)
def test_bad_requests_name_the_prompt(engine, prompts, n, max_new, match) -> None:
    with pytest.raises(ValueError, match=match):
        engine.generate(prompts, n, SamplingParams(max_new_tokens=max_new))


def test_stop_token_out_of_vocab(engine) -> None:
    with pytest.raises(ValueError, match=r"stop_token_ids \[99\]"):
        engine.generate([[1]], 1, SamplingParams(stop_token_ids=(99,), max_new_tokens=2))


def test_update_weights_strict_errors(ref_model) -> None:
    engine = EmbeddedEngine(TINY_LLAMA)
    with pytest.raises(RuntimeError, match="call update_weights"):
        engine.generate([[1]], 1, SamplingParams(max_new_tokens=2))
    state = dict(ref_model.state_dict())
    renamed = {**state, "model.layers.0.mlp.up_proj.wieght": state["model.norm.weight"]}
    with pytest.raises(ValueError, match=r"1 unknown name.*up_proj\.wieght.*closest known"):
        engine.update_weights(renamed.items())
    partial = {k: v for k, v in state.items() if "layers.1." not in k}
    with pytest.raises(ValueError, match=r"missing name.*layers\.1\."):
        engine.update_weights(partial.items())
    bad = {**state, "model.norm.weight": torch.zeros(31)}
    with pytest.raises(ValueError, match=r"shape mismatch.*model\.norm\.weight: got \(31,\)"):
        engine.update_weights(bad.items())
    with pytest.raises(ValueError, match="sent twice"):
        engine.update_weights([*state.items(), ("model.norm.weight", state["model.norm.weight"])])
    with pytest.raises(RuntimeError, match="call update_weights"):
        engine.generate([[1]], 1, SamplingParams(max_new_tokens=2))
    engine.update_weights((k, v.to(torch.bfloat16)) for k, v in state.items())  # a generator
    engine.generate([[1]], 1, SamplingParams(max_new_tokens=2))


def test_tied_embeddings_accept_either_name() -> None:
    cfg = {**TINY_LLAMA, "tie_word_embeddings": True}
    model = tiny_model(seed=0, tie_word_embeddings=True)
    engine = EmbeddedEngine(cfg)
    state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    engine.update_weights(state.items())
    torch.testing.assert_close(
        engine.model.lm_head.weight, model.get_input_embeddings().weight, atol=0, rtol=0
    )


def test_sleep_wake_close(engine) -> None:
    engine.sleep()
    with pytest.raises(RuntimeError, match="asleep"):
        engine.generate([[1]], 1, SamplingParams(max_new_tokens=2))
    engine.wake()
    engine.generate([[1]], 1, SamplingParams(max_new_tokens=2))
    engine.close()
    with pytest.raises(RuntimeError, match="closed"):
        engine.generate([[1]], 1, SamplingParams(max_new_tokens=2))


def test_engine_config_validation() -> None:
    with pytest.raises(ValueError, match="max_batch_size must be an int >= 1, got 0"):
        EmbeddedEngineConfig(max_batch_size=0)
    with pytest.raises(ValueError, match=r"dtype must be one of .* got 'fp8'"):
        EmbeddedEngineConfig(dtype="fp8")
    with pytest.raises(ValueError, match="model_type"):
        EmbeddedEngine({"hidden_size": 8})
