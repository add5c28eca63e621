"""The large examples' parallel layouts, rehearsed on 8 CPU ranks (marker ``layouts``).

Each case trains the tiny countdown task with the settings of a large example: its
``parallel``, ``loss``, ``optimizer`` and ``update`` blocks and its rollout sampling are read
from the example file (so a setting added there, e.g. token-budget micro-batches, is used here
without a change), and only what cannot run on 2 CPU cores is shrunk:

* ``8b``, ``examples/llama3.1-8b-instruct.yaml``: TP 2 + sequence parallel x DP 4, the
  distributed optimizer, token-budget micro-batches (the example's budget is its longest
  sequence; here the tiny run's, 96) with balanced data-parallel ranks, 4 mini-batches per
  rollout.
* ``70b``, ``examples/llama3.1-70b.yaml`` shrunk to 8 ranks: TP 2 (from 8) x PP 4 x virtual
  pipeline 2 + sequence parallel, DP 1; 8 layers, one per model chunk.

Both: a 32-wide model, 16 prompts x G 8 (8b) or 4 x 8 (70b) per step, 8 new tokens, the
embedded rollout engine (vLLM cannot run here; it receives the same HF weight stream), a
learning rate of 1e-3 without warm-up (the examples' 1e-6 after 10 warm-up steps would not move
a tiny model measurably in two steps), and no SFT warm-up but a reward an untrained model
earns (the share of digits in the response), so that both steps move the weights. Per case:

0. a one-process run with no step writes the initial weights (both layouts start from them:
   megatron initialises each pipeline stage from its own random stream), loaded resharded;
1. two RL steps on 8 ranks, checkpoint after each;
2. the same two steps in one process (TP = PP = DP = 1, no SP): the same responses, rewards
   and response lengths, losses and statistics to 1e-4 (fp32 summation order; see
   ``tests/trainer/test_loop.py`` for the tolerance's reasoning);
3. a copy of run 1 rewound to its step-1 checkpoint and resumed on 8 ranks: step 2's metrics
   row equals run 1's bit for bit (wall-clock columns aside).

Cost: four runs, two of them on 8 ranks; minutes per case on 2 cores (docs/benchmarks.md).
Each run has a hard timeout. Run with ``pytest -m layouts``; a plain ``pytest`` skips them.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from reco_megatron.config.loader import read_yaml
from reco_megatron.testing import run_distributed
from reco_megatron.train import main
from reco_megatron.trainer.reporting import is_wall_clock
from tests.tiny_overrides import TINY_RUN

pytestmark = [pytest.mark.layouts, pytest.mark.dist, pytest.mark.slow]

RUN_TIMEOUT = 1200
"""Seconds one run may take before it is killed (8 ranks on 2 shared cores)."""

FROM_EXAMPLE = ("parallel", "loss", "optimizer", "update")
"""Blocks taken whole from the example."""
ROLLOUT_KEYS = ("group_size", "temperature", "top_p")

CASES = {
    "8b": (
        "examples/llama3.1-8b-instruct.yaml",
        ["model.num_layers=2", "rollout.prompts_per_step=16"],
    ),
    "70b": (
        "examples/llama3.1-70b.yaml",
        [
            "parallel.tensor_model_parallel_size=2",  # 8 in the example: 8 ranks in all here
            "model.num_layers=8",  # PP 4 x VP 2 chunks of one layer
            "rollout.prompts_per_step=4",
        ],
    ),
}

SHRUNK = [
    "model.hidden_size=32",
    "model.ffn_hidden_size=64",
    "model.num_attention_heads=4",
    "model.num_query_groups=2",
    "rollout.max_new_tokens=8",
    "optimizer.lr=1e-3",
    "optimizer.lr_warmup_steps=0",
    "sft.steps=0",
    "reward.reward=tests.trainer._dense_reward:digit_share",  # signal without a warm-up
    "trainer.max_steps=2",
    "checkpoint.save_interval=1",
]
"""What every case shrinks or changes, applied over the example's settings."""


