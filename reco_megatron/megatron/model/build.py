"""GPT-style decoders on megatron-core (Llama, Qwen2, Qwen3, Qwen3-MoE) from one typed config.

:class:`~reco_megatron.megatron.model.config.ModelConfig` holds what defines the architecture
(:mod:`reco_megatron.megatron.model.config`); :func:`transformer_config` turns
the config plus the parallel layout into megatron's ``TransformerConfig`` (reused, not
mirrored), and :func:`build_model` builds the ``GPTModel`` of this pipeline stage: RMSNorm,
SwiGLU, RoPE with the family's base and Llama-3 scaling, grouped-query attention with an
optional decoupled head width, QKV bias for Qwen2, per-head RMSNorm of queries and keys for
Qwen3, MoE layers (:mod:`reco_megatron.megatron.model.moe`) for Qwen3-MoE, tied or untied
embeddings, vocabulary padded to a multiple of ``make_vocab_size_divisible_by * TP``. The
output layer keeps ``parallel_output=True``: logits stay vocabulary-sharded, ``[B, S, V/TP]``,
and the statistics op upcasts them chunk by chunk.

The layer spec and megatron's fusions are chosen together by :func:`layer_backend`, from
the attention :func:`attention_backend` resolves (``model.attention_backend``): ``te`` (a GPU
with transformer-engine importable, ``auto``'s first choice) gives the TE spec with the fusions
on; ``torch`` (``auto`` without TE: CPU, or a GPU without TE) and ``local`` give megatron's
local spec with every fusion off (they need kernels only TE/apex provide), its torch norms
replaced by :class:`reco_megatron.megatron.model.norm.SequenceParallelNorm` (parameter-dtype
weights, fp32 statistics, parameters marked for the tensor-parallel gradient sum), so
``parallel.sequence_parallel`` works without TE too, and as core attention torch's fused
kernels (:class:`reco_megatron.megatron.model.attention.TorchDotProductAttention`: SDPA,
packed rows) for ``torch`` or megatron's unfused ``DotProductAttention`` for ``local`` (the
reference). The family's QK layernorm and MoE layers come from the same spec call (local
``SequentialMLP`` experts without TE), with the same norm replacement.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
import torch.nn.functional as F

from reco_megatron.megatron.model.attention import (
    TorchDotProductAttention,
    announce,
    resolve_attention_backend,
    transformer_engine_importable,
)
from reco_megatron.megatron.model.config import DTYPES, ModelConfig
from reco_megatron.megatron.model.moe import moe_transformer_kwargs
from reco_megatron.utils.logging import get_logger

logger = get_logger(__name__)

LayerBackend = Literal["transformer_engine", "local"]
_warned: set[str] = set()


def _transformer_engine_importable() -> bool:
    return transformer_engine_importable()


def attention_backend(model: ModelConfig, on_gpu: bool) -> str:
    """The attention that runs, ``te``, ``torch`` or ``local``, for ``model.attention_backend``
    (:func:`reco_megatron.megatron.model.attention.resolve_attention_backend`: ``auto`` = TE
    on a GPU where it imports, else torch's fused kernels). Warns once per process when a GPU
    run goes without transformer-engine."""
    te = on_gpu and _transformer_engine_importable()
    backend = resolve_attention_backend(model.attention_backend, on_gpu, te)
    if on_gpu and not te and "no_te" not in _warned:
        _warned.add("no_te")
        logger.warning(
            "transformer-engine is not importable: using megatron's local layer spec with no "
            "fused kernels but torch's attention (install the 'gpu' extra or use an NGC "
            "container for TE's)"
        )
    return backend


def layer_backend(model: ModelConfig, on_gpu: bool) -> LayerBackend:
    """Which layer implementation the model uses: ``transformer_engine`` (TE spec + fusions)
    when :func:`attention_backend` is ``te``, else ``local`` (megatron's local spec, no
    fusions, with torch's or megatron's core attention).

    The one place the choice is made: :func:`transformer_config` (fusions) and
    :func:`build_model` (spec) both ask here, so they cannot disagree.
    """
    return "transformer_engine" if attention_backend(model, on_gpu) == "te" else "local"


def transformer_config(model: ModelConfig, parallel: Any, on_gpu: bool) -> Any:
    """Megatron ``TransformerConfig`` for ``model`` under the parallel layout ``parallel``.

    ``parallel`` is a :class:`reco_megatron.megatron.parallel.ParallelConfig`. The loss
    contract is per-token (``calculate_per_token_loss=True``): see
    :mod:`reco_megatron.megatron.step.loss_layer`.
    """
    from megatron.core.transformer import TransformerConfig

    model.check_tensor_parallel(parallel.tensor_model_parallel_size)
    dtype = DTYPES[model.params_dtype]
    fused = layer_backend(model, on_gpu) == "transformer_engine"
    interleaved = parallel.virtual_pipeline_model_parallel_size is not None
    moe = moe_transformer_kwargs(model.moe, parallel) if model.moe is not None else {}
    return TransformerConfig(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        ffn_hidden_size=model.ffn_hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.query_groups,
        kv_channels=model.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=model.norm_epsilon,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=model.traits.qkv_bias,
        qk_layernorm=model.traits.qk_layernorm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=model.init_method_std,
        tensor_model_parallel_size=parallel.tensor_model_parallel_size,
        pipeline_model_parallel_size=parallel.pipeline_model_parallel_size,
        context_parallel_size=parallel.context_parallel_size,
        virtual_pipeline_model_parallel_size=parallel.virtual_pipeline_model_parallel_size,
        sequence_parallel=parallel.sequence_parallel,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        use_cpu_initialization=not on_gpu,
        calculate_per_token_loss=True,
        # Fusions only with the TE spec (layer_backend): the local spec's torch norms assert
        # persist_layer_norm off, and its softmax/bias fusions need TE/apex kernels.
        bias_activation_fusion=fused,
        bias_dropout_fusion=fused,
        masked_softmax_fusion=fused,
        gradient_accumulation_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=fused,
        # Interleaved pipeline: point-to-point sends and receives one by one, as Megatron-LM
        # does by default with a virtual pipeline. Batched, the forward activation and the
        # backward gradient a stage exchanges with the same neighbour (PP 2: the previous
        # stage is the next one) are indistinguishable, and the schedule mixes them up.
        overlap_p2p_comm=interleaved,
        batch_p2p_comm=not interleaved,
        **moe,
    )


def _with_norm(spec: Any, norm: type) -> Any:
    """``spec`` (a layer ``ModuleSpec``, its submodules, or any nesting of them) with every
    norm class of megatron's local spec (``WrappedTorchNorm``, apex's ``FusedLayerNorm``)
    replaced by ``norm``: the input, pre-MLP and query/key norms alike. A copy; the rest of
    the spec is shared."""
    import dataclasses

    from megatron.core.fusions.fused_layer_norm import FusedLayerNorm
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    local_norms = (WrappedTorchNorm, FusedLayerNorm)
    if isinstance(spec, type) and issubclass(spec, local_norms):
        return norm
    if isinstance(spec, ModuleSpec):
        if isinstance(spec.module, type) and issubclass(spec.module, local_norms):
            return dataclasses.replace(spec, module=norm)
        if spec.submodules is None:
            return spec
        return dataclasses.replace(spec, submodules=_with_norm(spec.submodules, norm))
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        changes = {
            f.name: _with_norm(getattr(spec, f.name), norm)
            for f in dataclasses.fields(spec)
            if f.init
        }
        return dataclasses.replace(spec, **changes)
    return spec


def _with_core_attention(layer: Any, core_attention: type) -> Any:
    """The local layer spec ``layer`` with ``core_attention`` as its self-attention's core
    attention (in place of megatron's ``DotProductAttention``). A copy."""
    import dataclasses

    attention = layer.submodules.self_attention
    inner = dataclasses.replace(attention.submodules, core_attention=core_attention)
    attention = dataclasses.replace(attention, submodules=inner)
    return dataclasses.replace(
        layer, submodules=dataclasses.replace(layer.submodules, self_attention=attention)
    )


def _layer_spec(model: ModelConfig, config: Any, on_gpu: bool, vp_stage: int | None) -> Any:
    """The decoder spec of one pipeline stage (or virtual-pipeline chunk).

    With transformer-engine: megatron's TE layer spec (TE's norms handle sequence
    parallelism). Without: megatron's local layer spec with
    :class:`~reco_megatron.megatron.model.norm.SequenceParallelNorm` in place of its torch norms, in
    every layer and as the block's final norm (which megatron would otherwise take from a
    module-level default), so the same spec runs with and without ``sequence_parallel``.
    The family's QK layernorm and MoE layers (local experts, no grouped GEMM) come from
    megatron's own spec function.
    """
    from megatron.core.models.gpt import gpt_layer_specs as specs
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )

    from reco_megatron.megatron.model.norm import SequenceParallelNorm

    family = {
        "num_experts": model.moe.num_experts if model.moe is not None else None,
        "moe_grouped_gemm": False,
        "qk_layernorm": model.traits.qk_layernorm,
    }
    backend = attention_backend(model, on_gpu)
    ratio = model.num_attention_heads // model.query_groups
    announce(backend, on_gpu, DTYPES[model.params_dtype], ratio)
    if backend == "te":
        return specs.get_gpt_layer_with_transformer_engine_spec(**family)
    local = specs.get_gpt_layer_local_spec(normalization="RMSNorm", **family)
    layer = _with_norm(local, SequenceParallelNorm)
    if backend == "torch":
        layer = _with_core_attention(layer, TorchDotProductAttention)
    return TransformerBlockSubmodules(
        layer_specs=[layer] * get_num_layers_to_build(config, vp_stage=vp_stage),
        layer_norm=SequenceParallelNorm,
    )


