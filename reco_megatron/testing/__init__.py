"""Helpers for running code on several local CPU ranks (tests, benchmarks, debugging)."""

from reco_megatron.testing.multiprocess import DistributedRunError, run_distributed

__all__ = ["DistributedRunError", "run_distributed"]
