"""The trainer's handle on its rollout engine, and how the policy streams into it.

The engine is built, and the policy's weights exported, by :mod:`.rollout_engines`
(:func:`~reco_megatron.trainer.orchestration.engines.sync_weights`). The weights travel as Hugging
Face ``(name, tensor)`` pairs: what vLLM's ``load_weights`` and the embedded transformers
engine both take. Every rank holds a rollout
engine for its data-parallel replica, so every rank receives every tensor; each push is checked
per tensor against ``hf_shapes(model)`` (every name the converter must emit, for any TP/PP
layout, since the stream carries all stages) before the engine sees it.

One step with a colocated engine: ``generate`` -> :meth:`RolloutClient.sleep` (vLLM level 1:
weights to host, KV cache freed) -> old-logprob pass and optimizer steps ->
``sync_weights`` (:meth:`RolloutClient.refit`: wake the weights, push them verified, reset
the prefix cache, wake the KV cache).

The ``megatron`` engine decodes on the trainer's own chunks: its sleep frees the KV cache and
its refit carries no tensors (no conversion, nothing to check).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import replace
from typing import Any

import torch

from reco_megatron.rollout.base import RolloutEngine
from reco_megatron.rollout.requests import Completion, SamplingParams
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
