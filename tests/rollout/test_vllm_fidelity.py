"""Where real vLLM 0.33 fails, the fake fails too, and ``VLLMEngine`` turns it into a clear error.

Each test pairs one vLLM behaviour replayed by ``fake_vllm`` (see its docstring for the source
locations) with what the adapter must do about it: the sleep/wake protocol (nothing generates
or loads while asleep, the KV cache is not allocated during the weight push), our per-tensor
stream check (a missing shard that vLLM's report cannot see, unknown names, wrong shapes),
``VLLMValidationError`` (not a ``ValueError``), ``processed_logprobs`` semantics, the
tokenizer, and per-prompt seeds that do not collide with vLLM's child seeds.
"""

from __future__ import annotations

import pytest
import torch

from reco_megatron.rollout import SamplingParams, VLLMEngine, VLLMEngineConfig
from reco_megatron.rollout.sampling import truncation_mask
from reco_megatron.rollout.vllm_requests import completions_from_outputs
from reco_megatron.rollout.weight_check import WeightStreamError
from tests.rollout import fake_vllm
from tests.rollout._tiny import tiny_model

PROMPTS = [[5, 6, 7], [1, 9, 10, 11]]


@pytest.fixture(scope="module")
def state() -> dict[str, torch.Tensor]:
    return dict(tiny_model(seed=0).state_dict())


def _engine(model_dir, **kw) -> VLLMEngine:
    return VLLMEngine(VLLMEngineConfig(model=str(model_dir), max_model_len=64, **kw))


def _expected(state):
    return {name: tuple(t.shape) for name, t in state.items()}


class _Counting:
    """A stream that counts what was read from it (the export is collective: all of it must
    be read even when the push fails)."""

    def __init__(self, items):
        self.items, self.read = list(items), 0

    def __iter__(self):
        for item in self.items:
            self.read += 1
            yield item


# ---------------------------------------------------------------- sleep / wake protocol
def test_step_protocol_order_and_memory(fake, state) -> None:
    engine = _engine(fake)
    llm = fake_vllm.LLM.instances[-1]
    engine.update_weights(state.items(), expected=_expected(state))
    sampling = SamplingParams(max_new_tokens=4, seed=1)
    engine.generate(PROMPTS, 2, sampling)
    engine.sleep()
    assert llm.resident() == {"weights": 0, "kv_cache": 0}  # really released
    with pytest.raises(RuntimeError, match="asleep"):
        engine.generate(PROMPTS, 2, sampling)
    with pytest.raises(RuntimeError, match="illegal memory access"):  # the fake blocks too
        llm.generate([{"prompt_token_ids": [1]}], [fake_vllm.SamplingParams(max_tokens=1)])
    engine.wake_weights()
    with pytest.raises(RuntimeError, match=r"KV cache asleep: True"):
        engine.generate(PROMPTS, 2, sampling)
    engine.update_weights(state.items(), expected=_expected(state))
    engine.wake_kv_cache()
    engine.generate(PROMPTS, 2, sampling)
    calls = [c if isinstance(c, str) else c[0] for c in llm.calls]
    assert calls == [
        "apply_model", "reset_prefix_cache", "generate", "sleep(1)", "wake_up(weights)",
        "apply_model", "reset_prefix_cache", "wake_up(kv_cache)", "generate",
    ]  # fmt: skip
    # The second push ran with the weights back and no KV cache allocated (lower peak).
    assert llm.resident_at_load[1]["kv_cache"] == 0 < llm.resident_at_load[1]["weights"]
    assert llm.resident_at_load[0]["kv_cache"] > 0  # the first push, before any sleep


def test_loading_into_sleeping_weights_fails_in_the_fake(fake, state) -> None:
    _engine(fake)
    llm = fake_vllm.LLM.instances[-1]
    llm.sleep(level=1)
    with pytest.raises(RuntimeError, match="weights asleep"):
        llm.apply_model(lambda model: model.load_weights(state.items()))


