"""What a rollout is asked and what it returns: the request and completion types.

:class:`SamplingParams` (how to sample, validated on construction), :class:`Completion` (one
response with its per-token log-probs; the log-prob convention is in
:mod:`reco_megatron.rollout.base`), and the checks every engine applies to a batch of
requests before it runs (:func:`validate_requests`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

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

    loss_mask: list[int] | None = None
    """``[T]`` for a multi-turn episode (``reco_megatron.envs``): 1 on the tokens the policy
    sampled, 0 on the tokens an environment appended (observations, whose ``logprobs`` entries
    are 0 and mean nothing). ``None``: every token is the policy's (a single-turn response)."""

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.logprobs):
            raise ValueError(
                f"completion of prompt {self.prompt_index}: {len(self.token_ids)} tokens but "
                f"{len(self.logprobs)} log-probs"
            )
        mask = self.loss_mask
        if mask is not None and (
            len(mask) != len(self.token_ids) or any(m not in (0, 1) for m in mask)
        ):
            raise ValueError(
                f"completion of prompt {self.prompt_index}: loss_mask must hold one 0/1 per "
                f"token ({len(self.token_ids)}), got {len(mask)} entries"
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
