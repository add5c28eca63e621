"""The architecture of a decoder as one typed config: :class:`ModelConfig` (the fields of a
Hugging Face ``config.json`` that matter) and :data:`FAMILIES` (what each family adds to the
common decoder: QKV bias, QK layernorm, mixture-of-experts layers). Building the model from
it is :mod:`reco_megatron.megatron.model.build`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from reco_megatron.megatron.model.attention import ATTENTION_BACKENDS
from reco_megatron.megatron.model.moe import MoEConfig

Family = Literal["llama", "qwen2", "qwen3", "qwen3_moe"]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class FamilyTraits:
    """What a model family adds to the common decoder (RMSNorm, SwiGLU, RoPE, GQA)."""

    qkv_bias: bool
    """Bias on the fused QKV projection (Qwen2)."""
    qk_layernorm: bool
    """RMSNorm over each query and key head before RoPE (Qwen3)."""
    moe: bool
    """Mixture-of-experts MLPs: ``model.moe`` is required (and refused otherwise)."""


FAMILIES: dict[str, FamilyTraits] = {
    "llama": FamilyTraits(qkv_bias=False, qk_layernorm=False, moe=False),
    "qwen2": FamilyTraits(qkv_bias=True, qk_layernorm=False, moe=False),
    "qwen3": FamilyTraits(qkv_bias=False, qk_layernorm=True, moe=False),
    "qwen3_moe": FamilyTraits(qkv_bias=False, qk_layernorm=True, moe=True),
}
"""The families :class:`ModelConfig` builds, by their HF ``model_type``."""


@dataclass(kw_only=True)
class ModelConfig:
    """Architecture of a decoder of one of :data:`FAMILIES` (names follow HF ``config.json``)."""

    family: Family = "llama"
    """``llama`` (no biases), ``qwen2`` (bias on the QKV projection), ``qwen3`` (QK
    layernorm) or ``qwen3_moe`` (QK layernorm, mixture-of-experts layers: set ``moe``)."""
    num_layers: int = 2
    """Transformer layers (HF ``num_hidden_layers``)."""
    hidden_size: int = 64
    """Model width."""
    ffn_hidden_size: int = 176
    """SwiGLU inner width (HF ``intermediate_size``)."""
    num_attention_heads: int = 4
    """Query heads; ``hidden_size`` must be divisible by it."""
    num_query_groups: int | None = None
    """Key/value heads for grouped-query attention (HF ``num_key_value_heads``); None = MHA."""
    kv_channels: int | None = None
    """Width of one attention head (HF ``head_dim``) when it is not ``hidden_size /
    num_attention_heads`` (Qwen3: 128 at every size); None = that quotient."""
    vocab_size: int = 128
    """True vocabulary size (the tokenizer's); padded internally for tensor parallelism."""
    max_position_embeddings: int = 512
    """Longest sequence (prompt + response) the model is used with."""
    rotary_base: float = 10000.0
    """RoPE base (HF ``rope_theta``): 500000 for Llama 3, 10000 for Qwen2.5-Math."""
    rope_scaling_factor: float | None = None
    """Llama-3.1 RoPE scaling factor (8.0 for Llama-3.1); None disables scaling."""
    norm_epsilon: float = 1e-5
    """RMSNorm epsilon (HF ``rms_norm_eps``)."""
    tie_word_embeddings: bool = False
    """Share the input embedding and output layer (Qwen2.5-1.5B: true; Llama-3.1-8B: false)."""
    make_vocab_size_divisible_by: int = 128
    """Megatron pads the vocabulary to a multiple of this times TP (padded logits are ignored)."""
    params_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Parameter dtype of the model (bf16 on GPU with fp32 main weights in the optimizer)."""
    init_method_std: float = 0.02
    """Std of the normal initialisation of new weights (overwritten when loading a checkpoint)."""
    moe: MoEConfig | None = None
    """The mixture-of-experts layers (family ``qwen3_moe``); null for dense families."""
    attention_backend: Literal["auto", "te", "torch", "local"] = "auto"
    """Which attention runs (not part of the architecture: any value computes the same
    function): ``te`` (transformer-engine's, on a GPU where it imports), ``torch`` (torch's
    fused kernels: ``scaled_dot_product_attention``, packed rows per sequence or through
    ``varlen_attn``), ``local`` (megatron's unfused attention, the reference: ``[b, h, s, s]``
    scores, no packed rows), ``auto`` = ``te`` where it can run, else ``torch``."""

    def __post_init__(self) -> None:
        if isinstance(self.moe, dict):  # from meta.json / asdict
            self.moe = MoEConfig(**self.moe)
        if self.family not in FAMILIES:
            raise ValueError(f"family must be one of {sorted(FAMILIES)}, got {self.family!r}")
        if self.traits.moe and self.moe is None:
            raise ValueError(
                f"family {self.family!r} has mixture-of-experts layers: set model.moe "
                "(num_experts, router_topk, ffn_hidden_size, ...)"
            )
        if not self.traits.moe and self.moe is not None:
            raise ValueError(
                f"model.moe is set but family {self.family!r} is dense; use family "
                "'qwen3_moe' for a mixture-of-experts model, or remove model.moe"
            )
        for name in (
            "num_layers",
            "hidden_size",
            "ffn_hidden_size",
            "num_attention_heads",
            "vocab_size",
            "max_position_embeddings",
            "make_vocab_size_divisible_by",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        kv = self.kv_channels
        if kv is not None and (isinstance(kv, bool) or not isinstance(kv, int) or kv < 1):
            raise ValueError(f"kv_channels (HF head_dim) must be a positive integer, got {kv!r}")
        if kv is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size={self.hidden_size} is not divisible by num_attention_heads="
                f"{self.num_attention_heads}: pick a head count that divides the width, or set "
                "kv_channels (HF head_dim)"
            )
        groups = self.query_groups
        if groups < 1 or self.num_attention_heads % groups:
            raise ValueError(
                f"num_query_groups={self.num_query_groups} must divide num_attention_heads="
                f"{self.num_attention_heads}"
            )
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"model.attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, got "
                f"{self.attention_backend!r}"
            )
        if self.params_dtype not in DTYPES:
            raise ValueError(
                f"params_dtype must be one of {list(DTYPES)}, got {self.params_dtype!r}"
            )
        if self.rope_scaling_factor is not None and self.rope_scaling_factor <= 0:
            raise ValueError(
                f"rope_scaling_factor must be > 0 or null, got {self.rope_scaling_factor}"
            )

    @property
    def query_groups(self) -> int:
        """Number of key/value heads (``num_attention_heads`` without GQA)."""
        return self.num_query_groups or self.num_attention_heads

    @property
    def traits(self) -> FamilyTraits:
        """What this family adds to the common decoder."""
        return FAMILIES[self.family]

    @property
    def head_dim(self) -> int:
        """Width of one attention head (``kv_channels``, else hidden / heads)."""
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    def padded_vocab_size(self, tp: int) -> int:
        """Megatron's padded vocabulary: a multiple of ``make_vocab_size_divisible_by * tp``."""
        step = self.make_vocab_size_divisible_by * tp
        return int(math.ceil(self.vocab_size / step) * step)

    def check_tensor_parallel(self, tp: int) -> None:
        """Raise with what to change when the heads cannot be split over ``tp`` ranks."""
        if self.num_attention_heads % tp:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not divisible by "
                f"tensor_model_parallel_size={tp}: use a TP size that divides the head count"
            )
        if self.query_groups % tp:
            raise ValueError(
                f"num_query_groups={self.query_groups} (key/value heads) is not divisible by "
                f"tensor_model_parallel_size={tp}: use TP <= {self.query_groups} dividing it"
            )