def test_embedded_engine_has_the_same_protocol(engine) -> None:
    sampling = SamplingParams(max_new_tokens=2, seed=0)
    engine.sleep()
    with pytest.raises(RuntimeError, match="asleep"):
        engine.generate([[1]], 1, sampling)
    engine.wake_weights()
    engine.update_weights(dict(engine.model.state_dict()).items())
    with pytest.raises(RuntimeError, match=r"KV cache asleep: True"):
        engine.generate([[1]], 1, sampling)
    engine.wake_kv_cache()
    assert len(engine.generate([[1]], 1, sampling)[0]) == 1


# ---------------------------------------------------------------- weight stream checks
def test_missing_shard_passes_vllms_report_but_not_ours(fake, state) -> None:
    k_proj = "model.layers.0.self_attn.k_proj.weight"
    partial = {k: v for k, v in state.items() if k != k_proj}
    engine = _engine(fake)
    # vLLM's report: qkv_proj counts as loaded from q and v alone, so this push "succeeds"
    # and the k slice keeps its dummy values (the blind spot of issue 15, replayed).
    engine.update_weights(partial.items())
    stream = _Counting(partial.items())
    with pytest.raises(WeightStreamError, match=rf"1 expected tensor\(s\) never arrived.*{k_proj}"):
        engine.update_weights(stream, expected=_expected(state))
    assert stream.read == len(partial)
    with pytest.raises(RuntimeError, match="call update_weights"):
        engine.generate(PROMPTS, 1, SamplingParams(max_new_tokens=2, seed=0))


@pytest.mark.parametrize("checked", [True, False])
def test_unknown_weight_name_stops_the_push_naming_the_tensor(fake, state, checked) -> None:
    bad = "model.layers.1.self_attn.x_proj.weight"
    items = [*state.items(), (bad, torch.zeros(8, 32))]
    engine = _engine(fake)
    stream = _Counting(items)
    if checked:  # ours catches it before vLLM sees it, with the closest expected name
        with pytest.raises(WeightStreamError, match=rf"does not have: \['{bad}'\].*closest"):
            engine.update_weights(stream, expected=_expected(state))
    else:  # vLLM raises ValueError ("There is no module ..."); the adapter names the tensor
        with pytest.raises(ValueError, match=rf"failed on tensor '{bad}' \(ValueError: There is"):
            engine.update_weights(stream)
    assert stream.read == len(items)
    with pytest.raises(RuntimeError, match="call update_weights"):
        engine.generate(PROMPTS, 1, SamplingParams(max_new_tokens=2, seed=0))


def test_unknown_bias_is_skipped_by_vllm_but_caught_by_us(fake, state) -> None:
    extra = [*state.items(), ("model.layers.0.self_attn.q_proj.bias", torch.zeros(32))]
    engine = _engine(fake)
    engine.update_weights(iter(extra))  # vLLM: "skip loading extra bias for GPTQ models"
    with pytest.raises(WeightStreamError, match=r"q_proj\.bias"):
        engine.update_weights(iter(extra), expected=_expected(state))


@pytest.mark.parametrize("checked", [True, False])
def test_wrong_shape_is_named(fake, state, checked) -> None:
    name = "model.layers.0.mlp.up_proj.weight"
    items = {**state, name: torch.zeros(63, 32)}
    engine = _engine(fake)
    if checked:
        with pytest.raises(
            WeightStreamError, match=rf"{name}: got \[63, 32\], expected \[64, 32\]"
        ):
            engine.update_weights(items.items(), expected=_expected(state))
    else:  # vLLM's loader fails on the sizes only; the adapter adds the name
        with pytest.raises(ValueError, match=rf"failed on tensor '{name}' \(RuntimeError"):
            engine.update_weights(items.items())


def test_repeated_tensor_is_reported(fake, state) -> None:
    items = [*state.items(), ("model.norm.weight", state["model.norm.weight"])]
    with pytest.raises(WeightStreamError, match=r"sent twice: \['model.norm.weight'\]"):
        _engine(fake).update_weights(items, expected=_expected(state))


