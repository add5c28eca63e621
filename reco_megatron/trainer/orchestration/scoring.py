"""The rewards of a step's responses, the same on every rank of a model-parallel group.

The first rank of each model-parallel group scores its data-parallel share in the isolated
reward pool and broadcasts the scores to the rest of its group; the failure counts (by kind,
and the answers the reward could not parse) are summed over the data-parallel ranks, so the
step's reward-health columns and the stop on too many failures are global decisions.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from reco_megatron.parallel.collectives import collective_device
from reco_megatron.parallel.layout import RankLayout
from reco_megatron.rewards.pool import RewardPool
from reco_megatron.trainer.lifecycle import unparsable_count
from reco_megatron.trainer.reporting import check_failures, failure_row, local_counts

if TYPE_CHECKING:  # annotations only: the configuration imports no room
    from reco_megatron.rewards.pool_config import RewardPoolConfig


class StepScorer:
    """Scores ``[B]`` responses for one step; owns the reward pool (first rank of each
    model-parallel group only)."""

    def __init__(self, cfg: RewardPoolConfig, layout: RankLayout) -> None:
        self.cfg = cfg
        self.layout = layout
        self.pool = RewardPool(cfg) if layout.first_of_replica else None

    def score(
        self, step: int, texts: Sequence[str], golds: Sequence[str]
    ) -> tuple[torch.Tensor, dict[str, float], dict[str, float]]:
        """``(scores [B] float32, the pool's metrics (that rank's), the global failure
        columns)`` for step ``step``; raises the reward-health stop when too many failed."""
        n = len(texts)
        scores = torch.zeros(n, dtype=torch.float64)
        metrics: dict[str, float] = {}
        statuses = None
        if self.pool is not None:
            batch = self.pool.score(list(texts), list(golds))
            scores = torch.tensor(batch.scores, dtype=torch.float64)
            metrics, statuses = dict(batch.metrics), batch.statuses
        group = self.layout.mp_group
        unparsable = torch.tensor([unparsable_count(statuses)], dtype=torch.float64)
        buf = torch.cat([scores, local_counts(statuses, n), unparsable])
        buf = buf.to(collective_device(group))
        if dist.get_world_size(group) > 1:
            dist.broadcast(buf, src=dist.get_global_rank(group, 0), group=group)
        counts = buf[n:].clone()
        if self.layout.dp_size > 1:
            dist.all_reduce(counts, group=self.layout.dp_group)
        counts = counts.cpu()
        row = failure_row(counts[:-1])
        row["reward_unparsable_frac"] = float(counts[-1]) / max(float(counts[-2]), 1.0)
        check_failures(step, row, self.cfg.max_failed_frac, self.cfg.reward)
        return buf[:n].cpu().float(), metrics, row

    def score_here(self, texts: Sequence[str], golds: Sequence[str]) -> list[float]:
        """Scores of this rank's pool alone (the coverage evaluation on rank 0)."""
        assert self.pool is not None, "only the first rank of a model-parallel group scores"
        return self.pool.score(list(texts), list(golds)).scores

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
