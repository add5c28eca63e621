"""Every check that relates two sections runs when the config is loaded (``TrainConfig``),
before the job or any file is looked at; what needs the world size or the files stays in
``preflight``."""

from __future__ import annotations

from pathlib import Path

import pytest

from reco_megatron.config import ConfigError, load_config
from reco_megatron.trainer.config import TrainConfig
from reco_megatron.trainer.preflight import batch_problems

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "examples" / "tiny_cpu.yaml"  # prompts up to 80 tokens, responses up to 24


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (
            ["update.max_tokens_per_microbatch=96"],
            "update.max_tokens_per_microbatch=96 is below the longest sequence",
        ),
        (
            [
                "update.max_tokens_per_microbatch=4096",
                "update.sequence_packing=true",
                "parallel.context_parallel_size=2",
            ],
            "update.sequence_packing=true with context_parallel_size > 1 is not supported",
        ),
        (
            ["data.train_path=prompts.jsonl", "eval.interval=5"],
            "eval.interval=5 needs a held-out set: set data.eval_path",
        ),
        (["rollout.prompts_per_step=5"], "must be divisible by update.minibatches_per_rollout"),
        (["rollout.max_new_tokens=4096"], "exceeds model.max_position_embeddings"),
        (
            [
                "rollout.env=calculator",
                "rollout.engine=megatron",
                "parallel.expert_model_parallel_size=2",
            ],
            "set expert_model_parallel_size=1 or use rollout.engine=vllm",
        ),
    ],
)
def test_a_cross_section_problem_is_refused_on_load(overrides: list[str], expected: str) -> None:
    # the files named need not exist: these checks read the config alone
    with pytest.raises(ConfigError, match="TrainConfig: ") as info:
        load_config(TrainConfig, TINY, overrides)
    assert expected in str(info.value)


def test_budget_and_packing_problems_are_reported_together() -> None:
    overrides = [
        "update.max_tokens_per_microbatch=96",
        "update.sequence_packing=true",
        "parallel.context_parallel_size=2",
    ]
    with pytest.raises(ConfigError) as info:
        load_config(TrainConfig, TINY, overrides)
    (problem,) = info.value.problems
    assert "is below the longest sequence" in problem
    assert "with context_parallel_size > 1" in problem


def test_a_budget_that_holds_the_longest_sequence_loads() -> None:
    # 80 + 24 - 1 = 103 positions, rounded up to the length multiple 16: 112 is enough
    cfg = load_config(TrainConfig, TINY, ["update.max_tokens_per_microbatch=112"])
    assert batch_problems(cfg, 1) == []
