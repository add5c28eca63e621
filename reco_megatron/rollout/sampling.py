"""One sampling step: truncate (top-k, top-p), draw by inverse CDF, report the log-prob; and
the random numbers behind it (one stream per seed, see :func:`draw_noise`).

Pure tensor code shared by the embedded engine and its tests. The reported log-prob is that of
the temperature-scaled *untruncated* distribution (the trainer's convention, see
:mod:`reco_megatron.rollout.base`); truncation only decides which tokens can be drawn.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import torch

from reco_megatron.rollout.requests import SamplingParams


def truncation_mask(scaled_logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Tokens kept for sampling: ``[b, V]`` bool.

    ``top_k > 0`` keeps the ``top_k`` largest logits (ties with the k-th are kept);
    ``top_p < 1`` keeps the smallest set of most likely tokens whose probability reaches
    ``top_p`` (the most likely token is always kept). Both apply when both are set.
    """
    keep = torch.ones_like(scaled_logits, dtype=torch.bool)
    vocab = scaled_logits.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(scaled_logits, top_k, dim=-1).values[:, -1:]
        keep &= scaled_logits >= kth
    if top_p < 1.0:
        masked = scaled_logits.masked_fill(~keep, float("-inf"))
        probs = torch.softmax(masked, dim=-1)
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        keep_sorted = mass_before < top_p
        keep_sorted[:, 0] = True
        keep &= torch.zeros_like(keep).scatter(-1, order, keep_sorted)
    return keep


def sample_next(
    logits: torch.Tensor, uniforms: torch.Tensor, sampling: SamplingParams
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw the next token of each row and its log-prob.

    Args:
        logits: ``[b, V]`` fp32 logits of the last position.
        uniforms: ``[b]`` numbers in ``[0, 1)``, one per row (ignored when greedy).
        sampling: temperature / top-k / top-p.

    Returns:
        ``(tokens [b] long, logprobs [b] fp32)`` with ``logprobs`` taken from
        ``log_softmax(logits / T)`` (``log_softmax(logits)`` when greedy).
    """
    logits = logits.float()
    if sampling.greedy:
        tokens = logits.argmax(dim=-1)
        logp = torch.log_softmax(logits, dim=-1)
        return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)
    scaled = logits / sampling.temperature
    logp = torch.log_softmax(scaled, dim=-1)
    keep = truncation_mask(scaled, sampling.top_k, sampling.top_p)
    probs = torch.softmax(scaled.masked_fill(~keep, float("-inf")), dim=-1).double()
    cdf = torch.cumsum(probs, dim=-1)
    target = (uniforms.to(cdf) * cdf[:, -1]).unsqueeze(-1)
    tokens = torch.searchsorted(cdf, target, right=True).squeeze(-1)
    # Rounding can put the target at the very end of the CDF: fall back to the last kept token.
    vocab = probs.shape[-1]
    last_kept = vocab - 1 - torch.flip(probs > 0, dims=[-1]).long().argmax(dim=-1)
    tokens = torch.minimum(tokens, last_kept)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)


def call_seed(base_seed: int, call_index: int) -> int:
    """Seed of call ``call_index`` of an engine seeded ``base_seed`` (stable across runs)."""
    digest = hashlib.sha256(f"{base_seed}:{call_index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


class SeededCalls:
    """The sampler state of an engine seeded ``_seed`` that made ``_calls`` calls (call ``k``
    without a per-prompt seed draws from :func:`call_seed`); put it before
    :class:`~reco_megatron.rollout.base.RolloutEngine` in the bases."""

    _seed: int
    _calls: int

    def state_dict(self) -> dict[str, Any]:
        """``{"seed", "call_index"}``: enough to replay the sampler exactly after a resume."""
        return {"seed": self._seed, "call_index": self._calls}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`; the next call samples as the saved engine would have."""
        missing = {"seed", "call_index"} - set(state)
        if missing:
            raise ValueError(f"sampler state lacks {sorted(missing)}; got keys {sorted(state)}")
        seed, calls = state["seed"], state["call_index"]
        if not isinstance(seed, int) or not isinstance(calls, int) or calls < 0:
            raise ValueError(f"bad sampler state {dict(state)!r}: seed int, call_index int >= 0")
        self._seed, self._calls = seed, calls


def draw_noise(params: list[SamplingParams], n: int, default_seed: int) -> list[torch.Tensor]:
    """Per prompt ``i``: ``[n, params[i].max_new_tokens]`` fp64 uniforms, one per (sample, step).

    One :class:`torch.Generator` per distinct seed (``default_seed`` for prompts without one),
    consumed in prompt order: a prompt with a seed of its own gets exactly the numbers a
    single-prompt call with that seed gets, and prompts that share a seed continue one stream
    instead of repeating it. No global RNG is touched.
    """
    streams: dict[int, torch.Generator] = {}
    noise = []
    for p in params:
        seed = default_seed if p.seed is None else p.seed
        if seed not in streams:
            streams[seed] = torch.Generator(device="cpu").manual_seed(seed)
        noise.append(torch.rand(n, p.max_new_tokens, generator=streams[seed], dtype=torch.float64))
    return noise


def group_by_setting(params: list[SamplingParams]) -> dict[SamplingParams, list[int]]:
    """Prompt indices grouped by sampling settings without the seed (each group decodes in one
    batched loop; insertion order keeps the first prompt's group first)."""
    groups: dict[SamplingParams, list[int]] = {}
    for i, p in enumerate(params):
        groups.setdefault(replace(p, seed=None), []).append(i)
    return groups
