"""The rollout protocol: what the trainer asks of any generation engine.

The trainer (1) streams the policy's weights as Hugging Face-named full tensors into an engine
(:meth:`RolloutEngine.update_weights`), (2) asks for ``n`` responses per prompt with per-token
log-probs (:meth:`RolloutEngine.generate`), (3) lets the engine give its memory back while it
trains (:meth:`RolloutEngine.sleep`, then :meth:`RolloutEngine.wake_weights` before the weight
push and :meth:`RolloutEngine.wake_kv_cache` after it).

Log-prob convention (the same for every engine, see ``docs/rollout.md``): the ``t``-th entry of
:attr:`Completion.logprobs` is ``log softmax(logits / temperature)[token_ids[t]]`` where the
logits are those the model produces for ``prompt + token_ids[:t]`` -- the temperature-scaled
distribution *before* top-p/top-k truncation. The trainer computes ``log p`` under
temperature-scaled logits over the whole vocabulary, so that is the number a rollout must
report for the train/inference mismatch to mean anything; top-p/top-k are sampling devices that
change which tokens can be drawn, not the policy being optimised. (vLLM's ``processed_logprobs``
are taken *after* truncation; :mod:`reco_megatron.rollout.vllm_engine` documents the gap.)
With ``temperature == 0`` (greedy) the log-probs are those of ``log softmax(logits)``.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

from reco_megatron.rollout.requests import (
    Completion,
    SamplingArg,
    SamplingParams,
    validate_requests,
)
from reco_megatron.rollout.weight_check import ExpectedShapes, WeightStreamCheck, drain


class RolloutEngine(abc.ABC):
    """A generation engine the trainer drives; implementations: embedded (CPU) and vLLM.

    One RL step, colocated with training (``docs/rollout.md``)::

        generate(...)                      # weights and KV cache on the device
        sleep()                            # level 1: weights to host, KV cache freed
        ... old-logprob pass, optimizer steps ...
        wake_weights()                     # weights back, no KV cache yet (lower peak)
        update_weights(stream, expected=)  # verified per tensor, then prefix cache reset
        wake_kv_cache()                    # KV cache re-allocated; generate works again

    ``generate`` refuses while any part is asleep and before weights were loaded once;
    ``update_weights`` refuses while the weights are asleep. Implementations provide
    :meth:`_load_weights`, :meth:`_release_memory` and :meth:`_restore_memory`; the state
    machine and the weight-stream check live here, shared.
    """

    _weights_asleep: bool = False
    """Set by :meth:`sleep`, cleared by :meth:`wake_weights`."""

    _kv_asleep: bool = False
    """Set by :meth:`sleep`, cleared by :meth:`wake_kv_cache`."""

    _weights_loaded: bool = False
    """True once a complete :meth:`update_weights` succeeded (false again while one fails)."""

    @property
    def asleep(self) -> bool:
        """True while the weights or the KV cache are released (``generate`` refuses)."""
        return self._weights_asleep or self._kv_asleep

    def _admit(
        self, prompt_token_ids: list[list[int]], n: int, sampling: SamplingArg
    ) -> list[SamplingParams]:
        """:func:`validate_requests`, then the engine state every ``generate`` needs (awake,
        weights loaded); returns the per-prompt sampling settings."""
        params = validate_requests(
            prompt_token_ids,
            n,
            sampling,
            max_model_len=self.max_model_len,
            vocab_size=self.vocab_size,
        )
        if self.asleep:
            raise RuntimeError(
                f"the engine is asleep (weights asleep: {self._weights_asleep}, KV cache "
                f"asleep: {self._kv_asleep}): call wake() (or wake_weights() then "
                "wake_kv_cache()) before generate()"
            )
        if not self._weights_loaded:
            raise RuntimeError(
                "no weights loaded: call update_weights(named_tensors) with the policy's "
                "HF-named weights before generate()"
            )
        return params

    @property
    @abc.abstractmethod
    def max_model_len(self) -> int:
        """Longest ``prompt + response`` (tokens) the engine accepts."""

    @property
    @abc.abstractmethod
    def vocab_size(self) -> int:
        """Number of token ids the model embeds; valid ids are ``[0, vocab_size)``."""

    @abc.abstractmethod
    def generate(
        self, prompt_token_ids: list[list[int]], n: int, sampling: SamplingArg
    ) -> list[list[Completion]]:
        """``n`` completions for each prompt: ``result[i][j]`` is sample ``j`` of prompt ``i``.

        ``sampling`` is one :class:`SamplingParams` for all prompts or a list with one per
        prompt (per-request seeds in one batched call). Prompts never share random numbers:
        two prompts with the same seed (or none) draw from one stream in prompt order, not
        from two copies of it. Bad input raises :class:`ValueError` naming the prompt (see
        :func:`validate_requests`).
        """

    # ----------------------------------------------------------------- weights
    def update_weights(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        *,
        expected: ExpectedShapes | None = None,
    ) -> None:
        """Load a full set of Hugging Face-named tensors (consumed once, in any order).

        With ``expected`` (HF name -> full shape, from the trainer's converter) the stream is
        checked on our side first (:class:`~reco_megatron.rollout.weight_check.WeightStreamCheck`):
        every expected tensor exactly once with its shape; unknown names, repeats and wrong
        shapes never reach the engine. The stream is always consumed to its end (it is
        collective across ranks) before an error is raised. A failed update leaves the engine
        refusing ``generate`` until a complete one succeeds.
        """
        if self._weights_asleep:
            raise RuntimeError(
                "wake_weights() before update_weights(): the weights are asleep (level-1 sleep "
                "keeps them in host memory)"
            )
        self._weights_loaded = False
        check = WeightStreamCheck(expected) if expected is not None else None
        stream = iter(named_tensors) if check is None else check.filter(named_tensors)
        try:
            self._load_weights(stream)
        except Exception as err:
            drain(stream)
            ours = check.error() if check is not None else None
            if ours is not None:
                raise ours from err
            raise
        drain(stream)
        ours = check.error() if check is not None else None
        if ours is not None:
            raise ours
        self._after_weights_loaded()
        self._weights_loaded = True

    @abc.abstractmethod
    def _load_weights(self, stream: Iterator[tuple[str, torch.Tensor]]) -> None:
        """Copy the stream into the model; raise if the engine's own checks fail."""

    def _after_weights_loaded(self) -> None:  # noqa: B027 - optional hook
        """Run once a verified update is in (vLLM: drop prefix-cache blocks of old weights)."""

    # ----------------------------------------------------------------- memory
    def sleep(self) -> None:
        """Release what memory the engine can while training: weights to host memory, KV cache
        freed (vLLM's level-1 sleep). No-op when already asleep."""
        if self._weights_asleep and self._kv_asleep:
            return
        self._release_memory()
        self._weights_asleep = self._kv_asleep = True

    def wake_weights(self) -> None:
        """Weights back on the device, KV cache still released: the state for a weight push
        (lower peak than waking everything). No-op when the weights are awake."""
        if self._weights_asleep:
            self._restore_memory("weights")
            self._weights_asleep = False

    def wake_kv_cache(self) -> None:
        """Re-allocate the KV cache (after the weight push). No-op when it is awake."""
        if self._kv_asleep:
            self._restore_memory("kv_cache")
            self._kv_asleep = False

    def wake(self) -> None:
        """:meth:`wake_weights` then :meth:`wake_kv_cache`; ``generate`` works again."""
        self.wake_weights()
        self.wake_kv_cache()

    @abc.abstractmethod
    def _release_memory(self) -> None:
        """Move weights to host and free the KV cache."""

    @abc.abstractmethod
    def _restore_memory(self, tag: str) -> None:
        """Bring back ``"weights"`` or ``"kv_cache"``."""

    # ----------------------------------------------------------------- life cycle
    def close(self) -> None:  # noqa: B027 - optional hook, no-op by default
        """Free every resource; the engine is unusable afterwards."""

    def state_dict(self) -> dict[str, Any]:
        """Sampler state to checkpoint (RNG seed and call counter); empty if stateless."""
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:  # noqa: B027
        """Restore :meth:`state_dict` after a resume."""

    def __enter__(self) -> RolloutEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
