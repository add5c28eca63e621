"""The trainer's vLLM path on CPU: ``rollout.engine=vllm`` against ``tests/rollout/fake_vllm``.

The fake replays vLLM 0.33's loading (HF names stacked into fused ``qkv_proj`` /
``gate_up_proj`` parameters, unknown names raising, a fused parameter counted loaded from any
shard), its sleep mode (released weights and KV cache that fail when used) and samples with the
weights its parameters received. So this run checks, without a GPU, that the trainer builds the
engine the way vLLM 0.33 accepts (engine arguments, a config-only model directory with
``architectures``, no tokenizer), that it sleeps and wakes the engine in the right order, that
the Megatron export stream at TP 2 carries every tensor ``hf_shapes`` expects exactly once, and
that the log-probs coming back line up with the trainer's (``logprob_mismatch``, fp32 noise).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from reco_megatron.testing import run_distributed
from reco_megatron.train import main
from tests.tiny_overrides import TINY_RUN

pytestmark = pytest.mark.dist


def _run(rank: int, world: int, out: str) -> dict:
    import os

    from tests.rollout import fake_vllm

    fake_vllm.install()
    os.environ["LOCAL_RANK"] = str(rank)  # what torchrun sets; CPU has no device to take it from
    overrides = [
        *TINY_RUN,
        "rollout.engine=vllm",
        "sft.steps=0",
        "trainer.max_steps=2",
        "parallel.tensor_model_parallel_size=2",
        f"trainer.output_dir={out}",
    ]
    code = main(["examples/tiny_cpu.yaml", *overrides])
    (llm,) = fake_vllm.LLM.instances
    calls = [c if isinstance(c, str) else c[0] for c in llm.calls]
    return {
        "code": code,
        "kwargs": llm.kwargs,
        "calls": calls,
        "resident_at_load": llm.resident_at_load,
    }


def test_trainer_drives_vllm_through_the_export_stream(tmp_path: Path) -> None:
    from reco_megatron.config import load_config
    from reco_megatron.trainer.config import TrainConfig

    cfg = load_config(TrainConfig, "examples/tiny_cpu.yaml", TINY_RUN)
    results = run_distributed(_run, 2, args=(str(tmp_path),), timeout=600)
    for res in results:
        assert res["code"] == 0
        kw = res["kwargs"]
        assert kw["tensor_parallel_size"] == 2 and kw["load_format"] == "dummy"
        assert kw["distributed_executor_backend"] == "external_launcher"
        assert kw["skip_tokenizer_init"] is True and kw["max_model_len"] == (
            cfg.rollout.max_prompt_len + cfg.rollout.max_new_tokens
        )
        # The initial push into the freshly built (awake) engine, then per step: generate ->
        # sleep during the old-logprob pass and update -> wake the weights -> push (checked
        # per tensor) -> reset the prefix cache -> wake the KV cache. The fake raises if
        # anything generates or loads while asleep, so the run itself checks that too.
        step = [
            "generate", "sleep(1)", "wake_up(weights)", "apply_model", "reset_prefix_cache",
            "wake_up(kv_cache)",
        ]  # fmt: skip
        assert res["calls"] == ["apply_model", "reset_prefix_cache", *step, *step, "shutdown"]
        # Every push ran without the KV cache, except the first (engine just built).
        assert [r["kv_cache"] == 0 for r in res["resident_at_load"]] == [False, True, True]
    config = json.loads((tmp_path / "rollout_model" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    # The fake samples with the weights that reached its vLLM-named parameters: a tensor the
    # stream misnamed would have kept its dummy value (and failed the completeness check), and
    # a log-prob shifted by one token would show as a mismatch of order 1, not fp32 noise.
    assert all(r["logprob_mismatch"] < 1e-4 for r in rows), [r["logprob_mismatch"] for r in rows]
