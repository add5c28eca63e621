"""A tiny Qwen3-MoE for the engine tests, and full <-> sharded weights under TP, PP and EP.

The model has every feature of the family that runs on CPU: QK layernorm, a decoupled head
width (4 heads x 16 = 64 != hidden 32), grouped-query attention (2 kv heads), 8 routed
experts with top-2 routing and Qwen3's renormalised probabilities, an auxiliary
load-balancing loss with a large coefficient (0.1, so a wrong scale shows in the
parameters), untied embeddings and a vocabulary of 100 padded to 128. Parallel runs get copies
of one set of reference weights (the product's ``hf.sharding`` maps them), so a comparison
fails only when the parallel computation differs.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist

from reco_megatron.algo import LossConfig
from reco_megatron.megatron.distributed import ParallelConfig, initialize_parallel
from reco_megatron.megatron.hf.sharding import full_tensors, global_names, shard_tp
from reco_megatron.megatron.model.config import ModelConfig
from reco_megatron.megatron.model.moe import MoEConfig
from reco_megatron.megatron.model.optimizer import OptimConfig
from reco_megatron.megatron.step.config import UpdateConfig
from reco_megatron.megatron.step.engine import ReCoEngine
from tests.megatron import _reco

EXPERTS, TOPK = 8, 2
LENGTH = _reco.LENGTH + 1  # S = L - 1 = 14 positions: a multiple of TP 2 (sequence parallel)


def rollout_batch(seed: int = 3) -> Any:
    """``_reco.rollout_batch(seed)`` with one more padding column (L = 15, S = 14), so the
    sequence divides over 2 sequence-parallel ranks."""
    batch = _reco.rollout_batch(seed)
    b = batch.num_sequences
    return replace(
        batch,
        tokens=torch.cat([batch.tokens, torch.zeros(b, 1, dtype=batch.tokens.dtype)], dim=1),
        response_mask=torch.cat([batch.response_mask, torch.zeros(b, 1)], dim=1),
        rollout_logprobs=torch.cat([batch.rollout_logprobs, torch.zeros(b, 1)], dim=1),
    )


def model_config(**moe: Any) -> ModelConfig:
    return _reco.model_config(
        "qwen3_moe",
        kv_channels=16,
        moe=MoEConfig(
            num_experts=EXPERTS,
            router_topk=TOPK,
            ffn_hidden_size=24,
            aux_loss_coeff=0.1,
            **moe,
        ),
    )


def build_engine(
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    *,
    micro_batch_size: int = 2,
    routing_replay: str = "off",
    model: ModelConfig | None = None,
    preset: str = "reco",
    distributed_optimizer: bool = False,
) -> ReCoEngine:
    """An engine for the tiny MoE (see ``_reco.build_engine`` for the Adam epsilon)."""
    parallel = ParallelConfig(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        sequence_parallel=tp > 1,
        micro_batch_size=micro_batch_size,
    )
    initialize_parallel(parallel, seed=1234)
    return ReCoEngine(
        model or model_config(),
        parallel,
        LossConfig.preset(preset, kl_coef=0.0),
        OptimConfig(
            lr=1e-2,
            weight_decay=0.0,
            clip_grad=0.0,
            adam_eps=1e-3,
            use_distributed_optimizer=distributed_optimizer,
        ),
        UpdateConfig(
            minibatches_per_rollout=2, stats_implementation="eager", routing_replay=routing_replay
        ),
        total_optimizer_steps=10,
    )


def full_params(engine: ReCoEngine) -> dict[str, torch.Tensor]:
    """Every parameter of the model, full (TP/EP-gathered, all pipeline stages), by its
    single-rank name (collective over the world)."""
    out = {}
    for chunk in engine.unwrapped():
        out.update({name: t.clone() for name, t in full_tensors(chunk)})
    return _reco.gather_stages(out)


def full_grads(engine: ReCoEngine) -> dict[str, torch.Tensor]:
    """The gradients of the update under way (megatron's ``main_grad`` after
    ``finalize_model_grads``: summed over data-parallel ranks, divided by the global loss
    denominator), full, by name. Needs ``use_distributed_optimizer=False`` (with it each rank
    holds only its shard of the summed gradient). Collective over the world."""
    out = {}
    for chunk in engine.unwrapped():
        swapped = []
        for _, _, param in global_names(chunk):
            swapped.append((param, param.data))
            param.data = param.main_grad.data.to(param.dtype)
        try:
            out.update({name: t.clone() for name, t in full_tensors(chunk)})
        finally:
            for param, data in swapped:
                param.data = data
    return _reco.gather_stages(out)


def load_full(engine: ReCoEngine, full: dict[str, torch.Tensor]) -> None:
    """Copy full reference weights into this rank's shards and experts."""
    with torch.no_grad():
        for chunk in engine.unwrapped():
            for local, name, param in global_names(chunk):
                param.copy_(shard_tp(full[name], param, local))
    engine.optimizer.reload_model_params()
    engine.sync_reference()


def own_routing(engine: ReCoEngine, batch: Any) -> torch.Tensor:
    """``[B, S, L, k]`` the experts the model's routers choose for ``batch`` (one process,
    one micro-batch: every layer and position is local), in ``routed_experts`` layout."""
    assert dist.get_world_size() == 1 and engine.routing is not None
    saved = engine.parallel.micro_batch_size
    engine.parallel.micro_batch_size = batch.num_sequences
    engine.routing.record_all(True)
    try:
        engine.statistics(batch)
        records = engine.routing.take_records()
    finally:
        engine.routing.record_all(False)
        engine.parallel.micro_batch_size = saved
    b, s = batch.num_sequences, batch.seq_length
    layers = [records[layer].view(s, b, TOPK).transpose(0, 1) for layer in sorted(records)]
    return torch.stack(layers, dim=2).to(torch.int16)