def build_model(
    model: ModelConfig,
    config: Any,
    *,
    pre_process: bool,
    post_process: bool,
    on_gpu: bool,
    vp_stage: int | None = None,
) -> Any:
    """The ``GPTModel`` of one pipeline stage (or virtual-pipeline chunk).

    Args:
        model: the architecture.
        config: the ``TransformerConfig`` from :func:`transformer_config`.
        pre_process / post_process: whether this chunk holds the embedding / the output layer.
        on_gpu: whether the model will run on CUDA (with transformer-engine importable: the TE
            spec, see :func:`layer_backend`). The chunk is returned where megatron built it
            (CPU, or CUDA parameters without CPU initialisation); the engine moves it to its
            device.
        vp_stage: the virtual-pipeline chunk index (None without a virtual pipeline): which
            layers the chunk holds, hence their global numbers and checkpoint keys.
    """
    from reco_megatron.megatron.compat.versions import build_gpt_model

    tp = config.tensor_model_parallel_size
    kwargs: dict[str, Any] = {}
    if model.rope_scaling_factor is not None:
        kwargs.update(rope_scaling=True, rope_scaling_factor=model.rope_scaling_factor)
    if vp_stage is not None:
        kwargs["vp_stage"] = vp_stage
    return build_gpt_model(
        config=config,
        transformer_layer_spec=_layer_spec(model, config, on_gpu, vp_stage),
        vocab_size=model.padded_vocab_size(tp),
        max_sequence_length=model.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=model.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=int(model.rotary_base),
        **kwargs,
    )


