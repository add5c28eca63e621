"""The rollout side of the trainer without a GPU: the model directory vLLM is pointed at."""

from __future__ import annotations

from pathlib import Path

from reco_megatron.config import load_config
from reco_megatron.megatron.hf.config import hf_config_from_model_config, model_config_from_hf
from reco_megatron.trainer.config import TrainConfig
from reco_megatron.trainer.orchestration import write_rollout_model_dir


def test_rollout_model_dir_describes_the_policy(tmp_path: Path) -> None:
    cfg = load_config(TrainConfig, "examples/tiny_cpu.yaml", [f"trainer.output_dir={tmp_path}"])
    out = write_rollout_model_dir(cfg, hf_config_from_model_config(cfg.model))
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(out)
    assert hf.num_hidden_layers == cfg.model.num_layers
    back = model_config_from_hf(out, make_vocab_size_divisible_by=64)
    assert back.hidden_size == cfg.model.hidden_size
    assert back.query_groups == cfg.model.query_groups


def test_megatron_rollout_rejects_what_it_cannot_decode_at_config_time(tmp_path: Path) -> None:
    import pytest

    base = ["rollout.engine=megatron", f"trainer.output_dir={tmp_path}"]
    cfg = load_config(TrainConfig, "examples/tiny_cpu.yaml", base)
    assert cfg.rollout.engine == "megatron"
    bad = {
        "virtual_pipeline": [
            "parallel.pipeline_model_parallel_size=2",
            "parallel.virtual_pipeline_model_parallel_size=2",
        ],
        "eval.interval": ["parallel.tensor_model_parallel_size=2", "eval.interval=5"],
    }
    for needle, overrides in bad.items():
        with pytest.raises(ValueError, match=needle):
            load_config(TrainConfig, "examples/tiny_cpu.yaml", [*base, *overrides])
    # the same layouts are fine with the embedded engine
    load_config(
        TrainConfig,
        "examples/tiny_cpu.yaml",
        [f"trainer.output_dir={tmp_path}", *bad["eval.interval"]],
    )
