"""The rollout side of the loop: building the engine and streaming the policy into it.

The policy's weights travel as Hugging Face ``(name, tensor)`` pairs
(:func:`reco_megatron.megatron.hf.converter.policy_hf_weights`): what vLLM's
``load_weights`` and the embedded transformers engine both take. Every rank holds a rollout
engine for its data-parallel replica, so every rank receives every tensor; each push is checked
per tensor against ``hf_shapes(model)`` (every name the converter must emit, for any TP/PP
layout, since the stream carries all stages) before the engine sees it.

One step with a colocated engine: ``generate`` -> :meth:`RolloutClient.sleep` (vLLM level 1:
weights to host, KV cache freed) -> old-logprob pass and optimizer steps ->
:func:`sync_weights` (:meth:`RolloutClient.refit`: wake the weights, push them verified, reset
the prefix cache, wake the KV cache).

The ``megatron`` engine decodes on the trainer's own chunks: its sleep frees the KV cache and
its refit carries no tensors (no conversion, nothing to check).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from reco_megatron.megatron import (
    ModelConfig,
    compute_device,
    hf_config_from_model_config,
    hf_shapes,
    policy_hf_weights,
)
from reco_megatron.rollout.base import Completion, RolloutEngine, SamplingParams
from reco_megatron.utils.logging import get_logger

logger = get_logger(__name__)


class RolloutClient:
    """The trainer's handle on a :class:`RolloutEngine` with the run's sampling settings and
    the weight names and shapes every push must carry (``None``: the engine's checks only)."""

    def __init__(
        self,
        engine: RolloutEngine,
        sampling: SamplingParams,
        expected_weights: Mapping[str, tuple[int, ...]] | None = None,
    ) -> None:
        self.engine = engine
        self.sampling = sampling
        self.expected_weights = expected_weights

    def generate_seeded(
        self, prompts: list[list[int]], n: int, seeds: list[int]
    ) -> list[list[Completion]]:
        """``n`` completions per prompt, prompt ``i`` sampled with ``seeds[i]``.

        One batched ``generate`` call with one :class:`SamplingParams` per prompt. One seed per
        prompt makes a prompt's random numbers independent of which rank generates it and of
        what else is in the batch, so the responses do not depend on the data-parallel layout
        (up to floating-point differences of batched kernels, ~1e-7 in a log-prob, which flip a
        sampled token only when its uniform sits that close to a CDF boundary).
        """
        if len(seeds) != len(prompts):
            raise ValueError(f"{len(seeds)} seeds for {len(prompts)} prompts; pass one per prompt")
        params = [replace(self.sampling, seed=seed) for seed in seeds]
        return self.engine.generate(prompts, n, params)

    def sleep(self) -> None:
        """Free the engine's device memory for the update (vLLM: ``sleep(level=1)``)."""
        self.engine.sleep()

    def refit(self, named: Iterator[tuple[str, torch.Tensor]]) -> None:
        """Wake the weights, push ``named`` verified per tensor (the engine then resets its
        prefix cache), wake the KV cache: the KV cache is never allocated while the push's
        buffers are. Works on an awake engine too (the wakes are no-ops)."""
        self.engine.wake_weights()
        self.engine.update_weights(named, expected=self.expected_weights)
        self.engine.wake_kv_cache()

    def state_dict(self) -> dict[str, Any]:
        state = getattr(self.engine, "state_dict", None)
        return state() if state is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        load = getattr(self.engine, "load_state_dict", None)
        if load is not None and state:
            load(state)

    def close(self) -> None:
        self.engine.close()


def build_rollout_engine(
    cfg: Any, tokenizer: Any, device: torch.device | str | None = None, policy: Any = None
) -> RolloutClient:
    """The configured engine (``embedded``, ``vllm`` or ``megatron``) for the policy.

    ``device``: where the embedded engine runs (the training engine's ``engine.device``;
    None: :func:`~reco_megatron.megatron.device.compute_device`). vLLM places itself.
    ``policy`` is the trainer's :class:`reco_megatron.megatron.step.engine.ReCoEngine`; the
    ``megatron`` engine decodes on its chunks (required for it, unused by the others)."""
    r = cfg.rollout
    eos = (tokenizer.eos_id,)
    sampling = SamplingParams(
        temperature=r.temperature,
        top_p=r.top_p,
        max_new_tokens=r.max_new_tokens,
        stop_token_ids=eos,
    )
    expected = {name: tuple(shape) for name, shape in hf_shapes(cfg.model).items()}
    hf_config = hf_config_from_model_config(cfg.model)
    hf_config["eos_token_id"] = tokenizer.eos_id
    hf_config["pad_token_id"] = tokenizer.pad_id
    max_len = r.max_prompt_len + r.max_new_tokens
    if r.engine == "megatron":
        return RolloutClient(_megatron_engine(cfg, policy, max_len, eos), sampling)
    if r.engine == "embedded":
        from reco_megatron.rollout.embedded import EmbeddedEngine, EmbeddedEngineConfig

        where = str(device if device is not None else compute_device())
        engine: RolloutEngine = EmbeddedEngine(
            hf_config,
            EmbeddedEngineConfig(
                max_model_len=max_len,
                max_batch_size=r.max_batch_size,
                seed=cfg.trainer.seed,
                device=where,
                eos_token_ids=eos,
            ),
        )
    else:
        from reco_megatron.rollout.vllm_engine import VLLMEngine, VLLMEngineConfig

        warn_if_colocation_overflows(cfg)
        model_dir = write_rollout_model_dir(cfg, hf_config)
        dtype = cfg.model.params_dtype
        engine = VLLMEngine(
            VLLMEngineConfig(
                model=str(model_dir),
                tensor_parallel_size=cfg.parallel.tensor_model_parallel_size,
                max_model_len=max_len,
                gpu_memory_utilization=r.gpu_memory_utilization,
                dtype="float32" if dtype == "float32" else dtype,
                load_format="dummy",  # the weights come from update_weights
                seed=cfg.trainer.seed,
                skip_tokenizer_init=True,  # we pass token ids; the model dir has no tokenizer
                return_routed_experts=cfg.update.routing_replay != "off",
            )
        )
    return RolloutClient(engine, sampling, expected)


def warn_if_colocation_overflows(cfg: Any) -> list[str]:
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


def _megatron_engine(cfg: Any, policy: Any, max_len: int, eos: tuple[int, ...]) -> RolloutEngine:
    """The megatron engine on ``policy``'s chunks (it satisfies the protocol structurally:
    ``reco_megatron.rollout`` never imports megatron, the adapter takes the decoder)."""
    from reco_megatron.megatron import MegatronDecoder
    from reco_megatron.rollout.megatron_engine import MegatronEngine, MegatronEngineConfig

    if policy is None:
        raise ValueError("rollout.engine=megatron needs the trainer's engine (policy=...)")
    decoder = MegatronDecoder(
        policy.unwrapped(),
        vocab_size=cfg.model.vocab_size,
        max_model_len=max_len,
        max_batch_size=cfg.rollout.max_batch_size,
        pad_id=eos[0],
        routing=policy.routing,
        record_routing=cfg.update.routing_replay != "off",
    )
    return MegatronEngine(decoder, MegatronEngineConfig(seed=cfg.trainer.seed, eos_token_ids=eos))


def write_rollout_model_dir(cfg: Any, hf_config: dict[str, Any]) -> Path:
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


def sync_weights(
    engine: Any, rollout: RolloutClient, model_cfg: ModelConfig, converter: str = "builtin"
) -> None:
    """Stream the current policy into the rollout engine (collective): wake its weights, push
    them checked per tensor, reset its prefix cache, wake its KV cache
    (:meth:`RolloutClient.refit`; the engine may be asleep or awake).

    ``converter`` is the resolved ``checkpoint.hf_converter``
    (:func:`reco_megatron.megatron.hf.converter.choose_converter`). An engine that generates
    with the trainer's own weights (``uses_trainer_weights``) gets an empty stream: no export.
    """
    if getattr(rollout.engine, "uses_trainer_weights", False):
        rollout.refit(iter(()))
        return
    rollout.refit(policy_hf_weights(engine.unwrapped(), model_cfg, converter))
