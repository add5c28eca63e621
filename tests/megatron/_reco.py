"""Shared pieces of the ReCo engine tests: a tiny Llama-style model, a rollout batch, and
helpers to move full (TP=1, PP=1) weights in and out of any parallel layout (with the
product's own ``convert.shard_tp`` / ``gather_tp``).

Parallel runs get *copies* of one reference set of weights, so a comparison fails only when
the parallel computation differs. The model uses every architectural feature the engine
supports on CPU: RMSNorm, SwiGLU (its fused ``[gate; up]`` weight is sharded per half),
grouped-query attention (2 kv heads for 4 query heads), RoPE, untied embeddings, and a
vocabulary of 100 padded to 128 at TP 1 and 2 (``make_vocab_size_divisible_by=32``), so the
padded shapes agree between layouts and padded columns must be excluded by the loss.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from reco_megatron.algo import LossConfig
from reco_megatron.megatron.distributed import ParallelConfig, initialize_parallel
from reco_megatron.megatron.hf.convert import gather_tp, global_names, shard_tp
from reco_megatron.megatron.model.config import ModelConfig
from reco_megatron.megatron.model.optimizer import OptimConfig
from reco_megatron.megatron.step.config import UpdateConfig
from reco_megatron.megatron.step.engine import ReCoEngine
from reco_megatron.parallel.batch import RolloutBatch, data_parallel_share

VOCAB, LENGTH, GROUP, GROUPS = 100, 14, 4, 4  # 16 sequences of 14 tokens


def model_config(family: str = "llama", **overrides: Any) -> ModelConfig:
    kwargs: dict[str, Any] = dict(
        family=family,
        num_layers=2,
        hidden_size=32,
        ffn_hidden_size=48,
        num_attention_heads=4,
        num_query_groups=2,
        vocab_size=VOCAB,
        max_position_embeddings=32,
        make_vocab_size_divisible_by=32,
        rotary_base=10000.0,
    )
    kwargs.update(overrides)
    return ModelConfig(**kwargs)


def rollout_batch(seed: int = 3, groups: int = GROUPS) -> RolloutBatch:
    """Prompts of 3-5 tokens, responses of varying length, right padding, random advantages.

    Responses inside a group repeat (rows 0 and 1 of each group are identical) so that the
    empirical weights differ from 1.
    """
    gen = torch.Generator().manual_seed(seed)
    b = groups * GROUP
    tokens = torch.randint(0, VOCAB, (b, LENGTH), generator=gen)
    mask = torch.zeros(b, LENGTH)
    for i in range(b):
        start = 3 + i % 3
        end = LENGTH - (i % 4)
        mask[i, start:end] = 1.0
        tokens[i, end:] = 0  # padding id
    tokens[1::GROUP] = tokens[0::GROUP]
    mask[1::GROUP] = mask[0::GROUP]
    advantages = torch.randn(b, generator=gen)
    rollout_logprobs = -torch.rand(b, LENGTH - 1, generator=gen)
    return RolloutBatch(
        tokens=tokens,
        response_mask=mask,
        advantages=advantages,
        group_size=GROUP,
        rollout_logprobs=rollout_logprobs,
    )


def dp_share(batch: RolloutBatch, minibatches: int = 2) -> RolloutBatch:
    """This data-parallel rank's share, DP-invariant (``batch.data_parallel_share``)."""
    from megatron.core import parallel_state as ps

    return data_parallel_share(
        batch, ps.get_data_parallel_rank(), ps.get_data_parallel_world_size(), minibatches
    )


def build_engine(
    tp: int = 1,
    pp: int = 1,
    micro_batch_size: int = 2,
    loss: LossConfig | None = None,
    minibatches: int = 2,
    lr: float = 1e-2,
    model: ModelConfig | None = None,
    adam_eps: float = 1e-3,
    fused_output_layer: bool = False,
    sequence_parallel: bool = False,
    vp: int | None = None,
    response_weight_policy: str = "proximal",
    **update: Any,
) -> ReCoEngine:
    """An engine for the tiny model. ``adam_eps`` is large on purpose: Adam's first step is
    ``lr * g / (|g| + eps)``, which turns a 1e-9 fp32 reduction-order difference of a gradient
    near 0 into a difference of up to ``2 lr`` (a sign flip); with eps = 1e-3 the update is
    Lipschitz in ``g`` with constant ``lr / eps`` and layouts can be compared tightly.
    ``update``: further ``UpdateConfig`` fields (e.g. ``max_tokens_per_microbatch``)."""
    parallel = ParallelConfig(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        micro_batch_size=micro_batch_size,
        sequence_parallel=sequence_parallel,
        virtual_pipeline_model_parallel_size=vp,
    )
    initialize_parallel(parallel, seed=1234)
    return ReCoEngine(
        model or model_config(),
        parallel,
        loss or LossConfig.preset("reco", kl_coef=0.0),
        OptimConfig(lr=lr, weight_decay=0.0, clip_grad=0.0, adam_eps=adam_eps),
        UpdateConfig(
            minibatches_per_rollout=minibatches,
            stats_implementation="eager",
            fused_output_layer=fused_output_layer,
            **update,
        ),
        total_optimizer_steps=10,
        response_weight_policy=response_weight_policy,
    )


# ---------------------------------------------------------------- full <-> sharded weights
def load_full(engine: ReCoEngine, full: dict[str, torch.Tensor]) -> None:
    """Copy full reference weights into this rank's shards (and the optimizer's fp32 copy).
    Layers are matched by their global number, so any PP / virtual-pipeline layout works."""
    with torch.no_grad():
        for chunk in engine.unwrapped():
            for name, key, param in global_names(chunk):
                if key == "output_layer.weight" and engine.model_cfg.tie_word_embeddings:
                    key = "embedding.word_embeddings.weight"  # the last stage's tied copy
                param.copy_(shard_tp(full[key], param, name))
    engine.optimizer.reload_model_params()
    engine.sync_reference()


def full_params(engine: ReCoEngine) -> dict[str, torch.Tensor]:
    """This stage's parameters, TP-gathered, under single-stage names."""
    out = {}
    for chunk in engine.unwrapped():
        for name, key, param in global_names(chunk):
            if key == "output_layer.weight" and engine.model_cfg.tie_word_embeddings:
                continue  # with PP the last stage's copy of the tied embedding
            out[key] = gather_tp(param, name).clone()
    return out


def gather_stages(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Union of every pipeline stage's parameters (a collective over the PP group)."""
    from megatron.core import parallel_state as ps

    if ps.get_pipeline_model_parallel_world_size() == 1:
        return params
    box: list[Any] = [None] * ps.get_pipeline_model_parallel_world_size()
    dist.all_gather_object(box, params, group=ps.get_pipeline_model_parallel_group())
    merged: dict[str, torch.Tensor] = {}
    for part in box:
        merged.update(part)
    return merged
