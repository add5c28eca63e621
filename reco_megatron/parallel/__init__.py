"""Vocabulary-parallel autograd ops, and the parallel plumbing that needs no megatron-core.

The ops take the tensor-parallel group explicitly. Beside them, below the adapter so that the
trainer uses them without importing it: :mod:`.batch` (the :class:`RolloutBatch` the engine
trains on and its data-parallel split), :mod:`.collectives` (``collective_device``,
``from_rank0`` and the other object collectives) and :mod:`.layout` (``RankLayout``, this
rank's place in the parallel layout as plain data).
"""

from reco_megatron.parallel.linear_stats import vocab_parallel_linear_stats
from reco_megatron.parallel.vocab_stats import vocab_parallel_stats

__all__ = ["vocab_parallel_linear_stats", "vocab_parallel_stats"]
