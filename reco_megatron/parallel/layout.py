"""Where this process sits in the parallel layout, as plain data.

:func:`reco_megatron.megatron.rank_layout` fills a :class:`RankLayout` from megatron-core's
``parallel_state`` once the process groups exist; the trainer, the rollout sources and the
metrics take it without importing the adapter.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["RankLayout"]


@dataclass(frozen=True)
class RankLayout:
    """Where this process sits in the parallel layout (a snapshot of megatron's state), for
    code above the adapter that must not import megatron-core itself."""

    rank: int
    """Global rank."""
    tp_rank: int
    """Rank in the tensor-parallel group."""
    pp_rank: int
    """Pipeline stage."""
    pp_size: int
    """Pipeline stages."""
    dp_rank: int
    """Rank in the data-parallel group."""
    dp_size: int
    """Data-parallel replicas."""
    dp_group: object
    """The data-parallel process group."""
    mp_group: object
    """The model-parallel (TP x PP) process group of this replica."""
    pp_group: object
    """The pipeline process group."""

    @property
    def first_of_replica(self) -> bool:
        """TP rank 0 of pipeline stage 0: the rank that does per-replica work once."""
        return self.tp_rank == 0 and self.pp_rank == 0
