"""Building the run's rollout engine (``rollout.engine``: ``embedded``, ``vllm`` or
``megatron``) and what it needs: the sampling settings, the weight names every push must
carry, vLLM's model directory and its colocation memory check; and streaming the policy into
it (:func:`sync_weights`, through :class:`~reco_megatron.trainer.orchestration.sync.RolloutClient`).

The engines that hold their own weights come from the one factory training and evaluation
share (:func:`reco_megatron.rollout.engines.build_engine`); the ``megatron`` engine decodes on
the trainer's own chunks and is built here, where the adapter may be imported.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from reco_megatron.data.tokenizer import Tokenizer
from reco_megatron.megatron import (
    ModelConfig,
    PushRole,
    ReCoEngine,
    compute_device,
    hf_config_from_model_config,
    hf_shapes,
    policy_hf_weights,
    push_role,
    push_tensors,
    stage_hf_weights,
)
from reco_megatron.parallel.layout import RankLayout
from reco_megatron.rollout.base import RolloutEngine
from reco_megatron.rollout.engines import build_engine
from reco_megatron.rollout.requests import SamplingParams
from reco_megatron.trainer.config import TrainConfig
from reco_megatron.trainer.orchestration.source import ColocatedRollout, PromptSource, RolloutSource
from reco_megatron.trainer.orchestration.sync import RolloutClient
from reco_megatron.trainer.rollout_config import RolloutConfig
from reco_megatron.utils.logging import get_logger

logger = get_logger(__name__)


def rollout_sampling(cfg: TrainConfig, tokenizer: Tokenizer) -> SamplingParams:
    """The run's sampling settings (``rollout.*``, the tokenizer's eos as the stop token)."""
    r = cfg.rollout
    return SamplingParams(
        temperature=r.temperature,
        top_p=r.top_p,
        max_new_tokens=r.max_new_tokens,
        stop_token_ids=(tokenizer.eos_id,),
    )


def expected_weights(cfg: TrainConfig) -> dict[str, tuple[int, ...]]:
    """HF name -> shape of every tensor a weight push must carry."""
    return {name: tuple(shape) for name, shape in hf_shapes(cfg.model).items()}


def engine_spec(cfg: TrainConfig, tokenizer: Tokenizer, device: str) -> dict[str, Any]:
    """The keyword arguments of :func:`reco_megatron.rollout.engines.build_engine` for the
    run's ``embedded`` or ``vllm`` engine (plain data: a separate worker receives them)."""
    r = cfg.rollout
    tp = cfg.parallel.tensor_model_parallel_size
    eos = (tokenizer.eos_id,)
    hf_config = hf_config_from_model_config(cfg.model)
    hf_config["eos_token_id"] = tokenizer.eos_id
    hf_config["pad_token_id"] = tokenizer.pad_id
    model_dir = None
    if r.engine == "vllm":
        if r.placement == "colocated":
            warn_if_colocation_overflows(cfg)
        model_dir = str(write_rollout_model_dir(cfg, hf_config))
    return dict(
        kind=r.engine,
        hf_config=hf_config,
        model_dir=model_dir,
        checkpoint=False,  # the weights come from the first push
        max_model_len=r.max_prompt_len + r.max_new_tokens,
        eos_token_ids=eos,
        seed=cfg.trainer.seed,
        device=device,
        max_batch_size=64 if r.max_batch_size == "auto" else r.max_batch_size,
        # colocated vLLM shards like the trainer; a separate worker is one GPU (docs/rollout.md)
        tensor_parallel_size=tp if r.placement == "colocated" else 1,
        gpu_memory_utilization=r.gpu_memory_utilization,
        dtype=cfg.model.params_dtype,
        return_routed_experts=cfg.update.routing_replay != "off",
    )


