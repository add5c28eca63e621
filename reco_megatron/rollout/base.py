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
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from reco_megatron.rollout.weight_check import ExpectedShapes, WeightStreamCheck, drain

FinishReason = Literal["stop", "length"]
FINISH_REASONS: tuple[str, ...] = ("stop", "length")


@dataclass(kw_only=True, frozen=True)
class SamplingParams:
    """How to sample responses; validated on construction (errors quote the bad value)."""

    temperature: float = 1.0
    """Softmax temperature (>= 0); ``0`` means greedy decoding. Log-probs are reported under
    ``logits / temperature`` (under the raw logits when greedy)."""

    top_p: float = 1.0
    """Nucleus truncation for sampling only, in (0, 1]; ``1`` disables it."""

    top_k: int = 0
    """Keep only the ``top_k`` most likely tokens for sampling (>= 0); ``0`` disables it."""

    max_new_tokens: int = 256
    """Most response tokens per completion (>= 1); a completion that reaches it without a stop
    token ends with ``finish_reason == "length"``."""

    seed: int | None = None
    """Seed of this call's sampling RNG; ``None`` derives it from the engine's seed and call
    counter (reproducible given the engine state, see ``EmbeddedEngine.state_dict``)."""

    stop_token_ids: tuple[int, ...] = ()
    """Extra token ids that end a response (on top of the model's eos ids); the stop token is
    part of the response and carries a log-prob."""

    def __post_init__(self) -> None:
        if not isinstance(self.temperature, int | float) or not math.isfinite(self.temperature):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if self.temperature < 0:
            raise ValueError(
                f"temperature must be >= 0 (0 = greedy), got {self.temperature!r}; "
                "use e.g. temperature=1.0 for RL sampling"
            )
        if not isinstance(self.top_p, int | float) or not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1] (1 disables it), got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 disables it), got {self.top_k!r}")
        if (
            isinstance(self.max_new_tokens, bool)
            or not isinstance(self.max_new_tokens, int)
            or self.max_new_tokens < 1
        ):
            raise ValueError(f"max_new_tokens must be an int >= 1, got {self.max_new_tokens!r}")
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int)
        ):
            raise ValueError(f"seed must be an int or None, got {self.seed!r}")
        stops = tuple(self.stop_token_ids)
        bad = [t for t in stops if isinstance(t, bool) or not isinstance(t, int) or t < 0]
        if bad:
            raise ValueError(f"stop_token_ids must be non-negative ints, got {bad!r}")
        object.__setattr__(self, "stop_token_ids", stops)

    @property
    def greedy(self) -> bool:
        """True when ``temperature == 0`` (argmax decoding)."""
        return self.temperature == 0


@dataclass(kw_only=True, frozen=True)
class Completion:
    """One sampled response to one prompt."""

    prompt_index: int
    """Index of the prompt in the ``generate`` call."""

    sample_index: int
    """Which of the ``n`` samples of that prompt this is (``0 .. n-1``)."""

    token_ids: list[int]
    """Response tokens ``[T]``, without the prompt; ends with the stop token when
    ``finish_reason == "stop"``."""

    logprobs: list[float]
    """``[T]``: entry ``t`` is ``log softmax(logits_t / temperature)[token_ids[t]]`` with
    ``logits_t`` the model's output for ``prompt + token_ids[:t]`` (before top-p/top-k)."""

    finish_reason: FinishReason
    """``"stop"`` (an eos/stop token was sampled) or ``"length"`` (``max_new_tokens`` hit)."""

    routed_experts: torch.Tensor | None = None
    """Mixture-of-experts models, when the engine records routing: ``[P + T, layers, top-k]``
    int16, the experts each position of ``prompt + token_ids`` was routed to in each MoE layer
    (``-1`` where the engine did not run the position, e.g. the last token)."""

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.logprobs):
            raise ValueError(
                f"completion of prompt {self.prompt_index}: {len(self.token_ids)} tokens but "
                f"{len(self.logprobs)} log-probs"
            )
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(
                f"finish_reason must be one of {FINISH_REASONS}, got {self.finish_reason!r}"
            )


