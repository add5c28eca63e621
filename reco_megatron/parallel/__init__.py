"""Vocabulary-parallel autograd ops; the tensor-parallel group is always passed explicitly."""

from reco_megatron.parallel.linear_stats import vocab_parallel_linear_stats
from reco_megatron.parallel.vocab_stats import vocab_parallel_stats

__all__ = ["vocab_parallel_linear_stats", "vocab_parallel_stats"]
