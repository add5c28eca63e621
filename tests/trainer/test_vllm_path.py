"""The trainer's vLLM path on CPU: ``rollout.engine=vllm`` against ``tests/rollout/fake_vllm``.

The fake replays vLLM 0.33's loading (HF names stacked into fused ``qkv_proj`` /
``gate_up_proj`` parameters, unknown names ignored, completeness unchecked by vLLM itself) and
samples with the weights its parameters received. So this run checks, without a GPU, that the
trainer builds the engine the way vLLM 0.33 accepts (engine arguments, a config-only model
directory with ``architectures``), that the Megatron export stream at TP 2 reaches every vLLM
parameter, and that the log-probs coming back line up with the trainer's
(``logprob_mismatch``, fp32 noise).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from reco_megatron.testing import run_distributed
from reco_megatron.train import main
from tests.tiny_overrides import TINY_RUN

pytestmark = pytest.mark.dist


def _run(rank: int, world: int, out: str) -> dict:
    import os

    from tests.rollout import fake_vllm

    sys.modules["vllm"] = fake_vllm.module()
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
    return {"code": code, "kwargs": llm.kwargs, "calls": calls}


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
        # initial sync + one per step; reset after every push; one batched generate per step
        assert res["calls"].count("apply_model") == 3
        assert res["calls"].count("reset_prefix_cache") == 3
        assert res["calls"].count("generate") == 2
    config = json.loads((tmp_path / "rollout_model" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    # The fake samples with the weights that reached its vLLM-named parameters: a tensor the
    # stream misnamed would have kept its dummy value (and failed the completeness check), and
    # a log-prob shifted by one token would show as a mismatch of order 1, not fp32 noise.
    assert all(r["logprob_mismatch"] < 1e-4 for r in rows), [r["logprob_mismatch"] for r in rows]