SamplingArg = SamplingParams | Sequence[SamplingParams]
"""What ``generate`` takes: one :class:`SamplingParams` for every prompt, or one per prompt."""


def per_prompt_sampling(
    prompt_token_ids: Sequence[Sequence[int]], sampling: SamplingArg
) -> list[SamplingParams]:
    """``[len(prompt_token_ids)]`` sampling settings: ``sampling`` repeated, or checked as a list.

    A list lets one batched call give every prompt its own seed (the trainer's one seed per
    prompt, which keeps a prompt's responses independent of the data-parallel layout).
    """
    if isinstance(sampling, SamplingParams):
        return [sampling] * len(prompt_token_ids)
    if isinstance(sampling, str | bytes | Mapping) or not isinstance(sampling, Sequence):
        raise TypeError(
            "sampling must be a SamplingParams or a list of them (one per prompt), got "
            f"{type(sampling).__name__}"
        )
    params = list(sampling)
    if len(params) != len(prompt_token_ids):
        raise ValueError(
            f"got {len(params)} SamplingParams for {len(prompt_token_ids)} prompts; pass one "
            "per prompt, or a single SamplingParams for all"
        )
    for i, p in enumerate(params):
        if not isinstance(p, SamplingParams):
            raise TypeError(f"sampling[{i}] must be a SamplingParams, got {type(p).__name__}")
    return params


def validate_requests(
    prompt_token_ids: Sequence[Sequence[int]],
    n: int,
    sampling: SamplingArg,
    *,
    max_model_len: int,
    vocab_size: int,
) -> list[SamplingParams]:
    """Reject requests no engine should run, naming the prompt index; return the per-prompt
    sampling settings (:func:`per_prompt_sampling`).

    Raises :class:`ValueError` for: ``n < 1``, no prompts, an empty prompt, a non-int or
    out-of-vocabulary token id (``[0, vocab_size)``), a prompt longer than ``max_model_len``,
    ``len(prompt) + max_new_tokens > max_model_len`` (which would make the engine cut the
    response short for a reason other than the caller's ``max_new_tokens``), a stop token
    outside the vocabulary, or a sampling list whose length is not the number of prompts.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n (responses per prompt) must be an int >= 1, got {n!r}")
    if isinstance(prompt_token_ids, str | bytes) or len(prompt_token_ids) == 0:
        raise ValueError("prompt_token_ids must be a non-empty list of token-id lists")
    params = per_prompt_sampling(prompt_token_ids, sampling)
    for i, (prompt, p) in enumerate(zip(prompt_token_ids, params, strict=True)):
        if isinstance(prompt, str | bytes):
            raise ValueError(f"prompt {i} is a string; pass token ids (tokenize first)")
        length = len(prompt)
        if length == 0:
            raise ValueError(f"prompt {i} is empty: every prompt needs at least one token")
        if length > max_model_len:
            raise ValueError(
                f"prompt {i} has {length} tokens, more than the engine's max_model_len "
                f"{max_model_len}; shorten or filter it"
            )
        if length > max_model_len - p.max_new_tokens:
            raise ValueError(
                f"prompt {i} has {length} tokens; with max_new_tokens={p.max_new_tokens} "
                f"that is {length + p.max_new_tokens} > max_model_len {max_model_len}; "
                "lower max_new_tokens or filter long prompts"
            )
        for pos, tok in enumerate(prompt):
            if isinstance(tok, bool) or not isinstance(tok, int) or not 0 <= tok < vocab_size:
                raise ValueError(
                    f"prompt {i}, position {pos}: token id {tok!r} is not an int in "
                    f"[0, vocab_size={vocab_size})"
                )
        bad_stops = [t for t in p.stop_token_ids if t >= vocab_size]
        if bad_stops:
            raise ValueError(
                f"stop_token_ids {bad_stops!r} (prompt {i}) are outside "
                f"[0, vocab_size={vocab_size})"
            )
    return params


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