TINY_LONGEST = 96
"""The tiny run's longest sequence (max_prompt_len 80 + max_new_tokens 8), rounded up to 16:
the examples set their token budget to their longest sequence, so the shrunk cases do too."""


def example_overrides(path: str) -> list[str]:
    """The example's blocks :data:`FROM_EXAMPLE` and rollout sampling as dotted overrides."""
    data = read_yaml(path)
    out = []
    for block in FROM_EXAMPLE:
        for key, value in (data.get(block) or {}).items():
            if block == "update" and key == "max_tokens_per_microbatch" and value is not None:
                value = TINY_LONGEST
            out.append(f"{block}.{key}={json.dumps(value)}")
    for key in ROLLOUT_KEYS:
        out.append(f"rollout.{key}={json.dumps(data['rollout'][key])}")
    return out


def case_overrides(case: str) -> list[str]:
    """The tiny run's sizes, the example's settings over them, then what must shrink."""
    path, shrink = CASES[case]
    return [*TINY_RUN, *example_overrides(path), *SHRUNK, *shrink]


SINGLE = [
    "parallel.tensor_model_parallel_size=1",
    "parallel.pipeline_model_parallel_size=1",
    "parallel.virtual_pipeline_model_parallel_size=null",
    "parallel.sequence_parallel=false",
]


def _train(rank: int, world_size: int, out: str, overrides: list[str]) -> None:
    code = main(["examples/tiny_cpu.yaml", *overrides, f"trainer.output_dir={out}"])
    assert code == 0, f"rank {rank}: exit {code}"


def _rows(out: Path) -> list[dict]:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return [{k: v for k, v in r.items() if not is_wall_clock(k)} for r in rows]


@pytest.mark.parametrize("case", sorted(CASES))
def test_example_layout_on_8_ranks_equals_one_process_and_resumes_exactly(
    case: str, tmp_path: Path
) -> None:
    # One set of initial weights for both layouts: megatron initialises each pipeline stage's
    # layers from its own random stream, so PP 4 alone would start elsewhere than PP 1.
    init = tmp_path / "init"
    run_distributed(
        _train,
        1,
        args=(str(init), [*case_overrides(case), *SINGLE, "trainer.max_steps=0"]),
        timeout=RUN_TIMEOUT,
    )
    overrides = [*case_overrides(case), f"checkpoint.init_megatron={init / 'checkpoints'}"]
    full = tmp_path / "full"
    run_distributed(_train, 8, args=(str(full), overrides), timeout=RUN_TIMEOUT)
    rows = _rows(full)
    assert [r["step"] for r in rows] == [1, 2]

    one = tmp_path / "one"
    run_distributed(_train, 1, args=(str(one), [*overrides, *SINGLE]), timeout=RUN_TIMEOUT)
    for got, want in zip(rows, _rows(one), strict=True):
        # Same responses; their fp32 means are summed in another order across DP ranks.
        for key in ("reward_mean", "response_len_mean", "unique_frac"):
            assert got[key] == pytest.approx(want[key], rel=1e-6), (got["step"], key)
        for key in ("loss", "entropy_mean", "clip_frac", "weight_mean", "grad_norm"):
            assert got[key] == pytest.approx(want[key], abs=1e-4, rel=1e-4), (got["step"], key)
        assert got["logprob_mismatch"] < 1e-4  # the rollout got the 8-rank trainer's weights
    assert rows[1]["grad_norm"] > 0 and rows[1]["loss"] != rows[0]["loss"]

    # Rewind a copy to the step-1 checkpoint and resume: step 2 again, bit for bit.
    again = tmp_path / "again"
    shutil.copytree(full, again)
    shutil.rmtree(again / "checkpoints" / "step_00000002")
    (again / "checkpoints" / "latest").write_text("step_00000001\n")
    run_distributed(_train, 8, args=(str(again), overrides), timeout=RUN_TIMEOUT)
    assert _rows(again) == rows
