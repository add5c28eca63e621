"""The decoder's collectives over its pipeline and expert-parallel groups.

:class:`StageGroups` is what a decode call exchanges besides the model's own traffic: the
last stage's sampled tokens and log-probs broadcast to every stage (on the device, no host
read), the expert-parallel group's agreement on whether anyone still decodes (at the host
reads only) and on the number of calls, and every stage's recorded experts gathered at the
end. Tensors cross to the group's collective device (:func:`~reco_megatron.parallel.
collectives.collective_device`: the CPU for gloo, the GPU for NCCL) and back.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


class StageGroups:
    """The pipeline group (``pp_size``, the last stage's rank) and the expert-parallel group
    (None without expert parallelism) of one decoder."""

    def __init__(
        self, pp_group: Any, pp_size: int, last_rank: int, ep_group: Any, device: Any
    ) -> None:
        self.pp_group, self.pp_size, self.last_rank = pp_group, pp_size, last_rank
        self.ep_group = ep_group
        self.device = device

    def share(
        self, tokens: torch.Tensor, logprobs: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The last stage's ``tokens``/``logprobs`` ``[n]`` on every stage."""
        if self.pp_size == 1:
            return tokens, logprobs
        from reco_megatron.parallel.collectives import collective_device

        box = torch.stack([tokens.double(), logprobs.double()]).to(collective_device(self.pp_group))
        dist.broadcast(box, src=self.last_rank, group=self.pp_group)
        box = box.to(self.device)
        return box[0].long(), box[1].float()

    def anyone(self, mine: bool) -> bool:
        """Whether any rank of the expert-parallel group still decodes; ``mine`` without."""
        if self.ep_group is None:
            return mine
        return self._max(1 if mine else 0) > 0

    def most(self, calls: int) -> int:
        """The largest ``calls`` of the expert-parallel group; ``calls`` without."""
        return calls if self.ep_group is None else self._max(calls)

    def _max(self, value: int) -> int:
        from reco_megatron.parallel.collectives import collective_device

        box = torch.tensor([value], dtype=torch.int64).to(collective_device(self.ep_group))
        dist.all_reduce(box, op=dist.ReduceOp.MAX, group=self.ep_group)
        return int(box.item())

    def all_layers(self, routed: torch.Tensor) -> torch.Tensor:
        """``[b, T, layers, k]`` of every pipeline stage from this stage's ``routed`` (CPU)."""
        if self.pp_size == 1:
            return routed
        from reco_megatron.parallel.collectives import collective_device

        local = routed.to(collective_device(self.pp_group), torch.int32)
        parts = [torch.empty_like(local) for _ in range(self.pp_size)]
        dist.all_gather(parts, local, group=self.pp_group)
        return torch.cat([p.cpu() for p in parts], dim=2).to(routed.dtype)


def least(value: int, group: Any) -> int:
    """The smallest ``value`` over ``group`` (None or one rank: ``value``)."""
    if group is None or dist.get_world_size(group) == 1:
        return value
    from reco_megatron.parallel.collectives import collective_device

    box = torch.tensor([value], dtype=torch.int64).to(collective_device(group))
    dist.all_reduce(box, op=dist.ReduceOp.MIN, group=group)
    return int(box.item())