def build_rollout_engine(
    cfg: TrainConfig,
    tokenizer: Tokenizer,
    device: torch.device | str | None = None,
    policy: ReCoEngine | None = None,
) -> RolloutClient:
    """The configured engine (``embedded``, ``vllm`` or ``megatron``) for the policy.

    ``device``: where the embedded engine runs (the training engine's ``engine.device``;
    None: :func:`~reco_megatron.megatron.device.compute_device`). vLLM places itself.
    ``policy`` is the trainer's :class:`reco_megatron.megatron.step.engine.ReCoEngine`; the
    ``megatron`` engine decodes on its chunks (required for it, unused by the others)."""
    r = cfg.rollout
    sampling = rollout_sampling(cfg, tokenizer)
    if r.engine == "megatron":
        max_len = r.max_prompt_len + r.max_new_tokens
        engine = _megatron_engine(cfg, policy, max_len, (tokenizer.eos_id,))
        return RolloutClient(engine, sampling)
    where = str(device if device is not None else compute_device())
    engine = build_engine(**engine_spec(cfg, tokenizer, where))
    return RolloutClient(engine, sampling, expected_weights(cfg))


def warn_if_colocation_overflows(cfg: TrainConfig) -> list[str]:
    """Log a warning per phase of the step whose estimated peak exceeds this GPU
    (:mod:`reco_megatron.megatron.memory.estimate`); returns the messages (none without CUDA)."""
    if not torch.cuda.is_available():
        return []
    from reco_megatron.megatron import colocation_budget, colocation_warnings

    par = cfg.parallel
    world = dist.get_world_size() if dist.is_initialized() else 1
    model_parallel = (
        par.tensor_model_parallel_size
        * par.pipeline_model_parallel_size
        * par.context_parallel_size
    )
    budget = colocation_budget(
        cfg.model,
        par,
        data_parallel_size=max(1, world // model_parallel),
        max_seq_len=cfg.rollout.max_prompt_len + cfg.rollout.max_new_tokens,
        gpu_memory_utilization=cfg.rollout.gpu_memory_utilization,
        gpu_bytes=torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory,
        distributed_optimizer=cfg.optimizer.use_distributed_optimizer,
        reference_model=cfg.loss.kl_coef > 0,
        tokens_per_microbatch=cfg.update.max_tokens_per_microbatch,
    )
    messages = colocation_warnings(budget)
    for message in messages:
        logger.warning("vLLM colocation: %s", message)
    return messages


def _megatron_engine(
    cfg: TrainConfig, policy: ReCoEngine | None, max_len: int, eos: tuple[int, ...]
) -> RolloutEngine:
    """The megatron engine on ``policy``'s chunks (it satisfies the protocol structurally:
    ``reco_megatron.rollout`` never imports megatron, the adapter takes the decoder)."""
    from reco_megatron.megatron import MegatronDecoder
    from reco_megatron.rollout.megatron_engine import MegatronEngine, MegatronEngineConfig

    if policy is None:
        raise ValueError("rollout.engine=megatron needs the trainer's engine (policy=...)")
    r = cfg.rollout
    decoder = MegatronDecoder(
        policy.unwrapped(),
        vocab_size=cfg.model.vocab_size,
        max_model_len=max_len,
        max_batch_size=None if r.max_batch_size == "auto" else r.max_batch_size,
        kv_cache_bytes=None if r.kv_cache_gib is None else int(r.kv_cache_gib * 2**30),
        pad_id=eos[0],
        routing=policy.routing,
        record_routing=cfg.update.routing_replay != "off",
        prefix_cache_bytes=_prefix_cache_bytes(r),
    )
    engine_cfg = MegatronEngineConfig(
        seed=cfg.trainer.seed, eos_token_ids=eos, release_cache_after_generate=not r.keep_kv_cache
    )
    return MegatronEngine(decoder, engine_cfg)


def _prefix_cache_bytes(r: RolloutConfig) -> int | None:
    """``rollout.prefix_cache_gib`` in bytes (None: the decoder's default with an environment,
    off without: single-turn prompts never extend an earlier call's)."""
    if r.prefix_cache_gib is None:
        return None if r.env else 0
    return int(r.prefix_cache_gib * 2**30)


def write_rollout_model_dir(cfg: TrainConfig, hf_config: dict[str, Any]) -> Path:
    """``<output_dir>/rollout_model/config.json``: the policy architecture vLLM builds (with
    dummy weights, replaced by the first :func:`sync_weights`). Written by global rank 0."""
    import json

    out = Path(cfg.trainer.output_dir) / "rollout_model"
    if not dist.is_initialized() or dist.get_rank() == 0:
        out.mkdir(parents=True, exist_ok=True)
        tmp = out / "config.json.tmp"
        tmp.write_text(json.dumps(hf_config, indent=1, sort_keys=True))
        tmp.replace(out / "config.json")
    if dist.is_initialized():
        dist.barrier()
    return out


def build_rollout_source(
    cfg: TrainConfig,
    tokenizer: Tokenizer,
    policy: ReCoEngine,
    converter: str,
    prompts: PromptSource,
    layout: RankLayout,
    run_dir: Path,
    run_id: str,
) -> RolloutSource:
    """The run's source of groups: the colocated engine on this rank, or the separate workers
    (``rollout.placement``)."""
    if cfg.rollout.placement == "colocated":
        client = build_rollout_engine(cfg, tokenizer, policy.device, policy=policy)
        sync = partial(sync_weights, policy, client, cfg.model, converter)
        episodes = None
        if cfg.rollout.env:
            from reco_megatron.trainer.orchestration.episodes import EpisodeDriver

            episodes = EpisodeDriver(cfg, tokenizer, client, layout.mp_group)
        return ColocatedRollout(cfg, client, sync, prompts, layout, episodes)
    from reco_megatron.trainer.orchestration.separate import SeparateRollout

    spec = engine_spec(cfg, tokenizer, "auto")
    sampling, expected = rollout_sampling(cfg, tokenizer), expected_weights(cfg)
    weights = PolicyStages(policy, cfg.model)
    env = None
    if cfg.rollout.env:  # the workers run the episodes with the run's environment settings
        from reco_megatron.trainer.orchestration.episodes import env_settings

        env = env_settings(cfg, tokenizer).to_wire()
    return SeparateRollout(
        cfg, spec, sampling, expected, weights, prompts, layout, run_dir, run_id, env
    )


@dataclass(frozen=True)
class PolicyStages:
    """The policy's weights stage by stage, for the separate workers
    (:class:`~reco_megatron.trainer.orchestration.push.StageWeights` over the adapter's push)."""

    policy: ReCoEngine
    """The training engine whose chunks are exported."""
    model: ModelConfig
    """Its architecture (the HF names and shapes)."""

    @property
    def on_gpu(self) -> bool:
        return self.policy.on_gpu

    def role(self) -> PushRole:
        return push_role()

    def plan(self) -> list[tuple[str, tuple[int, ...], torch.dtype, int]]:
        return push_tensors(self.policy.unwrapped(), self.model)

    def stage_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        return stage_hf_weights(self.policy.unwrapped(), self.model)


def sync_weights(
    engine: ReCoEngine, rollout: RolloutClient, model_cfg: ModelConfig, converter: str = "builtin"
) -> None:
    """Stream the current policy into the rollout engine (collective): wake its weights, push
    them checked per tensor, reset its prefix cache, wake its KV cache
    (:meth:`RolloutClient.refit`; the engine may be asleep or awake).

    ``converter`` is the resolved ``checkpoint.hf_converter``
    (:func:`~reco_megatron.trainer.setup.hf_converter`). An engine that generates
    with the trainer's own weights (``uses_trainer_weights``) gets an empty stream: no export.
    """
    if getattr(rollout.engine, "uses_trainer_weights", False):
        rollout.refit(iter(()))
        return
    rollout.refit(policy_hf_weights(engine.unwrapped(), model_cfg, converter))
