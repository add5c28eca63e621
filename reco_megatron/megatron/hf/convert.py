"""Megatron <-> Hugging Face weights for the Llama / Qwen2 / Qwen3 / Qwen3-MoE families.

The mapping (``L`` = layer, global index; ``d`` = head_dim; ``r`` = query heads per group;
``E`` = routed expert, global index)::

    embedding.word_embeddings.weight [Vp, H]        model.embed_tokens.weight [V, H] (pad cut)
    decoder.layers.L.input_layernorm.weight          model.layers.L.input_layernorm.weight
    decoder.layers.L.self_attention.linear_qkv.weight [ng*(r+2)*d, H], per group [q_r; k; v]
                                                     ...self_attn.{q,k,v}_proj.weight
    decoder.layers.L.self_attention.linear_qkv.bias  ...self_attn.{q,k,v}_proj.bias (qwen2)
    decoder.layers.L.self_attention.linear_proj.weight   ...self_attn.o_proj.weight
    decoder.layers.L.pre_mlp_layernorm.weight        ...post_attention_layernorm.weight
    decoder.layers.L.mlp.linear_fc1.weight [2F, H] = [gate; up]   ...mlp.{gate,up}_proj.weight
    decoder.layers.L.mlp.linear_fc2.weight           ...mlp.down_proj.weight
    decoder.layers.L.self_attention.{q,k}_layernorm.weight   ...self_attn.{q,k}_norm.weight (qwen3)
    decoder.layers.L.mlp.router.weight [N, H]        ...mlp.gate.weight (qwen3_moe)
    decoder.layers.L.mlp.experts.local_experts.E.linear_fc1.weight [2F, H]
                                                     ...mlp.experts.E.{gate,up}_proj.weight
    decoder.layers.L.mlp.experts.local_experts.E.linear_fc2.weight
                                                     ...mlp.experts.E.down_proj.weight
    decoder.final_layernorm.weight                   model.norm.weight
    output_layer.weight [Vp, H]                      lm_head.weight [V, H] (absent when tied)

The transformer-engine spec fuses the norms into the next linear
(``linear_qkv.layer_norm_weight``, ``linear_fc1.layer_norm_weight``); both spellings map.

Tensor parallelism: column-parallel weights (QKV, fc1, embedding, output layer) are split on
dim 0, row-parallel ones (linear_proj, fc2) on dim 1, per ``param.partition_dim``. QKV is
split by whole groups, so concatenating the shards restores the group-major layout; fc1 is
split per half (rank t holds ``[gate_t; up_t]``). Layer indices come from each layer's own
``layer_number`` (global, 1-based), so pipeline stages and virtual chunks need no offsets.

Expert parallelism: a rank holds ``N / EP`` experts, its local expert ``i`` being global
expert ``ep_rank * N / EP + i`` (megatron's numbering); their tensor-parallel split is over the
*expert* TP group. :func:`full_tensors` renames local experts to global ones and, for export,
all-gathers them over the EP group, so every rank of a stage gets every expert; import keeps
only this rank's experts. The Hugging Face side is the checkpoint layout (one tensor per
expert, what vLLM loads and what ``save_pretrained`` writes); transformers 5's in-memory fused
``experts.gate_up_proj`` is the rollout engine's business.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Any

import torch

from reco_megatron.megatron.hf.sharding import ep_names as _ep_names
from reco_megatron.megatron.hf.sharding import (
    experts_per_rank,
    full_tensors,
    gather_tp,
    gathered_shape,
    global_names,
    shard_tp,
)
from reco_megatron.megatron.model.config import ModelConfig

__all__ = [
    "EMBED",
    "LM_HEAD",
    "NORM",
    "WeightMappingError",
    "export_hf_weights",
    "export_plan",
    "fuse_qkv",
    "gather_tp",
    "global_names",
    "hf_shapes",
    "hf_to_megatron",
    "import_hf_weights",
    "megatron_to_hf",
    "shard_tp",
    "split_qkv",
]

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)\.weight$")
_PLAIN = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "mlp.router.weight": "mlp.gate.weight",
}
EMBED, NORM, LM_HEAD = "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"


class WeightMappingError(ValueError):
    """A tensor that has no counterpart, or the wrong shape, on the other side."""


# ------------------------------------------------------------------ names and shapes
def hf_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of the Hugging Face model and its shape, in state-dict order."""
    h, v, f = cfg.hidden_size, cfg.vocab_size, cfg.ffn_hidden_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.query_groups * cfg.head_dim
    traits = cfg.traits
    out: dict[str, tuple[int, ...]] = {EMBED: (v, h)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        out[p + "self_attn.q_proj.weight"] = (q, h)
        out[p + "self_attn.k_proj.weight"] = (kv, h)
        out[p + "self_attn.v_proj.weight"] = (kv, h)
        if traits.qkv_bias:
            out[p + "self_attn.q_proj.bias"] = (q,)
            out[p + "self_attn.k_proj.bias"] = (kv,)
            out[p + "self_attn.v_proj.bias"] = (kv,)
        out[p + "self_attn.o_proj.weight"] = (h, q)
        if traits.qk_layernorm:
            out[p + "self_attn.q_norm.weight"] = (cfg.head_dim,)
            out[p + "self_attn.k_norm.weight"] = (cfg.head_dim,)
        if cfg.moe is None:
            out[p + "mlp.gate_proj.weight"] = (f, h)
            out[p + "mlp.up_proj.weight"] = (f, h)
            out[p + "mlp.down_proj.weight"] = (h, f)
        else:
            fe = cfg.moe.ffn_hidden_size
            out[p + "mlp.gate.weight"] = (cfg.moe.num_experts, h)
            for e in range(cfg.moe.num_experts):
                out[p + f"mlp.experts.{e}.gate_proj.weight"] = (fe, h)
                out[p + f"mlp.experts.{e}.up_proj.weight"] = (fe, h)
                out[p + f"mlp.experts.{e}.down_proj.weight"] = (h, fe)
        out[p + "input_layernorm.weight"] = (h,)
        out[p + "post_attention_layernorm.weight"] = (h,)
    out[NORM] = (h,)
    if not cfg.tie_word_embeddings:
        out[LM_HEAD] = (v, h)
    return out


# ------------------------------------------------------------------ layouts
def split_qkv(fused: torch.Tensor, cfg: ModelConfig) -> tuple[torch.Tensor, ...]:
    """Group-major ``[ng*(r+2)*d, *rest]`` -> ``q [nq*d, *rest], k [ng*d, *rest], v``."""
    ng, d = cfg.query_groups, cfg.head_dim
    r = cfg.num_attention_heads // ng
    rest = fused.shape[1:]
    g = fused.reshape(ng, r + 2, d, *rest)
    return (
        g[:, :r].reshape(ng * r * d, *rest),
        g[:, r].reshape(ng * d, *rest),
        g[:, r + 1].reshape(ng * d, *rest),
    )


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """Inverse of :func:`split_qkv`: HF q/k/v rows -> megatron's group-major fused layout."""
    ng, d = cfg.query_groups, cfg.head_dim
    r = cfg.num_attention_heads // ng
    rest = q.shape[1:]
    parts = [q.reshape(ng, r, d, *rest), k.reshape(ng, 1, d, *rest), v.reshape(ng, 1, d, *rest)]
    return torch.cat(parts, dim=1).reshape(ng * (r + 2) * d, *rest)


def megatron_to_hf(
    name: str, full: torch.Tensor, cfg: ModelConfig
) -> list[tuple[str, torch.Tensor]]:
    """HF tensors of one TP-gathered megatron tensor ``full`` named ``name`` (global).

    Returns ``[]`` for the output layer of a tied model (the embedding carries it).
    """
    if name == "embedding.word_embeddings.weight":
        return [(EMBED, full[: cfg.vocab_size])]
    if name == "output_layer.weight":
        return [] if cfg.tie_word_embeddings else [(LM_HEAD, full[: cfg.vocab_size])]
    if name == "decoder.final_layernorm.weight":
        return [(NORM, full)]
    match = _LAYER.match(name)
    if match is None:
        raise WeightMappingError(f"megatron parameter {name!r} has no Hugging Face counterpart")
    prefix, rest = f"model.layers.{match.group(1)}.", match.group(2)
    if rest in _PLAIN:
        return [(prefix + _PLAIN[rest], full)]
    if rest in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        kind = rest.rsplit(".", 1)[1]
        q, k, v = split_qkv(full, cfg)
        return [
            (f"{prefix}self_attn.{p}_proj.{kind}", t) for p, t in zip("qkv", (q, k, v), strict=True)
        ]
    if rest == "mlp.linear_fc1.weight":
        gate, up = full.chunk(2, dim=0)
        return [(prefix + "mlp.gate_proj.weight", gate), (prefix + "mlp.up_proj.weight", up)]
    expert = _EXPERT.match(rest)
    if expert is not None and cfg.moe is not None:
        e = f"{prefix}mlp.experts.{expert.group(1)}."
        if expert.group(2) == "linear_fc2":
            return [(e + "down_proj.weight", full)]
        gate, up = full.chunk(2, dim=0)
        return [(e + "gate_proj.weight", gate), (e + "up_proj.weight", up)]
    raise WeightMappingError(f"megatron parameter {name!r} has no Hugging Face counterpart")


def hf_to_megatron(
    name: str, get: Callable[[str], torch.Tensor], cfg: ModelConfig, padded_vocab: int
) -> torch.Tensor:
    """The full (TP=1) megatron tensor ``name`` (global) built from HF tensors ``get(hf)``."""
    if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        source = LM_HEAD if name == "output_layer.weight" and not cfg.tie_word_embeddings else EMBED
        table = get(source)
        pad = table.new_zeros(padded_vocab - table.shape[0], *table.shape[1:])
        return torch.cat([table, pad])
    if name == "decoder.final_layernorm.weight":
        return get(NORM)
    match = _LAYER.match(name)
    if match is None:
        raise WeightMappingError(f"megatron parameter {name!r} has no Hugging Face counterpart")
    prefix, rest = f"model.layers.{match.group(1)}.", match.group(2)
    if rest in _PLAIN:
        return get(prefix + _PLAIN[rest])
    if rest in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        kind = rest.rsplit(".", 1)[1]
        qkv = [get(f"{prefix}self_attn.{p}_proj.{kind}") for p in "qkv"]
        return fuse_qkv(*qkv, cfg)
    if rest == "mlp.linear_fc1.weight":
        return torch.cat([get(prefix + "mlp.gate_proj.weight"), get(prefix + "mlp.up_proj.weight")])
    expert = _EXPERT.match(rest)
    if expert is not None and cfg.moe is not None:
        e = f"{prefix}mlp.experts.{expert.group(1)}."
        if expert.group(2) == "linear_fc2":
            return get(e + "down_proj.weight")
        return torch.cat([get(e + "gate_proj.weight"), get(e + "up_proj.weight")])
    raise WeightMappingError(f"megatron parameter {name!r} has no Hugging Face counterpart")


# ------------------------------------------------------------------ export / import
def export_hf_weights(
    model_chunks: list[Any], model_cfg: ModelConfig
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield this pipeline stage's weights as full Hugging Face ``(name, tensor)`` pairs.

    Collective over the TP group: every TP rank of the stage must exhaust the iterator (each
    gets the same full tensors). Layers carry their global index. Per step at most one
    gathered megatron tensor (``[Vp, H]`` for the embedding) plus its HF pieces are alive;
    tensors may share storage with the parameters and must be treated as read-only. The
    pairs are what ``vllm``'s ``model.load_weights`` and a transformers ``state_dict``
    accept; use :func:`reco_megatron.megatron.hf.checkpoint.gather_hf_weights` to collect all
    stages on one rank.
    """
    for chunk in model_chunks:
        for name, full in full_tensors(chunk):
            if name == "output_layer.weight" and model_cfg.tie_word_embeddings:
                continue
            yield from megatron_to_hf(name, full, model_cfg)


def export_plan(
    model_chunks: list[Any], model_cfg: ModelConfig
) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """``(name, shape, dtype)`` of what :func:`export_hf_weights` yields here, no collectives
    (the mapping runs on ``meta`` tensors of the gathered shapes)."""
    plan = []
    for chunk in model_chunks:
        per_rank = experts_per_rank(chunk)
        for local, name, param in global_names(chunk):
            if name == "output_layer.weight" and model_cfg.tie_word_embeddings:
                continue
            meta = torch.empty(gathered_shape(param, local), dtype=param.dtype, device="meta")
            for global_name in _ep_names(name, per_rank):
                for hf_name, t in megatron_to_hf(global_name, meta, model_cfg):
                    plan.append((hf_name, tuple(t.shape), t.dtype))
    return plan


def import_hf_weights(
    model_chunks: list[Any], model_cfg: ModelConfig, get: Callable[[str], torch.Tensor]
) -> list[str]:
    """Copy HF tensors (``get(hf_name)``, full, unpadded) into this rank's parameters.

    Fuses q/k/v and gate/up, pads the vocabulary, keeps this TP rank's shard and this EP
    rank's experts (only their tensors are read). Returns the HF names read. Raises
    :class:`WeightMappingError` naming the tensor on a shape mismatch.
    """
    from megatron.core import parallel_state as ps

    padded = model_cfg.padded_vocab_size(ps.get_tensor_model_parallel_world_size())
    expected = hf_shapes(model_cfg)
    used: list[str] = []

    def checked(hf_name: str) -> torch.Tensor:
        if hf_name not in expected:
            raise WeightMappingError(f"{hf_name!r} is not a tensor of this {model_cfg.family}")
        tensor = get(hf_name)
        if tuple(tensor.shape) != expected[hf_name]:
            raise WeightMappingError(
                f"{hf_name} has shape {list(tensor.shape)} but the model config expects "
                f"{list(expected[hf_name])}: the checkpoint and the ModelConfig disagree "
                "(check hidden_size, heads, kv heads, intermediate_size, vocab_size)"
            )
        used.append(hf_name)
        return tensor

    with torch.no_grad():
        for chunk in model_chunks:
            for local, name, param in global_names(chunk):
                full = hf_to_megatron(name, checked, model_cfg, padded)
                part = shard_tp(full, param, local)
                if part.shape != param.shape:
                    raise WeightMappingError(
                        f"{name}: built shape {list(part.shape)} for a parameter of shape "
                        f"{list(param.shape)}"
                    )
                param.copy_(part)
    return used
