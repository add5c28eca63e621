"""The staleness experiment (``run.py --experiment staleness``): does training on groups of
older weights (separate placement, ``rollout.max_staleness`` K) cost ReCo its coverage or its
stability, and does the response weight need the behaviour policy mu?

The short countdown task (as ``docs/results/coverage.md``), GRPO and ReCo at K = 0 and K = 2,
ReCo at K = 2 once with its response weight on mu (the default, ``auto``) and once on pi_old.
Every method uses the truncated importance weight min(pi_old / mu, 2), so the K = 0 and K = 2
runs differ only in the staleness. K = 0 runs colocated, which equals separate placement at
K = 0 bit for bit (``tests/trainer/test_separate_placement.py``) and needs no worker process.
The units (one JSON per (method, seed)) go to ``docs/results/coverage_staleness/``, so the
experiment continues across sessions like the long one (:mod:`long_units`).
"""

from __future__ import annotations

from long_units import METHODS_LONG

_GRPO, _RECO = METHODS_LONG["grpo"], METHODS_LONG["reco"]  # GRPO and ReCo as shipped
_TIS = ["loss.tis_cap=2.0"]
_STALE = ["rollout.placement=separate", "rollout.max_staleness=2"]

METHODS_STALE: dict[str, list[str]] = {
    "grpo_k0": [*_GRPO, *_TIS],
    "grpo_k2": [*_GRPO, *_TIS, *_STALE],
    "reco_k0": [*_RECO, *_TIS],
    "reco_k2": [*_RECO, *_TIS, *_STALE],
    "reco_k2_proximal": [*_RECO, *_TIS, *_STALE, "loss.response_weight_policy=proximal"],
}

NOTES = {
    "grpo_k0": "GRPO, groups of the current weights",
    "grpo_k2": "GRPO, groups up to 2 steps old (separate placement, one worker)",
    "reco_k0": "ReCo as shipped, groups of the current weights",
    "reco_k2": "ReCo, groups up to 2 steps old, response weight on the behaviour policy mu",
    "reco_k2_proximal": "ReCo, groups up to 2 steps old, response weight on pi_old",
}
