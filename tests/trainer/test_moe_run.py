"""A tiny Qwen3-MoE trained by the trainer end to end on CPU, with routing replay.

``examples/tiny_cpu.yaml`` as a ``qwen3_moe`` (4 experts, top-2, decoupled head width,
auxiliary loss on), the megatron rollout engine recording the routing, ``update.routing_replay:
replay``, at EP 2 on 2 ranks (the two data-parallel ranks decode different prompts in
lockstep). One step, a checkpoint, a resumed second step, then ``reco-export`` and
``transformers``. The rollout's routing is the trainer's (``routing_mismatch == 0``: the same
router on the same weights; the KV cache changes only the attention kernel), so its log-probs
agree with the old-policy pass to fp32 noise (bound 1e-4 as in ``test_loop.py``), and the
router columns are logged.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from reco_megatron.testing import run_distributed
from reco_megatron.train import main
from tests.tiny_overrides import TINY_RUN

pytestmark = pytest.mark.dist
transformers = pytest.importorskip("transformers")

RUN = [
    *TINY_RUN,
    "model.family=qwen3_moe",
    "model.kv_channels=16",
    "model.moe.num_experts=4",
    "model.moe.router_topk=2",
    "model.moe.ffn_hidden_size=16",
    "model.moe.aux_loss_coeff=0.01",
    "parallel.expert_model_parallel_size=2",
    "rollout.engine=megatron",
    "update.routing_replay=replay",
    "update.measure_unreplayed=true",
    "eval.interval=0",
    "sft.steps=0",
    "checkpoint.save_interval=1",
]


def _run(rank, world_size, out: str, steps: int) -> None:
    args = ["examples/tiny_cpu.yaml", *RUN, f"trainer.output_dir={out}"]
    assert main([*args, f"trainer.max_steps={steps}"]) == 0


def _export(rank, world_size, ckpt: str, out: str) -> int:
    from reco_megatron.export import main as export

    return export([ckpt, out])


def test_moe_run_trains_resumes_and_exports(tmp_path: Path) -> None:
    run_distributed(_run, 2, args=(str(tmp_path), 1), timeout=900)
    run_distributed(_run, 2, args=(str(tmp_path), 2), timeout=900)  # resumes from step 1
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert row["routing_mismatch"] == 0.0 and row["routing_mismatch_layer"] == 0.0
        assert row["logprob_mismatch"] < 1e-4
        assert row["logprob_mismatch_free"] == pytest.approx(row["logprob_mismatch"], abs=1e-6)
        assert 1.0 <= row["moe_load_imbalance"] <= row["moe_load_imbalance_max"] <= 2.0
        assert row["moe_dropped_frac"] == 0.0 and row["moe_aux_loss"] > 0
    out = tmp_path / "hf"
    (status,) = run_distributed(
        _export, 1, args=(str(tmp_path / "checkpoints"), str(out)), timeout=300
    )
    assert status == 0
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    assert model.config.num_experts == 4 and model.config.head_dim == 16
