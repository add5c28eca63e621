"""The example configs' memory budgets, and the estimate checked against megatron-core.

``python -m reco_megatron.trainer.memory.budget`` prints the tables of ``docs/rollout.md`` and
``docs/moe.md``; :func:`compare` sets the estimate's static part beside what megatron-core
allocates on the meta device (its command line is :mod:`.memory_check`). The estimate itself
is the adapter's (its ``memory`` folder); this module reads the example configs, which the
adapter below the trainer may not import.
"""

from __future__ import annotations

from dataclasses import dataclass

from reco_megatron.megatron import (
    GIB,
    H100_80GB_BYTES,
    ColocationBudget,
    ModelState,
    colocation_budget,
    colocation_table,
    stage_state,
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


TOLERANCE = 0.02
"""Largest relative difference between measured and estimated bytes that passes."""


@dataclass(frozen=True)
class StageCheck:
    """One rank (TP rank 0, DP rank 0) of one pipeline stage of one layout."""

    layout: str
    stage: int
    measured: ModelState
    estimate: ModelState

    @property
    def worst(self) -> float:
        """The largest relative difference over weights, gradients and optimizer state."""
        return max(
            abs(getattr(self.estimate, k) - getattr(self.measured, k))
            / max(getattr(self.measured, k), 1)
            for k in ("weights", "grads", "optimizer")
        )


def compare(layouts: list[tuple[str, str, int]], overrides: list[str] = ()) -> list[StageCheck]:
    """``(label, config path, DP size)`` per layout (each with the dotted ``overrides``) ->
    one :class:`StageCheck` per pipeline stage."""
    from reco_megatron.config import load_config
    from reco_megatron.megatron import measure_rank_state
    from reco_megatron.trainer.config import TrainConfig

    out = []
    for label, path, dp in layouts:
        cfg = load_config(TrainConfig, path, list(overrides))
        for stage in range(cfg.parallel.pipeline_model_parallel_size):
            got = measure_rank_state(
                cfg.model, cfg.parallel, cfg.optimizer, data_parallel_size=dp, pipeline_stage=stage
            )
            want = stage_state(
                cfg.model,
                cfg.parallel,
                data_parallel_size=dp,
                stage=stage,
                distributed_optimizer=cfg.optimizer.use_distributed_optimizer,
            )
            measured = ModelState(weights=got.weights, grads=got.grads, optimizer=got.optimizer)
            out.append(StageCheck(label, stage, measured, want))
    return out


def table(checks: list[StageCheck]) -> str:
    """Markdown: GiB per rank, measured / estimated, and the largest relative difference."""
    lines = [
        "| layout | stage | weights | fp32 grads | optimizer | largest difference |",
        "|---|---|---|---|---|---|",
    ]
    for c in checks:
        cells = [
            f"{getattr(c.measured, k) / GIB:.3f} / {getattr(c.estimate, k) / GIB:.3f}"
            for k in ("weights", "grads", "optimizer")
        ]
        lines.append(f"| {c.layout} | {c.stage} | {' | '.join(cells)} | {c.worst:.2e} |")
    return "\n".join(lines)


if __name__ == "__main__":  # tables of docs/rollout.md and docs/moe.md: python -m ...memory
    import sys

    sys.stdout.write(colocation_table(example_budgets()) + "\n\n")
    sys.stdout.write(colocation_table(example_budgets(examples=MOE_EXAMPLES)) + "\n")
