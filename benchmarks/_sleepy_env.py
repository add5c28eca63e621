"""The environment of ``benchmarks/env_overlap.py``: a tool that sleeps a lognormal time.

Kept free of heavy imports: environment workers import it under an address-space limit."""

from __future__ import annotations

import math
import random
import time

from reco_megatron.envs import Env, Step

MEDIAN_S = 0.05
"""Median sleep of one tool call (seconds)."""
SIGMA = 1.0
"""Lognormal shape: the mean is ``MEDIAN_S * exp(SIGMA**2 / 2)``, the tail long."""


class SleepyTool(Env):
    """Three tool calls per episode, each sleeping ``lognormal(log MEDIAN_S, SIGMA)`` seconds
    drawn from a generator seeded by the prompt, so both arms of the benchmark wait alike."""

    def reset(self, row):
        self.rng = random.Random(hash(tuple(row["prompt_ids"])) ^ int(row["answer"]))
        self.calls = 0
        return list(row["prompt_ids"])

    def step(self, action_ids, finish):
        self.calls += 1
        time.sleep(self.rng.lognormvariate(math.log(MEDIAN_S), SIGMA))
        return Step([7, 8, 9], done=self.calls >= 3)
