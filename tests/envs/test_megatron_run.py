"""Multi-turn episodes through the whole trainer on the megatron engine at TP 2 and PP 2:
the model-parallel group's first rank runs the environments, every rank drives the same
episodes, the log-probs the engine reported match the old-policy pass (observations left
out), and the env_* columns are filled."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from reco_megatron.testing import run_distributed
from reco_megatron.train import main
from tests.tiny_overrides import TINY_RUN

pytestmark = pytest.mark.dist

RUN = [
    *TINY_RUN,
    "rollout.engine=megatron",
    "rollout.max_new_tokens=16",
    "rollout.env=tests.envs._envs:Echo",
    "rollout.env_workers=2",
    "sft.steps=0",
    "trainer.max_steps=2",
    "checkpoint.save_interval=0",
]


def _run(rank, world_size, out: str, extra: list[str]):
    assert main(["examples/calculator_cpu.yaml", *RUN, f"trainer.output_dir={out}", *extra]) == 0


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)])
def test_episodes_train_on_the_megatron_engine_in_a_model_parallel_group(
    tmp_path: Path, tp: int, pp: int
) -> None:
    extra = [
        f"parallel.tensor_model_parallel_size={tp}",
        f"parallel.pipeline_model_parallel_size={pp}",
    ]
    run_distributed(_run, tp * pp, args=(str(tmp_path), extra), timeout=600)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert row["logprob_mismatch"] < 1e-4, row["logprob_mismatch"]
        assert row["env_tool_calls_mean"] > 0 and row["env_observation_frac"] > 0
        assert row["env_failed"] == 0 and row["rollout_mp_divergence"] == 0
