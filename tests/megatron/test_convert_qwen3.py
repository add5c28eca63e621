"""Hugging Face <-> Megatron for Qwen3 (QK layernorm, decoupled head width) and Qwen3-MoE.

Tiny random models are built by ``transformers``' own config classes (no download): 2 layers,
hidden 32, 4 query heads x head_dim 16 (= 64, not the hidden size: Qwen3's decoupled width),
2 kv heads, vocabulary 100; Qwen3-MoE with 8 experts, top-2, expert width 24, renormalised
top-k probabilities. Norm weights are randomised (Qwen3's q/k norms included) and the init
std is 0.25, so attention is peaked and a misplaced head or expert shows in the logits.

Checked: Megatron logits after import equal transformers' (dense at TP 2, MoE at EP 2; TP 1
and EP 1 were also measured when written); HF -> Megatron -> HF is bit-exact against the
safetensors ``save_pretrained`` wrote (the checkpoint layout: one tensor per expert, what vLLM
loads); the directory
``save_hf_checkpoint`` writes loads with ``from_pretrained`` (transformers 5 fuses the experts
on load) with ``torch.equal`` logits; the embedded rollout engine takes the weight stream into
transformers' fused expert tensors and generates.

Tolerance: fp32, different kernels (see ``test_convert.py``): logits to 1e-5; measured max
|diff| 9.5e-7 (Qwen3, TP 1) and 2.3e-6 (Qwen3-MoE, EP 2) for logits up to ~5.6.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from reco_megatron.megatron.hf.config import (
    HFConfigError,
    hf_config_from_model_config,
    model_config_from_hf,
)
from reco_megatron.testing.multiprocess import run_distributed
from tests.megatron import test_convert as base

transformers = pytest.importorskip("transformers")

LOGITS_ATOL = LOGITS_RTOL = 1e-5
COMMON = dict(
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=base.VOCAB,
    max_position_embeddings=64,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=False,
)
MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=24, norm_topk_prob=True)


def build_hf(family: str, seed: int = 0) -> Any:
    if family == "qwen3":
        config = transformers.Qwen3Config(**COMMON)
    else:
        config = transformers.Qwen3MoeConfig(**COMMON, **MOE)
    config._attn_implementation = "eager"
    config.initializer_range = 0.25
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(torch.randn_like(param) * 0.1 + 1.0)
    return model


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """``hf_models(family)``: the saved tiny model of a family (built once per module)."""
    from safetensors.torch import load_file

    cache: dict[str, dict] = {}

    def get(family: str) -> dict:
        if family not in cache:
            model = build_hf(family)
            path = tmp_path_factory.mktemp(f"hf-{family}")
            model.save_pretrained(path)
            saved = load_file(str(path / "model.safetensors"))
            cache[family] = {"dir": path, "logits": base.hf_logits(model), "saved": saved}
        return cache[family]

    return get


def _import_export(rank: int, world: int, hf_dir: str, tp: int, ep: int, out_dir: str) -> dict:
    """Import at (tp, ep), logits, export, save; rank 0 also generates with the embedded
    engine from the weight stream (every rank exhausts the collective stream)."""
    from megatron.core import parallel_state as ps

    from reco_megatron.megatron.distributed import ParallelConfig, initialize_parallel
    from reco_megatron.megatron.hf.checkpoint import (
        all_stage_hf_weights,
        gather_hf_weights,
        load_hf_checkpoint,
        save_hf_checkpoint,
    )
    from reco_megatron.megatron.model.build import build_model, transformer_config
    from reco_megatron.rollout.embedded import EmbeddedEngine
    from reco_megatron.rollout.embedded_config import EmbeddedEngineConfig
    from reco_megatron.rollout.requests import SamplingParams

    cfg = model_config_from_hf(hf_dir)
    parallel = ParallelConfig(tensor_model_parallel_size=tp, expert_model_parallel_size=ep)
    initialize_parallel(parallel, seed=1)
    config = transformer_config(cfg, parallel, on_gpu=False)
    chunks = [build_model(cfg, config, pre_process=True, post_process=True, on_gpu=False)]
    load_hf_checkpoint(hf_dir, chunks, cfg)
    logits = base._megatron_logits(chunks, cfg.vocab_size)
    exported = {name: t.clone() for name, t in gather_hf_weights(chunks, cfg)}
    save_hf_checkpoint(out_dir, chunks, cfg, tokenizer_dir=None, max_shard_size=40_000)
    hf = hf_config_from_model_config(cfg)
    engine = EmbeddedEngine(
        hf, EmbeddedEngineConfig(max_batch_size=4, eos_token_ids=(), attn_implementation="eager")
    )
    engine.update_weights(all_stage_hf_weights(chunks, cfg))
    sampling = SamplingParams(temperature=1.0, max_new_tokens=6, seed=3)
    completions = engine.generate([[5, 17, 3], [9, 1, 44]], 2, sampling)
    return {
        "logits": logits,
        "exported": exported if ps.get_data_parallel_rank() == 0 and rank == 0 else {},
        "generated": [[c.token_ids for c in group] for group in completions],
        "engine_logits": engine.model(base.tokens()).logits.detach(),
    }


CASES = [("qwen3", 2, 1), ("qwen3_moe", 1, 2)]


@pytest.mark.dist
@pytest.mark.parametrize(("family", "tp", "ep"), CASES, ids=["qwen3-tp2", "moe-ep2"])
def test_import_logits_round_trip_and_export(hf_models, family, tp, ep, tmp_path) -> None:
    hf_model = hf_models(family)
    out = tmp_path / "hf-out"
    world = tp * ep
    results = run_distributed(
        _import_export, world, args=(str(hf_model["dir"]), tp, ep, str(out)), timeout=240
    )
    ref = hf_model["logits"]
    for res in results:
        torch.testing.assert_close(res["logits"], ref, atol=LOGITS_ATOL, rtol=LOGITS_RTOL)
    # HF -> Megatron -> HF is bit-exact in the checkpoint layout (one tensor per expert)
    exported, saved = results[0]["exported"], hf_model["saved"]
    assert sorted(exported) == sorted(saved)
    for name, tensor in saved.items():
        assert torch.equal(exported[name], tensor), name
    # the written directory loads in transformers (which fuses the experts) with equal logits
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager")
    assert torch.equal(base.hf_logits(loaded.float().eval()), ref)
    if family == "qwen3_moe":
        assert (out / "model.safetensors.index.json").is_file()  # sharded at 40 kB
    # the embedded engine took the stream into transformers' own layout: same model. Not bit
    # for bit: the engine runs in a rank process (1 thread), the reference in this one, and on
    # an AVX-512 AMD EPYC the MoE logits of the two differ by 1.4e-6 (bit-equal on the machine
    # that first ran this); a wrong weight mapping is off by O(1)
    for res in results:
        torch.testing.assert_close(res["engine_logits"], ref, atol=LOGITS_ATOL, rtol=LOGITS_RTOL)
        assert res["generated"] == results[0]["generated"]
        assert all(len(ids) == 6 for group in res["generated"] for ids in group)


# ------------------------------------------------------------------ configs
@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_config_round_trip_loads_in_transformers(family: str) -> None:
    source = build_hf(family).config.to_dict()
    cfg = model_config_from_hf(source)
    assert cfg.head_dim == 16 and cfg.kv_channels == 16 and cfg.traits.qk_layernorm
    written = hf_config_from_model_config(cfg)
    again = transformers.AutoConfig.for_model(written.pop("model_type"), **written)
    assert model_config_from_hf(again.to_dict()) == cfg
    if family == "qwen3_moe":
        assert cfg.moe is not None
        assert (cfg.moe.num_experts, cfg.moe.router_topk, cfg.moe.ffn_hidden_size) == (8, 2, 24)
        assert cfg.moe.norm_topk_prob is True


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"mlp_only_layers": [0]}, "mlp_only_layers"),
        ({"decoder_sparse_step": 2}, "decoder_sparse_step"),
        ({"attention_bias": True}, "attention_bias"),
        ({"num_experts_per_tok": None}, "num_experts_per_tok"),
    ],
)
def test_unsupported_qwen3_moe_configs_name_the_field(change: dict, match: str) -> None:
    source = {**build_hf("qwen3_moe").config.to_dict(), **change}
    with pytest.raises(HFConfigError, match=match):
        model_config_from_hf(source)


def test_models_without_a_qwen3_moe_checkpoint_layout_are_refused_on_export() -> None:
    from dataclasses import replace

    cfg = model_config_from_hf(build_hf("qwen3_moe").config.to_dict())
    assert cfg.moe is not None
    shared = replace(cfg, moe=replace(cfg.moe, shared_expert_ffn_hidden_size=16))
    with pytest.raises(HFConfigError, match="shared expert"):
        hf_config_from_model_config(shared)
    dropping = replace(cfg, moe=replace(cfg.moe, capacity_factor=1.0))
    with pytest.raises(HFConfigError, match="capacity_factor"):
        hf_config_from_model_config(dropping)
    llama = dict(base.hf_config_dict("llama"), head_dim=16)
    with pytest.raises(HFConfigError, match="decoupled head widths"):
        model_config_from_hf(llama)


def test_a_missing_expert_tensor_is_named(tmp_path: Path) -> None:
    # a qwen3_moe directory without one expert tensor is refused before anything loads
    from safetensors.torch import load_file, save_file

    from reco_megatron.megatron.hf.checkpoint import check_hf_checkpoint
    from reco_megatron.megatron.hf.convert import WeightMappingError

    model = build_hf("qwen3_moe")
    model.save_pretrained(tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    del tensors["model.layers.1.mlp.experts.7.down_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(WeightMappingError, match=r"experts\.7\.down_proj"):
        check_hf_checkpoint(tmp_path, model_config_from_hf(tmp_path))
