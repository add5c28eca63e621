"""A deterministic stand-in for a rollout engine: what it saw, and actions from the context."""

from __future__ import annotations

import random

from reco_megatron.rollout import Completion, SamplingParams


class ScriptedEngine:
    """``generate`` samples ``length`` tokens in ``[20, 30)`` from a RNG seeded by the
    request's seed and context; it stops early on a requested stop id it drew."""

    def __init__(self, length: int = 4) -> None:
        self.length = length
        self.calls: list[tuple[list[list[int]], int, list[SamplingParams]]] = []

    def generate(self, prompts, n, params):
        self.calls.append(([list(p) for p in prompts], n, list(params)))
        out = []
        for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
            group = []
            for j in range(n):
                rng = random.Random(hash((p.seed, tuple(prompt), j)))
                toks: list[int] = []
                reason = "length"
                while len(toks) < min(self.length, p.max_new_tokens):
                    tok = rng.choice([20, 21, 22, 23, 5, 6])
                    toks.append(tok)
                    if tok in p.stop_token_ids:
                        reason = "stop"
                        break
                if reason == "length" and len(toks) < p.max_new_tokens:
                    reason = "stop"  # a short answer: as if it ended on a stop token
                lps = [-0.5 - 0.01 * k for k in range(len(toks))]
                group.append(Completion(prompt_index=i, sample_index=j, token_ids=toks,
                                        logprobs=lps, finish_reason=reason))  # fmt: skip
            out.append(group)
        return out
