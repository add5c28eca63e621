"""Hugging Face <-> Megatron conversion: logits, exact round trips, saved directories, CLI.

Tiny models are built by ``transformers`` from configs (no download): a Llama with GQA
(4 query heads, 2 kv heads, untied) and a Qwen2 (QKV bias, tied embeddings), fp32, eager
attention, vocabulary 100 (padded by Megatron to 128 at TP 1 and 256 at TP 2).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from reco_megatron.megatron.hf.config import (
    HFConfigError,
    hf_config_from_model_config,
    model_config_from_hf,
)
from reco_megatron.megatron.hf.convert import WeightMappingError, fuse_qkv, split_qkv
from reco_megatron.testing.multiprocess import run_distributed

transformers = pytest.importorskip("transformers")

VOCAB, SEQ = 100, 12
# Megatron and transformers run the same fp32 math with different kernels (baddbmm vs
# matmul attention, torch RMSNorm vs a hand-written one, RoPE tables built differently), so
# logits of |z| <= ~6 agree to a few fp32 ulps accumulated over 2 layers: measured max |diff|
# 3.4e-6 (TP 1) to 4.9e-6 (TP 2) on both stacks; a k/v swap in the QKV layout gives 7.5.
LOGITS_ATOL, LOGITS_RTOL = 1e-5, 1e-5


def hf_config_dict(family: str) -> dict[str, Any]:
    common = dict(
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
    )
    if family == "llama":
        return dict(common, model_type="llama", rope_theta=500000.0, tie_word_embeddings=False)
    return dict(common, model_type="qwen2", rope_theta=10000.0, tie_word_embeddings=True)


def build_hf(family: str, seed: int = 0) -> Any:
    """A randomly initialised tiny HF model (norm weights and biases randomised too)."""
    cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}[family]
    # std 0.25 (not 0.02): peaked attention and O(1) logits, so a misplaced head shows.
    config = cls(**hf_config_dict(family), attn_implementation="eager", initializer_range=0.25)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                param.copy_(torch.randn_like(param) * 0.1 + (1.0 if "norm" in name else 0.0))
    return model


def tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(5))


def hf_logits(model: Any) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens()).logits


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def hf_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict:
    model = build_hf(request.param)
    path = tmp_path_factory.mktemp(f"hf-{request.param}")
    model.save_pretrained(path)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    return {"family": request.param, "dir": path, "logits": hf_logits(model), "state": state}


# ------------------------------------------------------------------ inside ranks
def _megatron_logits(chunks: list[Any], vocab: int) -> torch.Tensor | None:
    """Full, unpadded logits ``[B, S, V]`` on the last stage (None elsewhere); PP by hand."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    (model,) = chunks
    toks = tokens()
    pos = torch.arange(SEQ).unsqueeze(0).expand_as(toks)
    pp, stage = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
    ranks = dist.get_process_group_ranks(ps.get_pipeline_model_parallel_group())
    with torch.no_grad():
        if stage > 0:
            hidden = torch.empty(SEQ, toks.shape[0], model.config.hidden_size)
            dist.recv(hidden, src=ranks[stage - 1])
            model.set_input_tensor(hidden)
        out = model(toks, pos, None)
        if stage < pp - 1:
            dist.send(out.contiguous(), dst=ranks[stage + 1])
            return None
    if ps.get_tensor_model_parallel_world_size() > 1:
        out = gather_from_tensor_model_parallel_region(out)
    return out[..., :vocab]


def _build_chunks(model_cfg: Any, tp: int, pp: int) -> list[Any]:
    from megatron.core import parallel_state as ps

    from reco_megatron.megatron.distributed import ParallelConfig, initialize_parallel
    from reco_megatron.megatron.model.build import build_model, transformer_config

    parallel = ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    initialize_parallel(parallel, seed=1)
    config = transformer_config(model_cfg, parallel, on_gpu=False)
    return [
        build_model(
            model_cfg,
            config,
            pre_process=ps.is_pipeline_first_stage(),
            post_process=ps.is_pipeline_last_stage(),
            on_gpu=False,
        )
    ]


def _import_export(rank: int, world: int, hf_dir: str, tp: int, pp: int, out_dir: str) -> dict:
    """Import ``hf_dir`` at (tp, pp), compute logits, export and save back."""
    from reco_megatron.megatron.hf.checkpoint import gather_hf_weights, load_hf_checkpoint
    from reco_megatron.megatron.hf.checkpoint import save_hf_checkpoint as save

    model_cfg = model_config_from_hf(hf_dir)  # default padding: 100 -> 128 * TP
    chunks = _build_chunks(model_cfg, tp, pp)
    load_hf_checkpoint(hf_dir, chunks, model_cfg)
    logits = _megatron_logits(chunks, model_cfg.vocab_size)
    exported = {name: t.clone() for name, t in gather_hf_weights(chunks, model_cfg)}
    save(out_dir, chunks, model_cfg, tokenizer_dir=None, max_shard_size=20_000)
    return {"logits": logits, "exported": exported}


LAYOUTS = [(1, 1), (2, 1), (1, 2)]


