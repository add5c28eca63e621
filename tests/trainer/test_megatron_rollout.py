"""``rollout.engine: megatron`` trains the tiny run end to end on CPU (TP 1, TP 2, PP 2).

A short SFT warm-up moves the weights before the first rollout, so a rollout engine that did
not decode with the live training weights would report log-probs of another policy; the
old-policy pass of the trainer must agree with the engine's log-probs to fp32 noise (the
embedded engine gets ~2.5e-7 on this run, the megatron engine the same; bound 1e-4 as in
``test_loop.py``). The weight sync sends nothing (the engine has no weights of its own).
"""

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
    "sft.steps=10",
    "sft.batch_size=8",
    "trainer.max_steps=2",
    "checkpoint.save_interval=0",
]


def _run(rank, world_size, out: str, extra: list[str]):
    assert main(["examples/tiny_cpu.yaml", *RUN, f"trainer.output_dir={out}", *extra]) == 0


@pytest.mark.parametrize(("tp", "pp"), [(1, 1), (2, 1), (1, 2)])
def test_megatron_engine_trains_the_tiny_run(tmp_path: Path, tp: int, pp: int) -> None:
    extra = [
        f"parallel.tensor_model_parallel_size={tp}",
        f"parallel.pipeline_model_parallel_size={pp}",
    ]
    run_distributed(_run, tp * pp, args=(str(tmp_path), extra), timeout=600)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert row["logprob_mismatch"] < 1e-4, row["logprob_mismatch"]
        assert row["response_len_mean"] > 0
        assert row["entropy_mean"] > 0
