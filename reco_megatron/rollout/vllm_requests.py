"""What the vLLM engine sends and receives, as pure functions (tested without vLLM).

``vllm.SamplingParams`` keyword arguments per request, per-request seeds, and the conversion of
``RequestOutput`` objects into :class:`~reco_megatron.rollout.requests.Completion` lists; the
behaviour they encode was read from the vLLM 0.33.0 source (see ``vllm_engine``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch

from reco_megatron.rollout.requests import Completion, SamplingParams
from reco_megatron.rollout.sampling import call_seed

VLLM_MAX_TEMPERATURE = 2.0
"""vLLM 0.33 rejects larger temperatures (``SamplingParams._verify_args`` raises
``VLLMValidationError``; the engine turns it into a ``ValueError`` naming the setting)."""

VLLM_MIN_TEMPERATURE = 0.01
"""vLLM 0.33 raises smaller positive temperatures to this value without a word."""


def vllm_sampling_kwargs(n: int, sampling: SamplingParams) -> dict[str, Any]:
    """Keyword arguments of ``vllm.SamplingParams`` for one call (pure; tested without vLLM).

    ``logprobs=0`` returns only the sampled token's log-prob; ``top_k=0`` disables top-k (vLLM
    0.33's documented "off", as ours); ``detokenize=False`` because the trainer works on token
    ids. Raises :class:`ValueError` for a positive temperature below
    :data:`VLLM_MIN_TEMPERATURE`, which vLLM would silently change (the log-probs would be of
    another temperature); what vLLM rejects itself it reports (see ``VLLMEngine.generate``).
    """
    t = float(sampling.temperature)
    if 0.0 < t < VLLM_MIN_TEMPERATURE:
        raise ValueError(
            f"temperature {t} is below {VLLM_MIN_TEMPERATURE}: vLLM would silently sample at "
            f"{VLLM_MIN_TEMPERATURE} and report log-probs for that temperature; use 0 (greedy) "
            f"or >= {VLLM_MIN_TEMPERATURE}"
        )
    return {
        "n": n,
        "temperature": t,
        "top_p": float(sampling.top_p),
        "top_k": sampling.top_k,
        "max_tokens": sampling.max_new_tokens,
        "seed": sampling.seed,
        "stop_token_ids": list(sampling.stop_token_ids),
        "logprobs": 0,
        "detokenize": False,
    }


def request_seeds(params: Sequence[SamplingParams]) -> list[int | None]:
    """The seed each prompt's request carries: ``call_seed(seed, k)`` for the ``k``-th prompt
    of the call that uses ``seed`` (``k = 0`` for the first).

    vLLM gives every request a generator seeded with its ``seed`` and child ``j`` of a request
    with ``n`` samples ``seed + j`` (``v1/engine/parallel_sampling.py``). Sent as is, prompts
    seeded ``s`` and ``s + 1`` would share child seeds (child 1 of the first = child 0 of the
    second: identical noise); a seed repeated across prompts would repeat all of them. Hashing
    every seed spreads the requests over 63-bit values, so no two prompts share noise whatever
    seeds the caller chose (the embedded engine instead continues one stream per seed).
    ``None`` stays ``None`` (vLLM's engine RNG).
    """
    seen: dict[int, int] = {}
    seeds: list[int | None] = []
    for p in params:
        if p.seed is None:
            seeds.append(None)
            continue
        repeat = seen.get(p.seed, 0)
        seen[p.seed] = repeat + 1
        seeds.append(call_seed(p.seed, repeat))
    return seeds


ROUTED_EXPERTS_HELP = (
    "vLLM returns the routed experts of a mixture-of-experts model with "
    "LLM(..., enable_return_routed_experts=True) (vLLM >= 0.21: RequestOutput."
    "prompt_routed_experts [prompt, layers, top-k] and CompletionOutput.routed_experts "
    "[generated, layers, top-k]; newer releases also need Model Runner V2 and prefix caching "
    "and refuse pipeline parallelism)"
)


def routed_experts_of(request: Any, sample: Any, length: int) -> torch.Tensor:
    """``[length, layers, top-k]`` int16 experts of ``prompt + response`` (``length``
    positions) from vLLM's prompt and per-sample arrays; the last position, which vLLM never
    runs, is ``-1`` when it is missing. Raises naming what vLLM returned otherwise."""
    prompt = getattr(request, "prompt_routed_experts", None)
    generated = getattr(sample, "routed_experts", None)
    if prompt is None or generated is None:
        raise RuntimeError(f"vLLM returned no routed experts: {ROUTED_EXPERTS_HELP}")
    parts = [torch.as_tensor(prompt), torch.as_tensor(generated)]
    if parts[0].dim() != 3 or parts[1].dim() != 3 or parts[0].shape[1:] != parts[1].shape[1:]:
        raise RuntimeError(
            f"vLLM's routed experts have shapes {[tuple(p.shape) for p in parts]}; expected "
            "[positions, layers, top-k] for the prompt and the response"
        )
    routed = torch.cat(parts).to(torch.int16)
    if routed.shape[0] == length - 1:
        routed = torch.cat([routed, torch.full_like(routed[:1], -1)])
    if routed.shape[0] != length:
        raise RuntimeError(
            f"vLLM's routed experts cover {routed.shape[0]} positions of a {length}-token "
            "prompt + response (expected it, or one fewer)"
        )
    return routed


def completions_from_outputs(
    outputs: Sequence[Any], n: int | Sequence[int], *, routed_experts: bool = False
) -> list[list[Completion]]:
    """Convert vLLM ``RequestOutput`` objects (one per prompt, in order) to completions;
    ``n`` is the number of samples asked per prompt (one int, or one per prompt).

    Reads only public fields: ``output.outputs[j].token_ids``, ``.logprobs`` (one mapping per
    sampled token, ``token_id -> Logprob(logprob=...)``) and ``.finish_reason``, and with
    ``routed_experts`` the routing arrays (:func:`routed_experts_of`). An ``"abort"`` or a
    missing log-prob raises: the trainer must never train on a half-reported sample.
    """
    counts = [n] * len(outputs) if isinstance(n, int) else list(n)
    if len(counts) != len(outputs):
        raise RuntimeError(
            f"vLLM returned {len(outputs)} request outputs for {len(counts)} prompts"
        )
    result = []
    for i, (request, asked) in enumerate(zip(outputs, counts, strict=True)):
        samples = list(request.outputs)
        if len(samples) != asked:
            raise RuntimeError(
                f"vLLM returned {len(samples)} samples for prompt {i}, asked {asked}"
            )
        group = []
        for j, sample in enumerate(samples):
            token_ids = [int(t) for t in sample.token_ids]
            if sample.logprobs is None or len(sample.logprobs) != len(token_ids):
                raise RuntimeError(
                    f"prompt {i} sample {j}: vLLM gave no per-token log-probs for "
                    f"{len(token_ids)} tokens (is logprobs=0 set?)"
                )
            logprobs = [
                float(step[tok].logprob)
                for step, tok in zip(sample.logprobs, token_ids, strict=True)
            ]
            if sample.finish_reason not in ("stop", "length"):
                raise RuntimeError(
                    f"prompt {i} sample {j}: finish_reason {sample.finish_reason!r} "
                    "(aborted request?)"
                )
            routed = None
            if routed_experts:
                length = len(request.prompt_token_ids) + len(token_ids)
                routed = routed_experts_of(request, sample, length)
            group.append(
                Completion(
                    prompt_index=i,
                    sample_index=j,
                    token_ids=token_ids,
                    logprobs=logprobs,
                    finish_reason=sample.finish_reason,
                    routed_experts=routed,
                )
            )
        result.append(group)
    return result


def copy_greedy_samples(groups: list[list[Completion]], n: int) -> list[list[Completion]]:
    """Groups of one (greedy requests) copied to ``n`` samples with indices ``0 .. n-1``."""
    out = []
    for group in groups:
        if len(group) == 1 and n > 1:
            c = group[0]
            group = [
                replace(c, sample_index=j, token_ids=list(c.token_ids), logprobs=list(c.logprobs))
                for j in range(n)
            ]
        out.append(group)
    return out