@pytest.mark.dist
@pytest.mark.parametrize("tp,pp", LAYOUTS, ids=[f"tp{t}pp{p}" for t, p in LAYOUTS])
def test_import_logits_and_exact_round_trip(hf_model: dict, tp: int, pp: int, tmp_path) -> None:
    out = tmp_path / "hf-out"
    world = tp * pp
    results = run_distributed(
        _import_export, world, args=(str(hf_model["dir"]), tp, pp, str(out)), timeout=120
    )
    ref = hf_model["logits"]
    last = results[-1]["logits"]  # the last stage holds the (TP-gathered) logits
    torch.testing.assert_close(last, ref, atol=LOGITS_ATOL, rtol=LOGITS_RTOL)
    # Round trip HF -> Megatron -> HF: bit-exact (pure copies, concatenations and slices).
    exported, state = results[0]["exported"], dict(hf_model["state"])
    if hf_model["family"] == "qwen2":
        assert torch.equal(state.pop("lm_head.weight"), state["model.embed_tokens.weight"])
    assert sorted(exported) == sorted(state)  # same names (megatron's parameter order)
    for name, tensor in state.items():
        assert torch.equal(exported[name], tensor), name
    assert all(r["exported"] == {} for r in results[1:])  # only rank 0 receives
    # The pairs are what a transformers model's load_state_dict (and vLLM's load_weights)
    # takes: only a tied lm_head is left out.
    fresh = build_hf(hf_model["family"], seed=1)
    result = fresh.load_state_dict(exported, strict=False)
    assert not result.unexpected_keys
    assert result.missing_keys == (["lm_head.weight"] if hf_model["family"] == "qwen2" else [])
    assert torch.equal(hf_logits(fresh), ref)
    # The saved directory (several files at a 20 kB shard limit) loads in transformers.
    assert (out / "model.safetensors.index.json").is_file()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager")
    assert torch.equal(hf_logits(loaded.float().eval()), ref)


# ------------------------------------------------------------------ layouts and configs
def test_qkv_layout_is_group_major() -> None:
    cfg = model_config_from_hf(dict(hf_config_dict("llama"), hidden_size=4))  # d = 1, r = 2
    q, k, v = torch.arange(4.0), torch.tensor([10.0, 11.0]), torch.tensor([20.0, 21.0])
    fused = fuse_qkv(q, k, v, cfg)
    assert fused.tolist() == [0, 1, 10, 20, 2, 3, 11, 21]  # per group: [q_0 q_1; k; v]
    assert all(torch.equal(a, b) for a, b in zip(split_qkv(fused, cfg), (q, k, v), strict=True))


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_config_round_trip_loads_in_transformers(family: str) -> None:
    cfg = model_config_from_hf(hf_config_dict(family))
    assert (cfg.family, cfg.query_groups, cfg.ffn_hidden_size) == (family, 2, 48)
    assert cfg.tie_word_embeddings is (family == "qwen2")
    written = hf_config_from_model_config(cfg)
    assert model_config_from_hf(written) == cfg
    hf_cfg = transformers.AutoConfig.for_model(**written)
    assert hf_cfg.num_key_value_heads == 2 and hf_cfg.tie_word_embeddings is (family == "qwen2")
    transformers.AutoModelForCausalLM.from_config(hf_cfg)  # builds


def test_llama3_rope_scaling_both_config_generations() -> None:
    scaling = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=8192)  # fmt: skip
    v4 = dict(hf_config_dict("llama"), rope_scaling=scaling)
    v5 = dict(hf_config_dict("llama"), rope_parameters=dict(scaling, rope_theta=500000.0))
    v5.pop("rope_theta")
    for raw in (v4, v5):
        cfg = model_config_from_hf(raw)
        assert (cfg.rotary_base, cfg.rope_scaling_factor) == (500000.0, 8.0)
    written = hf_config_from_model_config(model_config_from_hf(v4))
    assert transformers.AutoConfig.for_model(**written).rope_parameters["factor"] == 8.0


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "'yarn' is not supported"),
        (dict(rope_scaling={"type": "llama3", "factor": 8.0, "high_freq_factor": 2.0}),
         "high_freq_factor=2.0"),
        (dict(attention_bias=True), "attention_bias=True"),
        (dict(hidden_act="gelu"), "hidden_act='gelu'"),
        (dict(model_type="mistral"), "model_type='mistral'"),
        (dict(head_dim=16), "head_dim=16"),
    ],
)  # fmt: skip
def test_unsupported_configs_name_the_field(change: dict, match: str) -> None:
    with pytest.raises(HFConfigError, match=match):
        model_config_from_hf(dict(hf_config_dict("llama"), **change))


