"""Hugging Face ``config.json`` <-> :class:`~reco_megatron.megatron.model.build.ModelConfig`.

Supported: ``model_type`` ``llama`` (Llama 2/3/3.1/3.2, no biases), ``qwen2`` (Qwen2 /
Qwen2.5, bias on q/k/v only), ``qwen3`` (Qwen3 dense: per-head RMSNorm of q and k, decoupled
``head_dim``) and ``qwen3_moe`` (Qwen3-MoE: as qwen3 with mixture-of-experts layers),
SwiGLU (``hidden_act: silu``), RMSNorm, RoPE with or without Llama-3 scaling. Both config
generations are read: transformers 4.x (``rope_theta`` + ``rope_scaling``, ``num_experts``)
and 5.x (``rope_parameters``, ``num_local_experts``); :func:`hf_config_from_model_config`
writes the 4.x keys, which transformers 5.x and vLLM also read. Anything the Megatron model
would compute differently is refused with the offending field and value, never silently
dropped.
"""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path
from typing import Any

from reco_megatron.megatron.model.config import FAMILIES, ModelConfig
from reco_megatron.megatron.model.moe import MoEConfig

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}
assert set(ARCHITECTURES) == set(FAMILIES), "every family needs its HF architecture"
# megatron-core's RotaryEmbedding._apply_scaling hard-codes these (0.16 and 0.19); only the
# factor is configurable, so a checkpoint with other values cannot be reproduced.
LLAMA3_FIXED = {
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


class HFConfigError(ValueError):
    """A Hugging Face config that this Megatron model cannot reproduce."""


def read_hf_config(config: str | Path | dict[str, Any]) -> dict[str, Any]:
    """The config as a dict, from a dict, a ``config.json`` path or a model directory."""
    if isinstance(config, dict):
        return dict(config)
    path = Path(config)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise HFConfigError(f"{path} does not exist: pass a Hugging Face model directory")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise HFConfigError(f"{path} is not valid JSON ({exc})") from exc


def _rope(cfg: dict[str, Any]) -> tuple[float, float | None]:
    """(rope_theta, llama3 scaling factor or None) from either config generation."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict):
        theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
        scaling: dict[str, Any] | None = params
    else:
        theta = cfg.get("rope_theta", 10000.0)
        scaling = cfg.get("rope_scaling")
    if not scaling:
        return float(theta), None
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return float(theta), None
    if kind != "llama3":
        raise HFConfigError(
            f"rope_scaling type {kind!r} is not supported (only 'llama3' scaling, as in "
            "Llama-3.1, or none): megatron's rotary embedding cannot reproduce it"
        )
    for key, expected in LLAMA3_FIXED.items():
        if key in scaling and float(scaling[key]) != expected:
            raise HFConfigError(
                f"rope_scaling.{key}={scaling[key]!r} is not supported: megatron-core fixes it "
                f"to {expected} (Llama-3.1/3.2 use that value)"
            )
    if "factor" not in scaling:
        raise HFConfigError(f"rope_scaling {scaling!r} of type 'llama3' has no 'factor'")
    return float(theta), float(scaling["factor"])


def _refuse(cfg: dict[str, Any], key: str, allowed: Any, why: str) -> None:
    if key in cfg and cfg[key] is not None and cfg[key] != allowed:
        raise HFConfigError(f"{key}={cfg[key]!r} is not supported ({why}); expected {allowed!r}")


def model_config_from_hf(config: str | Path | dict[str, Any], **overrides: Any) -> ModelConfig:
    """The :class:`ModelConfig` of a Llama/Qwen2 Hugging Face config.

    Args:
        config: a ``config.json`` dict, its path, or the model directory holding it.
        overrides: ModelConfig fields that are run choices rather than architecture
            (``params_dtype``, ``make_vocab_size_divisible_by``, ``max_position_embeddings``).

    Raises:
        HFConfigError: naming the field when the architecture cannot be reproduced.
    """
    cfg = read_hf_config(config)
    family = cfg.get("model_type")
    if family not in ARCHITECTURES:
        raise HFConfigError(
            f"model_type={family!r} is not supported: use a checkpoint of one of "
            f"{sorted(ARCHITECTURES)}"
        )
    for key in (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "vocab_size",
    ):
        if key not in cfg:
            raise HFConfigError(f"config has no {key!r}: is this a {family} config.json?")
    _refuse(cfg, "hidden_act", "silu", "the Megatron model uses SwiGLU")
    _refuse(cfg, "mlp_bias", False, "the Megatron model has no MLP biases")
    if family != "qwen2":
        _refuse(cfg, "attention_bias", False, f"{family} in Megatron has no attention biases")
    if family != "llama":
        _refuse(cfg, "use_sliding_window", False, "sliding-window attention is not built")
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim")
    decoupled = head_dim is not None and head_dim * heads != cfg["hidden_size"]
    if decoupled and family in ("llama", "qwen2"):
        raise HFConfigError(
            f"head_dim={head_dim} with num_attention_heads={heads} does not give "
            f"hidden_size={cfg['hidden_size']}: decoupled head widths are built for qwen3 and "
            "qwen3_moe only"
        )
    theta, factor = _rope(cfg)
    kwargs: dict[str, Any] = dict(
        family=family,
        num_layers=cfg["num_hidden_layers"],
        hidden_size=cfg["hidden_size"],
        ffn_hidden_size=cfg["intermediate_size"],
        num_attention_heads=heads,
        num_query_groups=cfg.get("num_key_value_heads") or heads,
        vocab_size=cfg["vocab_size"],
        max_position_embeddings=cfg.get("max_position_embeddings", 4096),
        rotary_base=theta,
        rope_scaling_factor=factor,
        norm_epsilon=float(cfg.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        kv_channels=int(head_dim) if decoupled else None,
    )
    if family == "qwen3_moe":
        kwargs["moe"] = _moe_from_hf(cfg)
    unknown = set(overrides) - {f.name for f in fields(ModelConfig)}
    if unknown:
        raise HFConfigError(f"unknown ModelConfig fields in overrides: {sorted(unknown)}")
    kwargs.update(overrides)
    return ModelConfig(**kwargs)


def _moe_from_hf(cfg: dict[str, Any]) -> MoEConfig:
    """The ``model.moe`` block of a Qwen3-MoE config (every layer an MoE layer)."""
    experts = cfg.get("num_experts", cfg.get("num_local_experts"))
    for key, value in (
        ("num_experts", experts),
        ("num_experts_per_tok", cfg.get("num_experts_per_tok")),
        ("moe_intermediate_size", cfg.get("moe_intermediate_size")),
    ):
        if value is None:
            raise HFConfigError(f"config has no {key!r}: is this a qwen3_moe config.json?")
    if cfg.get("mlp_only_layers"):
        raise HFConfigError(
            f"mlp_only_layers={cfg['mlp_only_layers']!r} is not supported: every layer must be "
            "a mixture-of-experts layer (Qwen3-MoE releases use [])"
        )
    _refuse(cfg, "decoder_sparse_step", 1, "every layer must be a mixture-of-experts layer")
    return MoEConfig(
        num_experts=int(experts),
        router_topk=int(cfg["num_experts_per_tok"]),
        ffn_hidden_size=int(cfg["moe_intermediate_size"]),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
    )


def hf_config_from_model_config(model: ModelConfig) -> dict[str, Any]:
    """A ``config.json`` dict that ``transformers`` (4.x and 5.x) and vLLM load."""
    cfg: dict[str, Any] = {
        "architectures": [ARCHITECTURES[model.family]],
        "model_type": model.family,
        "hidden_size": model.hidden_size,
        "intermediate_size": model.ffn_hidden_size,
        "num_hidden_layers": model.num_layers,
        "num_attention_heads": model.num_attention_heads,
        "num_key_value_heads": model.query_groups,
        "head_dim": model.head_dim,
        "vocab_size": model.vocab_size,
        "max_position_embeddings": model.max_position_embeddings,
        "rms_norm_eps": model.norm_epsilon,
        "rope_theta": model.rotary_base,
        "rope_scaling": None,
        "tie_word_embeddings": model.tie_word_embeddings,
        "hidden_act": "silu",
        "torch_dtype": model.params_dtype,
        "initializer_range": model.init_method_std,
        "attention_dropout": 0.0,
        "use_cache": True,
    }
    if model.rope_scaling_factor is not None:
        cfg["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": model.rope_scaling_factor,
            **LLAMA3_FIXED,
        }
    if model.family == "llama":
        cfg.update(attention_bias=False, mlp_bias=False)
    else:
        cfg.update(use_sliding_window=False, sliding_window=None)
    if model.family in ("qwen3", "qwen3_moe"):
        cfg.update(attention_bias=False)
    if model.moe is not None:
        cfg.update(_moe_to_hf(model))
    return cfg


def _moe_to_hf(model: ModelConfig) -> dict[str, Any]:
    moe = model.moe
    assert moe is not None
    if moe.shared_expert_ffn_hidden_size is not None:
        raise HFConfigError(
            "model.moe.shared_expert_ffn_hidden_size is set but a Qwen3-MoE checkpoint has no "
            "shared expert: this model cannot be written as a Hugging Face qwen3_moe"
        )
    if moe.capacity_factor is not None:
        raise HFConfigError(
            f"model.moe.capacity_factor={moe.capacity_factor} drops tokens over capacity, which "
            "a Hugging Face / vLLM Qwen3-MoE never does: set it to null for a model that must "
            "run there"
        )
    return {
        "num_experts": moe.num_experts,
        "num_local_experts": moe.num_experts,  # transformers 5.x spelling
        "num_experts_per_tok": moe.router_topk,
        "moe_intermediate_size": moe.ffn_hidden_size,
        "norm_topk_prob": moe.norm_topk_prob,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "router_aux_loss_coef": moe.aux_loss_coeff,
        "output_router_logits": False,
    }


def architecture_mismatches(a: ModelConfig, b: ModelConfig) -> list[str]:
    """Fields that change the weights or the function computed (not dtype/padding/length)."""
    ignored = {
        "params_dtype",
        "init_method_std",
        "make_vocab_size_divisible_by",
        "max_position_embeddings",
        "moe",
        "attention_backend",
    }
    out = []
    for f in fields(ModelConfig):
        if f.name in ignored:
            continue
        va, vb = getattr(a, f.name), getattr(b, f.name)
        if f.name == "num_query_groups":
            va, vb = a.query_groups, b.query_groups
        if f.name == "kv_channels":
            va, vb = a.head_dim, b.head_dim
        if va != vb:
            out.append(f"{f.name}: {va!r} vs {vb!r}")
    if (a.moe is None) != (b.moe is None):
        out.append(f"moe: {a.moe!r} vs {b.moe!r}")
    elif a.moe is not None and b.moe is not None:
        # training choices (aux-loss coefficient, capacity, router precision) may differ
        for name in ("num_experts", "router_topk", "ffn_hidden_size", "norm_topk_prob"):
            va, vb = getattr(a.moe, name), getattr(b.moe, name)
            if va != vb:
                out.append(f"moe.{name}: {va!r} vs {vb!r}")
    return out


RUN_CHOICES = (
    "params_dtype",
    "init_method_std",
    "make_vocab_size_divisible_by",
    "attention_backend",
)
"""ModelConfig fields that ``config.json`` does not decide (left to the run's config)."""


def model_section_from_hf(hf_dir: str | Path, given: dict[str, Any]) -> dict[str, Any]:
    """The ``model`` section of a run that starts from ``hf_dir``: the architecture read from
    its ``config.json``, under the keys the user gave (``given``, the raw section), which win
    (:func:`architecture_mismatches` against :func:`model_config_from_hf` then names the ones
    that disagree). Nested ``moe`` merges key by key.

    Raises:
        HFConfigError: ``config.json`` is unreadable or its architecture is not supported.
    """
    from reco_megatron.config import config_to_dict  # pure Python, no megatron-core

    plain = config_to_dict(model_config_from_hf(hf_dir))
    section = {k: v for k, v in plain.items() if k not in RUN_CHOICES}
    for key, value in given.items():
        if key == "moe" and isinstance(value, dict) and isinstance(section.get("moe"), dict):
            section["moe"] = {**section["moe"], **value}
        else:
            section[key] = value
    return section
