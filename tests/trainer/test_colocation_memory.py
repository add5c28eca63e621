"""The colocation memory estimate and its start-up warning, on the 8B and 70B examples (CPU)."""

from __future__ import annotations

import pytest

from reco_megatron.config import load_config
from reco_megatron.megatron.memory.estimate import GIB, colocation_budget, colocation_warnings
from reco_megatron.trainer.config import TrainConfig

H100_BYTES = 81559 * 2**20
"""An H100 80GB as ``nvidia-smi`` reports it (to confirm: ``total_memory`` of the device)."""


def _budget(path: str, dp: int, util: float | None = None, gpu: int = H100_BYTES):
    cfg = load_config(TrainConfig, path, [])
    return colocation_budget(
        cfg.model,
        cfg.parallel,
        data_parallel_size=dp,
        max_seq_len=cfg.rollout.max_prompt_len + cfg.rollout.max_new_tokens,
        gpu_memory_utilization=cfg.rollout.gpu_memory_utilization if util is None else util,
        gpu_bytes=gpu,
        reference_model=cfg.loss.kl_coef > 0,
    )


def test_8b_example_state_by_hand() -> None:
    b = _budget("examples/llama3.1-8b-instruct.yaml", dp=4)
    n = 8_030_261_248  # Llama-3.1-8B parameters (HF safetensors index total / 2 bytes)
    norms = (2 * 32 + 1) * 4096  # two per layer and the final one: whole on every TP rank
    rank = (n - norms) // 2 + norms  # vocabulary 128256 = 501 x 256: no padding at TP 2
    assert b.weights == rank * 2 and b.grads == rank * 4
    assert b.optimizer == rank * 12 // 4  # fp32 master + Adam m, v over DP 4
    assert b.vllm_weights == n * 2 // 2
    assert b.vllm_awake == int(0.4 * H100_BYTES)
    # one layer: s * (10 h + 4 kv + 6 F) / TP bytes, 32 layers, + fp32 logits and grads
    layer = 4096 * (10 * 4096 + 4 * 1024 + 6 * 14336) / 2
    logits = 4096 * 128256 / 2 * 10
    assert b.activations == int(max(32 * layer, 32 * layer + logits))


@pytest.mark.parametrize(
    ("path", "dp"),
    [("examples/llama3.1-8b-instruct.yaml", 4), ("examples/llama3.1-70b.yaml", 1)],
)
def test_examples_fit_an_h100_only_because_vllm_sleeps(path: str, dp: int) -> None:
    b = _budget(path, dp)
    assert colocation_warnings(b) == []
    assert all(need < H100_BYTES for need in b.phases.values())
    assert b.kv_tokens > 100_000  # room for many 4096-token sequences per engine
    if "70b" in path:  # the update with vLLM awake would not fit
        assert b.update_if_awake > H100_BYTES


def test_warning_names_the_phase_and_the_fix() -> None:
    b = _budget("examples/llama3.1-8b-instruct.yaml", dp=4, util=0.7)
    (msg,) = colocation_warnings(b)
    assert msg.startswith("estimated generate peak") and "rollout.gpu_memory_utilization" in msg
    small = _budget("examples/llama3.1-70b.yaml", dp=1, util=0.15)
    assert any("does not hold its weights" in m for m in colocation_warnings(small))
    tiny_gpu = _budget("examples/llama3.1-8b-instruct.yaml", dp=4, gpu=40 * GIB)
    phases = {m.split()[1] for m in colocation_warnings(tiny_gpu) if m.startswith("estimated")}
    assert phases == {"generate", "update", "refit"}


def test_docs_table_is_the_codes() -> None:
    """docs/rollout.md shows the table ``python -m reco_megatron.trainer.memory.budget`` prints."""
    from pathlib import Path

    from reco_megatron.megatron.memory.estimate import colocation_table
    from reco_megatron.trainer.memory import example_budgets

    assert colocation_table(example_budgets()) in Path("docs/rollout.md").read_text()


def test_start_up_check_reads_the_device_and_warns(monkeypatch) -> None:
    """``warn_if_colocation_overflows`` on a (pretend) 40 GiB GPU with the 8B example: every
    phase overflows and each is reported; without CUDA it says nothing."""
    from types import SimpleNamespace

    import torch

    from reco_megatron.trainer.orchestration import warn_if_colocation_overflows

    cfg = load_config(TrainConfig, "examples/llama3.1-8b-instruct.yaml", [])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert warn_if_colocation_overflows(cfg) == []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    props = SimpleNamespace(total_memory=40 * GIB)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    messages = warn_if_colocation_overflows(cfg)  # one process: DP 1, all Adam states here
    assert [m.split()[1] for m in messages] == ["generate", "update", "refit"]
    assert all("GPU 40.0 GiB" in m for m in messages)