# ------------------------------------------------------------------ import errors
def _tampered(src: Path, dst: Path, edit: Any) -> Path:
    from safetensors.torch import load_file, save_file

    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    tensors = load_file(src / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors")
    return dst


def test_missing_and_unexpected_tensors_are_named(hf_model: dict, tmp_path: Path) -> None:
    from reco_megatron.megatron.hf.checkpoint import load_hf_checkpoint

    cfg = model_config_from_hf(hf_model["dir"])
    name = "model.layers.1.mlp.up_proj.weight"
    missing = _tampered(hf_model["dir"], tmp_path / "a", lambda t: t.pop(name))
    with pytest.raises(WeightMappingError, match=name):
        load_hf_checkpoint(missing, [], cfg)
    extra = _tampered(
        hf_model["dir"], tmp_path / "b", lambda t: t.update({"model.extra.weight": torch.ones(1)})
    )
    with pytest.raises(WeightMappingError, match=r"model\.extra\.weight"):
        load_hf_checkpoint(extra, [], cfg)
    other = model_config_from_hf(hf_model["dir"], ffn_hidden_size=64)
    with pytest.raises(ValueError, match="ffn_hidden_size: 48 vs 64"):
        load_hf_checkpoint(hf_model["dir"], [], other)
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "config.json").write_text((hf_model["dir"] / "config.json").read_text())
    with pytest.raises(FileNotFoundError, match=r"model\.safetensors"):
        load_hf_checkpoint(tmp_path / "c", [], cfg)


def _load_into_chunks(rank: int, world: int, hf_dir: str) -> str:
    from reco_megatron.megatron.hf.checkpoint import load_hf_checkpoint

    cfg = model_config_from_hf(hf_dir)
    try:
        load_hf_checkpoint(hf_dir, _build_chunks(cfg, 1, 1), cfg)
    except WeightMappingError as exc:
        return str(exc)
    return "no error"


@pytest.mark.dist
def test_shape_mismatch_names_the_tensor(hf_model: dict, tmp_path: Path) -> None:
    name = "model.layers.0.self_attn.k_proj.weight"
    bad = _tampered(hf_model["dir"], tmp_path / "bad", lambda t: t.update({name: t[name][:-1]}))
    (message,) = run_distributed(_load_into_chunks, 1, args=(str(bad),), timeout=60)
    assert f"{name} has shape [15, 32] but the model config expects [16, 32]" in message


# ------------------------------------------------------------------ engine and CLI
def _engine_save(rank: int, world: int, root: str, hf_dir: str) -> dict:
    """A TP-2 engine loaded from HF, trained one rollout, checkpointed; its logits."""
    from reco_megatron.megatron.checkpoint import save_checkpoint
    from reco_megatron.megatron.hf.checkpoint import gather_hf_weights
    from reco_megatron.megatron.hf.converter import load_hf_into_engine
    from tests.megatron import _reco

    cfg = model_config_from_hf(hf_dir, make_vocab_size_divisible_by=32)
    engine = _reco.build_engine(tp=2, model=cfg, lr=1e-3)
    load_hf_into_engine(hf_dir, engine)
    loaded = _megatron_logits(engine.unwrapped(), VOCAB)
    prepared, _ = engine.prepare(_reco.dp_share(_reco.rollout_batch()))
    engine.train_on_rollout(prepared)
    save_checkpoint(root, 1, engine, {"note": "test"})
    weights = {n: t.clone() for n, t in gather_hf_weights(engine.unwrapped(), cfg)}
    return {"loaded": loaded, "trained": _megatron_logits(engine.unwrapped(), VOCAB), **weights}


def _cli(rank: int, world: int, argv: list[str]) -> int:
    from reco_megatron.export import main

    return main(argv)


@pytest.mark.dist
def test_engine_load_and_cli_export(hf_model: dict, tmp_path: Path) -> None:
    root, out = tmp_path / "ckpt", tmp_path / "hf"
    (res, _) = run_distributed(_engine_save, 2, args=(str(root), str(hf_model["dir"])), timeout=180)
    torch.testing.assert_close(res["loaded"], hf_model["logits"], atol=LOGITS_ATOL, rtol=0)
    # Two Adam steps of lr 1e-3 (eps 1e-3 bounds |update| <= lr) moved the weights a little
    # from the loaded values, not back to the random init. (In fp32 the distributed
    # optimizer's main params are views of the model params; with bf16 params it is
    # reload_model_params that keeps them from being stale.)
    steps = max((res[n] - t).abs().max().item() for n, t in hf_model["state"].items() if n in res)
    assert 1e-5 < steps <= 2.5e-3
    (status,) = run_distributed(_cli, 1, args=([str(root), str(out)],), timeout=120)
    assert status == 0
    assert json.loads((out / "config.json").read_text())["model_type"] == hf_model["family"]
    exported = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager")
    logits = hf_logits(exported.float().eval())
    torch.testing.assert_close(logits, res["trained"], atol=LOGITS_ATOL, rtol=LOGITS_RTOL)


def test_cli_rejects_missing_or_invalid_checkpoint(tmp_path: Path, caplog) -> None:
    from reco_megatron.export import main

    assert main([str(tmp_path / "nope"), str(tmp_path / "out")]) == 2
    assert "does not exist" in caplog.text
    (tmp_path / "empty").mkdir()
    assert main([str(tmp_path / "empty"), str(tmp_path / "out")]) == 2
    assert "neither a checkpoint" in caplog.text
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "meta.json").write_text("{not json")
    assert main([str(tmp_path / "bad"), str(tmp_path / "out")]) == 2
    assert "corrupted" in caplog.text
