"""The rollout side of the loop: building the engine and streaming the policy into it.

The policy's weights travel as Hugging Face ``(name, tensor)`` pairs
(:func:`reco_megatron.megatron.hf.converter.policy_hf_weights`): what vLLM's
``load_weights`` and the embedded transformers engine both take. Every rank holds a rollout
engine for its data-parallel replica, so every rank receives every tensor. The ``megatron``
engine decodes on the trainer's own chunks: its sync sends nothing (no conversion), and it
frees its KV cache when each rollout returns, so training gets the memory back.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from reco_megatron.megatron.device import compute_device
from reco_megatron.megatron.hf.config import hf_config_from_model_config
from reco_megatron.megatron.hf.converter import policy_hf_weights
from reco_megatron.megatron.model import ModelConfig
from reco_megatron.rollout.base import Completion, RolloutEngine, SamplingParams


class RolloutClient:
    """The trainer's handle on a :class:`RolloutEngine` with the run's sampling settings."""

    def __init__(self, engine: RolloutEngine, sampling: SamplingParams) -> None:
        self.engine = engine
        self.sampling = sampling

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

    def update_weights(self, named: Iterator[tuple[str, torch.Tensor]]) -> None:
        self.engine.update_weights(named)

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
    ``policy`` is the trainer's :class:`reco_megatron.megatron.engine.ReCoEngine`; the
    ``megatron`` engine decodes on its chunks (required for it, unused by the others)."""
    r = cfg.rollout
    eos = (tokenizer.eos_id,)
    sampling = SamplingParams(
        temperature=r.temperature,
        top_p=r.top_p,
        max_new_tokens=r.max_new_tokens,
        stop_token_ids=eos,
    )
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
                extra_llm_kwargs={"skip_tokenizer_init": True},  # we pass token ids
            )
        )
    return RolloutClient(engine, sampling)


def _megatron_engine(cfg: Any, policy: Any, max_len: int, eos: tuple[int, ...]) -> RolloutEngine:
    """The megatron engine on ``policy``'s chunks (it satisfies the protocol structurally:
    ``reco_megatron.rollout`` never imports megatron, the adapter takes the decoder)."""
    from reco_megatron.megatron.rollout_engine import MegatronDecoder
    from reco_megatron.rollout.megatron_engine import MegatronEngine, MegatronEngineConfig

    if policy is None:
        raise ValueError("rollout.engine=megatron needs the trainer's engine (policy=...)")
    decoder = MegatronDecoder(
        policy.unwrapped(),
        vocab_size=cfg.model.vocab_size,
        max_model_len=max_len,
        max_batch_size=cfg.rollout.max_batch_size,
        pad_id=eos[0],
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
    """Stream the current policy into the rollout engine (collective).

    ``converter`` is the resolved ``checkpoint.hf_converter``
    (:func:`reco_megatron.megatron.hf.converter.choose_converter`). An engine that generates
    with the trainer's own weights (``uses_trainer_weights``) gets an empty stream: no export.
    """
    if getattr(rollout.engine, "uses_trainer_weights", False):
        rollout.engine.update_weights(iter(()))
        rollout.engine.wake()  # the KV cache comes back lazily, at the next forward
        return
    rollout.update_weights(policy_hf_weights(engine.unwrapped(), model_cfg, converter))
