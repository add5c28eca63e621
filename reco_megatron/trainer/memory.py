"""The example configs' memory budgets: the tables of ``docs/rollout.md`` and ``docs/moe.md``.

``python -m reco_megatron.trainer.memory`` prints them (the estimate itself is
:mod:`reco_megatron.megatron.memory.estimate`; this module reads the example configs, which
the adapter below the trainer may not import).
"""

from __future__ import annotations

from reco_megatron.megatron import (
    H100_80GB_BYTES,
    ColocationBudget,
    colocation_budget,
    colocation_table,
)

EXAMPLES = (
    ("8B (TP 2, DP 4)", "examples/llama3.1-8b-instruct.yaml", 4),
    ("70B (TP 8, PP 4, DP 1)", "examples/llama3.1-70b.yaml", 1),
    ("70B (TP 8, PP 4, DP 2)", "examples/llama3.1-70b.yaml", 2),
)
"""The examples whose step is tabulated in ``docs/rollout.md`` (label, config, DP size)."""

MOE_EXAMPLES = (
    ("30B-A3B, 2 nodes (TP 4, EP 4, DP 4)", "examples/qwen3-30b-a3b.yaml", 4),
    ("30B-A3B, 4 nodes (TP 4, EP 4, DP 8)", "examples/qwen3-30b-a3b.yaml", 8),
)
"""The mixture-of-experts example, tabulated in ``docs/moe.md``."""


def example_budgets(
    gpu_bytes: int = H100_80GB_BYTES, examples: tuple[tuple[str, str, int], ...] = EXAMPLES
) -> dict[str, ColocationBudget]:
    """``examples`` (default :data:`EXAMPLES`) as budgets (configs read from the repository
    root)."""
    from reco_megatron.config import load_config
    from reco_megatron.trainer.config import TrainConfig

    out = {}
    for label, path, dp in examples:
        cfg = load_config(TrainConfig, path, [])
        out[label] = colocation_budget(
            cfg.model,
            cfg.parallel,
            data_parallel_size=dp,
            max_seq_len=cfg.rollout.max_prompt_len + cfg.rollout.max_new_tokens,
            gpu_memory_utilization=cfg.rollout.gpu_memory_utilization,
            gpu_bytes=gpu_bytes,
            distributed_optimizer=cfg.optimizer.use_distributed_optimizer,
            reference_model=cfg.loss.kl_coef > 0,
            tokens_per_microbatch=cfg.update.max_tokens_per_microbatch,
        )
    return out


if __name__ == "__main__":  # tables of docs/rollout.md and docs/moe.md: python -m ...memory
    import sys

    sys.stdout.write(colocation_table(example_budgets()) + "\n\n")
    sys.stdout.write(colocation_table(example_budgets(examples=MOE_EXAMPLES)) + "\n")
