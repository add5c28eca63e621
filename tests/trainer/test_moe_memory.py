"""The memory estimate of a mixture-of-experts model under expert parallelism (CPU, numbers)."""

from __future__ import annotations

from pathlib import Path

from reco_megatron.config import load_config
from reco_megatron.megatron.memory.estimate import (
    H100_80GB_BYTES,
    colocation_budget,
    colocation_table,
    colocation_warnings,
    parameter_counts,
)
from reco_megatron.trainer.config import TrainConfig
from reco_megatron.trainer.memory import MOE_EXAMPLES, example_budgets

EXAMPLE = "examples/qwen3-30b-a3b.yaml"


def _budget(dp: int, **parallel: object):
    cfg = load_config(TrainConfig, EXAMPLE, [f"parallel.{k}={v}" for k, v in parallel.items()])
    return cfg, colocation_budget(
        cfg.model,
        cfg.parallel,
        data_parallel_size=dp,
        max_seq_len=cfg.rollout.max_prompt_len + cfg.rollout.max_new_tokens,
        gpu_memory_utilization=cfg.rollout.gpu_memory_utilization,
        gpu_bytes=H100_80GB_BYTES,
    )


def test_parameter_counts_by_hand() -> None:
    cfg, _ = _budget(4)
    h, layers, v, d = 2048, 48, 151936, 128
    experts = layers * 128 * 3 * h * 768
    attention = h * 32 * d + 2 * h * 4 * d + 32 * d * h + 2 * d  # q, k, v, o, q/k norms
    dense = 2 * v * h + layers * (attention + 128 * h + 2 * h) + h  # + router, norms
    assert parameter_counts(cfg.model) == (dense, experts)
    assert abs(dense + experts - 30.53e9) < 0.01e9  # Qwen3-30B-A3B: 30.5B parameters


def test_experts_are_split_over_ep_and_their_adam_over_expert_dp() -> None:
    cfg, b = _budget(4)
    dense_all, experts_all = parameter_counts(cfg.model)
    h, layers, d, n = 2048, 48, 128, 128
    # TP 4, PP 1: attention matrices split over TP; norms, QK norms and the router replicated;
    # embedding and output layer (untied) at the vocabulary padded to 128 x TP = 152064
    table = 152064 // 4 * h
    attention = (h * 32 * d + 2 * h * 4 * d + 32 * d * h) // 4
    dense = layers * (attention + 2 * d + 2 * h + n * h) + 2 * table + h
    experts = experts_all // 16  # EP 4 x expert-TP 4 = 16 ranks
    assert b.weights == (dense + experts) * 2 and b.grads == (dense + experts) * 4
    # distributed optimizer: dense Adam state over DP 4, the experts' over expert-DP
    # = TP x DP / (EP x expert-TP) = 4 x 4 / 16 = 1
    assert b.optimizer == int((dense / 4 + experts / 1) * 12)
    _, wider = _budget(8)  # 4 nodes: expert-DP 2 halves the experts' Adam state
    assert wider.optimizer == int((dense / 8 + experts / 2) * 12)
    _, whole = _budget(4, expert_tensor_parallel_size=1)  # experts whole: 4x the expert state
    assert whole.weights == (dense + experts_all // 4) * 2
    assert b.vllm_weights == int((dense_all + experts_all) * 2 / 4)  # vLLM at the training TP


def test_example_fits_an_h100_on_2_and_4_nodes() -> None:
    for dp in (4, 8):
        _, b = _budget(dp)
        assert colocation_warnings(b) == []
        assert b.update_if_awake < H100_80GB_BYTES or dp == 4


def test_docs_table_is_the_codes() -> None:
    table = colocation_table(example_budgets(examples=MOE_EXAMPLES))
    assert table in Path("docs/moe.md").read_text()
