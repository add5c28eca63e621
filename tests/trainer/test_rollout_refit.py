"""``RolloutClient``: the refit sequence and the per-tensor check against ``hf_shapes``."""

from __future__ import annotations

import pytest

from reco_megatron.megatron.hf.config import model_config_from_hf
from reco_megatron.megatron.hf.convert import hf_shapes
from reco_megatron.rollout import SamplingParams, VLLMEngine, VLLMEngineConfig
from reco_megatron.rollout.weight_check import WeightStreamError
from reco_megatron.trainer.orchestration import RolloutClient
from tests.rollout import fake_vllm
from tests.rollout._tiny import TINY_LLAMA, tiny_model

TINY = model_config_from_hf(TINY_LLAMA)  # the tiny Llama the fake builds, as a ModelConfig


def test_hf_shapes_is_the_transformers_state_dict() -> None:
    """The expectation the trainer passes is exactly what the HF model holds."""
    state = tiny_model(seed=0).state_dict()
    assert hf_shapes(TINY) == {k: tuple(v.shape) for k, v in state.items()}


@pytest.fixture
def client(monkeypatch, tmp_path) -> RolloutClient:
    fake_vllm.prepare(monkeypatch, tmp_path)
    engine = VLLMEngine(VLLMEngineConfig(model=str(tmp_path), max_model_len=64))
    return RolloutClient(engine, SamplingParams(max_new_tokens=4), hf_shapes(TINY))


def test_refit_wakes_weights_pushes_then_wakes_kv(client) -> None:
    state = tiny_model(seed=0).state_dict()
    client.refit(iter(state.items()))  # awake engine: the wakes are no-ops
    client.generate_seeded([[1, 2]], 2, [7])
    client.sleep()
    client.refit(iter(state.items()))
    client.generate_seeded([[1, 2]], 2, [7])
    calls = [c if isinstance(c, str) else c[0] for c in fake_vllm.LLM.instances[-1].calls]
    assert calls == [
        "apply_model", "reset_prefix_cache", "generate", "sleep(1)", "wake_up(weights)",
        "apply_model", "reset_prefix_cache", "wake_up(kv_cache)", "generate",
    ]  # fmt: skip


def test_refit_missing_up_proj_stops_naming_it(client) -> None:
    state = {k: v for k, v in tiny_model(seed=0).state_dict().items() if "1.mlp.up_proj" not in k}
    client.sleep()
    with pytest.raises(WeightStreamError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        client.refit(iter(state.items()))
    with pytest.raises(RuntimeError, match=r"KV cache asleep: True"):  # refit stopped early
        client.generate_seeded([[1, 2]], 1, [0])
    client.engine.wake_kv_cache()
    with pytest.raises(RuntimeError, match="call update_weights"):  # the failed push counts
        client.generate_seeded([[1, 2]], 1, [0])


def test_vllm_temperature_range_is_checked_at_config_time() -> None:
    from reco_megatron.trainer.config import RolloutConfig

    with pytest.raises(ValueError, match=r"rollout.temperature=2.5 with rollout.engine=vllm"):
        RolloutConfig(engine="vllm", temperature=2.5)
    with pytest.raises(ValueError, match=r"in \[0.01, 2.0\]"):
        RolloutConfig(engine="vllm", temperature=0.005)
    RolloutConfig(engine="embedded", temperature=2.5)  # the embedded engine takes any