def _return_hidden_states(self: Any, input_: torch.Tensor, weight: Any = None, **_: Any):
    """Stand-in ``forward`` of the output layer: hand the hidden states on unchanged."""
    return input_, None


def fuse_output_layer(gpt: Any) -> None:
    """Make a last-stage ``GPTModel`` return its final hidden states instead of logits.

    The output layer's ``forward`` (on this instance only) passes ``[S(/TP), B, H]`` through,
    so the model returns ``[B, S(/TP), H]`` and the loss layer applies the output layer
    itself, fused with the statistics (``parallel.linear_stats``), with the weight from
    :func:`output_weight`. Parameters, state dict and checkpoints are unchanged.
    """
    import types

    if gpt.post_process:
        gpt.output_layer.forward = types.MethodType(_return_hidden_states, gpt.output_layer)


def output_weight(model: Any) -> torch.Tensor | None:
    """The output layer's weight ``[V/TP, H]`` of a (wrapped) ``GPTModel``: the tied
    embedding's when embeddings and output weights are shared; None before the last stage."""
    while hasattr(model, "module"):  # DDP, Float16Module
        model = model.module
    if not model.post_process:
        return None
    if model.share_embeddings_and_output_weights:
        return model.shared_embedding_or_output_weight()
    return model.output_layer.weight