# ---------------------------------------------------------------- sampling settings
def test_vllm_validation_error_is_not_a_value_error_and_becomes_one(fake, state) -> None:
    assert not issubclass(fake_vllm.VLLMValidationError, ValueError)
    with pytest.raises(fake_vllm.VLLMValidationError):
        fake_vllm.SamplingParams(temperature=2.5)
    engine = _engine(fake)
    engine.update_weights(state.items())
    with pytest.raises(ValueError, match=r"rejected the sampling.*parameter=temperature") as err:
        engine.generate(PROMPTS, 2, SamplingParams(temperature=2.5, max_new_tokens=2))
    assert isinstance(err.value.__cause__, fake_vllm.VLLMValidationError)
    assert "rollout.temperature must be in [0.01, 2.0]" in str(err.value)


def test_logprobs_follow_processed_logprobs(fake, state) -> None:
    """With top-k, vLLM's processed log-probs are of the truncated, renormalised distribution;
    the adapter passes them on unchanged (and warns). The reference is computed here."""
    engine = _engine(fake)
    engine.update_weights(state.items())
    model = tiny_model(seed=0)
    sampling = SamplingParams(temperature=0.8, top_k=5, max_new_tokens=6, seed=3)
    for prompt, group in zip(PROMPTS, engine.generate(PROMPTS, 2, sampling), strict=True):
        for comp in group:
            ids = torch.tensor([prompt + comp.token_ids])
            with torch.no_grad():
                logits = model(input_ids=ids).logits[0].double() / 0.8
            rows = logits[len(prompt) - 1 : len(prompt) - 1 + len(comp.token_ids)]
            keep = truncation_mask(rows, 5, 1.0)
            processed = torch.log_softmax(rows.masked_fill(~keep, float("-inf")), dim=-1)
            raw = torch.log_softmax(rows, dim=-1)
            tok = torch.tensor(comp.token_ids)[:, None]
            got = torch.tensor(comp.logprobs, dtype=torch.float64)
            # fp32 forward of the fake vs fp64 softmax here
            torch.testing.assert_close(
                got, processed.gather(-1, tok).squeeze(-1), atol=1e-5, rtol=0
            )
            assert (got - raw.gather(-1, tok).squeeze(-1) > 1e-3).all()  # renormalised: higher


def test_no_logprobs_requested_means_none_returned(fake, state) -> None:
    engine = _engine(fake)
    engine.update_weights(state.items())
    llm = fake_vllm.LLM.instances[-1]
    out = llm.generate(
        [{"prompt_token_ids": [1, 2]}], [fake_vllm.SamplingParams(max_tokens=3, seed=1)]
    )
    assert out[0].outputs[0].logprobs is None
    with pytest.raises(RuntimeError, match="no per-token log-probs"):
        completions_from_outputs(out, 1)


# ---------------------------------------------------------------- tokenizer
def test_model_dir_without_tokenizer_needs_skip_tokenizer_init(fake, state) -> None:
    with pytest.raises(OSError, match="Can't load tokenizer"):
        _engine(fake, skip_tokenizer_init=False)
    engine = _engine(fake)  # the default skips it: token ids in and out
    assert fake_vllm.LLM.instances[-1].kwargs["skip_tokenizer_init"] is True
    engine.update_weights(state.items())
    with pytest.raises(ValueError, match="cannot pass text prompts"):
        fake_vllm.LLM.instances[-1].generate(["hello"], [fake_vllm.SamplingParams()])


# ---------------------------------------------------------------- seeds
def test_adjacent_prompt_seeds_share_no_vllm_child_seed(fake, state) -> None:
    """Prompt seeds s and s + 1 sent as is would give child 1 of the first and child 0 of the
    second the same vLLM seed: the same prompt twice would repeat a response."""
    engine = _engine(fake)
    engine.update_weights(state.items())
    prompt = [5, 6, 7]
    params = [SamplingParams(max_new_tokens=8, seed=s) for s in (40, 41)]
    out = engine.generate([prompt, prompt], 2, params)
    sent = fake_vllm.LLM.instances[-1].calls[-1][1]
    children = [seed + j for n, seed, _ in sent for j in range(n)]
    assert len(set(children)) == 4
    assert out[0][1].token_ids != out[1][0].token_ids
