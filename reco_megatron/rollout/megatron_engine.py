"""The ``megatron`` rollout engine: our protocol on top of a decoder over the trainer's model.

The decoding itself (megatron-core forward passes with the static KV cache, at the trainer's
TP/PP layout) is :class:`reco_megatron.megatron.decoding.decoder.MegatronDecoder`; this layer never
imports megatron and takes any object with the :class:`ModelDecoder` shape. What lives here is
what the protocol promises and the embedded engine already does, reused as is: request
validation, one random stream per seed drawn up front (:func:`draw_noise`), prompts grouped by
setting and chunked by rows, sampling by inverse CDF with the log-prob of the temperature-scaled
untruncated distribution (:func:`sample_next`). So for the same model, prompts and seeds this
engine draws the same uniforms, applies the same truncation and reports the same convention as
:class:`reco_megatron.rollout.embedded.EmbeddedEngine`; only the forward differs (megatron's
modules around its own attention and KV cache, see ``docs/rollout.md``).

Weights: the decoder reads the trainer's live parameters, so there is nothing to load.
:meth:`MegatronEngine.update_weights` takes an *empty* stream (what
:func:`reco_megatron.trainer.orchestration.engines.sync_weights` sends it) and refuses
tensors: pushing converted weights into the training model would silently overwrite the policy.
Every update and every :meth:`~MegatronEngine.sleep` (the trainer updates the weights while the
engine sleeps) drops the decoder's prefix cache (:meth:`ModelDecoder.reset_prefix_cache`): the
keys and values of earlier turns that multi-turn episodes reuse from one ``generate`` call to
the next were computed with the old weights.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Protocol

import torch

from reco_megatron.rollout.base import RolloutEngine
from reco_megatron.rollout.requests import Completion, SamplingArg
from reco_megatron.rollout.sampling import (
    SeededCalls,
    call_seed,
    draw_noise,
    group_by_setting,
    sample_next,
)
from reco_megatron.utils.logging import get_logger

logger = get_logger(__name__)

SampleFn = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
"""``sample(logits [b, V], uniforms [b]) -> (tokens [b], log-probs [b])``: one decoding step's
draw (:func:`~reco_megatron.rollout.sampling.sample_next` with a row's settings bound)."""


class DecodedRow(Protocol):
    """One decoded row (:class:`reco_megatron.megatron.decoding.decoder.Decoded`)."""

    token_ids: list[int]
    logprobs: list[float]
    stopped: bool
    routed_experts: torch.Tensor | None


class ModelDecoder(Protocol):
    """What the engine needs from the model side (``MegatronDecoder`` satisfies it)."""

    vocab_size: int
    max_model_len: int

    def max_rows(self, length: int) -> int:
        """Rows one :meth:`decode` call may take when its rows need ``length`` positions."""
        ...

    def decode(
        self,
        prompts: Sequence[Sequence[int]],
        noise: torch.Tensor,
        stop_ids: Sequence[int],
        sample: SampleFn,
        sample_key: object = None,
    ) -> Sequence[DecodedRow]:
        """Rows ``[b]`` decoded with ``noise [b, max_new_tokens]`` and ``sample``
        (``sample_key``: a hashable naming ``sample``'s settings)."""
        ...

    def free_cache(self) -> None:
        """Release the KV cache."""
        ...

    def reset_prefix_cache(self) -> None:
        """Drop the keys and values kept for prompts that extend earlier ones (the weights
        changed)."""
        ...


@dataclass(kw_only=True)
class MegatronEngineConfig:
    """Settings of :class:`MegatronEngine` (memory settings live on the decoder)."""

    seed: int = 0
    """Base seed of the sampler; call ``k`` without ``SamplingParams.seed`` uses a seed
    derived from ``(seed, k)`` (as the embedded engine)."""

    eos_token_ids: tuple[int, ...] = ()
    """Token ids that end every response (on top of ``SamplingParams.stop_token_ids``)."""

    release_cache_after_generate: bool = False
    """Free the KV cache (and on a GPU the captured decode steps) when
    :meth:`MegatronEngine.generate` returns and at :meth:`~MegatronEngine.sleep`, so the
    trainer's update gets the memory back (the next call allocates and captures again).
    ``False`` (the default) keeps them through ``generate`` and ``sleep`` (which then only
    refuses generation until ``wake``); :meth:`~MegatronEngine.close` always frees them."""

    def __post_init__(self) -> None:
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed must be an int, got {self.seed!r}")
        self.eos_token_ids = tuple(int(t) for t in self.eos_token_ids)


class MegatronEngine(SeededCalls, RolloutEngine):
    """Generation with the trainer's own megatron-core model through a :class:`ModelDecoder`.

    Collective: every rank of a model-parallel group (TP x PP) must call :meth:`generate` with
    the same prompts and settings; all of them return the same completions.
    """

    uses_trainer_weights = True
    """The weights are the trainer's: the weight sync sends an empty stream (no conversion)."""

    def __init__(self, decoder: ModelDecoder, config: MegatronEngineConfig | None = None) -> None:
        self.decoder = decoder
        self.config = config or MegatronEngineConfig()
        bad = [t for t in self.config.eos_token_ids if not 0 <= t < decoder.vocab_size]
        if bad:
            raise ValueError(f"eos_token_ids {bad!r} outside [0, {decoder.vocab_size})")
        self._seed = self.config.seed
        self._calls = 0
        self._weights_loaded = True  # the live training weights
        self._closed = False

    @property
    def max_model_len(self) -> int:
        return self.decoder.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.decoder.vocab_size

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Token ids that end every response."""
        return self.config.eos_token_ids

    def _load_weights(self, stream: Iterator[tuple[str, torch.Tensor]]) -> None:
        """Accept only the empty stream: the weights are the trainer's own, always current.

        The KV cache kept between calls is rewritten by every call; the prefix cache is
        dropped once the update is in (:meth:`_after_weights_loaded`). A non-empty stream
        raises instead of overwriting the policy.
        """
        self._check_open()
        names = [name for name, _ in stream]
        if names:
            raise ValueError(
                f"the megatron rollout engine generates with the trainer's own weights and takes "
                f"no weight stream; got {len(names)} tensors (first: {names[:3]!r}). Call "
                "update_weights(()) after an optimizer step, or use rollout.engine=embedded to "
                "generate from exported weights"
            )

    def generate(
        self, prompt_token_ids: list[list[int]], n: int, sampling: SamplingArg
    ) -> list[list[Completion]]:
        """``n`` completions per prompt; ``result[i][j]`` is sample ``j`` of prompt ``i``.

        Same grouping, noise and sampling as the embedded engine (module docstring); a call
        holds at most ``decoder.max_rows(...)`` rows (all of a setting's rows by default),
        sorted by prompt length.
        """
        self._check_open()
        params = self._admit(prompt_token_ids, n, sampling)
        noise = draw_noise(params, n, call_seed(self._seed, self._calls))
        self._calls += 1
        start = time.perf_counter()
        out: list[list[Completion | None]] = [[None] * n for _ in prompt_token_ids]
        calls = []
        for setting, members in group_by_setting(params).items():
            stop_ids = sorted(set(self.config.eos_token_ids) | set(setting.stop_token_ids))
            # Rows of similar prompt length share a call when they do not all fit in one
            # (less padding in the prefill; never other results: a row's noise and tokens do
            # not depend on its call).
            rows = sorted(
                ((i, j) for i in members for j in range(n)),
                key=lambda row: len(prompt_token_ids[row[0]]),
            )
            longest = max(len(prompt_token_ids[i]) for i in members)
            size = self.decoder.max_rows(longest + setting.max_new_tokens)
            sample = partial(sample_next, sampling=setting)
            for lo in range(0, len(rows), size):
                calls.append((rows[lo : lo + size], stop_ids, sample, setting))
        # Expert-parallel decoders run their MoE layers together: every rank makes as many
        # decode calls as the busiest (the others idle); other decoders have no such method.
        lockstep = getattr(self.decoder, "lockstep_calls", None)
        idle = (lockstep(len(calls)) if lockstep is not None else len(calls)) - len(calls)
        for chunk, stop_ids, sample, setting in calls:
            decoded = self.decoder.decode(
                [prompt_token_ids[i] for i, _ in chunk],
                torch.stack([noise[i][j] for i, j in chunk]),
                stop_ids,
                sample,
                sample_key=setting,
            )
            for (i, j), row in zip(chunk, decoded, strict=True):
                out[i][j] = Completion(
                    prompt_index=i,
                    sample_index=j,
                    token_ids=list(row.token_ids),
                    logprobs=list(row.logprobs),
                    finish_reason="stop" if row.stopped else "length",
                    routed_experts=getattr(row, "routed_experts", None),
                )
        for _ in range(idle):
            self.decoder.decode_idle()
        self._release_memory()
        logger.debug(
            "megatron generate: %d prompts x %d in %.2fs",
            len(out),
            n,
            time.perf_counter() - start,
        )
        return [[c for c in group if c is not None] for group in out]

    def _after_weights_loaded(self) -> None:
        """The weights changed: kept prefixes of the old weights must not be reused."""
        self.decoder.reset_prefix_cache()

    def sleep(self) -> None:
        """As every engine's (:meth:`RolloutEngine.sleep`), and drop the prefix cache: the
        trainer updates the weights while the engine sleeps."""
        self.decoder.reset_prefix_cache()
        super().sleep()

    def _release_memory(self) -> None:
        """Free the KV cache unless it is kept (``release_cache_after_generate=False``); the
        weights are the trainer's and stay where they are. The prefix cache stays (the next
        turn of an episode reuses it) until the weights change or the engine sleeps."""
        self._check_open()
        if self.config.release_cache_after_generate:
            self.decoder.free_cache()

    def _restore_memory(self, tag: str) -> None:
        """Nothing to do now: megatron allocates the KV cache lazily in the next forward."""

    def close(self) -> None:
        """Free the KV cache; the engine cannot be used afterwards."""
        if not self._closed:
            self.decoder.free_cache()
            self.decoder.reset_prefix_cache()
            self._closed = True

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the engine was closed; build a new MegatronEngine")
