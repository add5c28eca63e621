"""One router's replay hook: what megatron-core asks for its top-k experts.

megatron-core's ``topk_routing_with_score_function`` asks the router's
``router_replay`` object for the top-k experts (``get_replay_topk(scores, topk, num_groups,
group_topk, default_compute_topk)``, megatron-core 0.16 and 0.19). We give every router of the
policy its own :class:`ReplayHook` there instead of megatron's ``RouterReplay``, because the
latter keeps one process-wide list of instances (the reference model's routers would join it),
replays all tokens or none, and does not record the free choice while replaying. The hook
always computes the router's own top-k first (recorded when asked, for the metrics), then, for
tokens with a target, replaces the selection by the target; the probabilities are the scores
*at the replayed experts* (megatron renormalises them over the k as for a free choice), so the
gradient still reaches the router. A token whose target is ``-1`` (not recorded by the rollout:
padding, the last sampled token) routes freely.
"""

from __future__ import annotations

from typing import Any

import torch

MISSING = -1
"""Expert index of a token whose routing is unknown (it routes freely when replayed)."""


def routed_dtype(num_experts: int) -> torch.dtype:
    """The integer type of a ``routed_experts`` tensor: int16 (``-1`` marks unknown)."""
    if num_experts >= 2**15:
        raise ValueError(f"{num_experts} experts do not fit int16 expert indices")
    return torch.int16


class ReplayHook:
    """One router's replay hook (megatron calls :meth:`get_replay_topk` for its top-k)."""

    def __init__(self, layer: int) -> None:
        self.layer = layer
        """Global layer index (0-based)."""
        self.target: torch.Tensor | None = None
        """``[tokens, k]`` experts to use (``-1`` rows route freely); None: route freely."""
        self.record = False
        """Keep the router's own choice of each forward in :attr:`recorded`."""
        self.recorded: list[torch.Tensor] = []
        """``[tokens, k]`` free choices, sorted per token, one entry per forward."""

    def get_replay_topk(
        self,
        scores: torch.Tensor,
        topk: int,
        num_groups: int | None = None,
        group_topk: int | None = None,
        default_compute_topk: Any = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        values, chosen = default_compute_topk(
            scores, topk, num_groups=num_groups, group_topk=group_topk
        )
        if self.record:
            self.recorded.append(chosen.detach().sort(dim=-1).values)
        if self.target is None:
            return values, chosen
        target = self.target.to(device=scores.device, dtype=torch.long)
        if target.shape != chosen.shape:
            raise RuntimeError(
                f"routing replay of layer {self.layer}: {tuple(target.shape)} target experts for "
                f"a router that chose {tuple(chosen.shape)} (tokens x top-k): the rollout's "
                "routing does not match this micro-batch"
            )
        known = (target >= 0).all(dim=-1, keepdim=True)
        replayed = torch.where(known, target, chosen)
        return scores.gather(1, replayed), replayed
