"""The memory estimate's static part against what megatron-core allocates, per rank.

For each layout of :data:`reco_megatron.trainer.memory.EXAMPLES` (or a config given on the
command line) and each pipeline stage, :func:`compare` builds that rank with megatron-core on
the meta device (:func:`reco_megatron.megatron.memory.census.measure_rank_state`: real model
chunks, DDP gradient buffers, distributed-optimizer shards and Adam state, nothing allocated)
and sets its weight, gradient and optimizer bytes beside
:func:`reco_megatron.megatron.memory.estimate.stage_state`'s estimate::

    python -m reco_megatron.trainer.memory_check                     # the examples' layouts
    python -m reco_megatron.trainer.memory_check my.yaml --dp 8     # a layout of your own
    python -m reco_megatron.trainer.memory_check my.yaml parallel.pipeline_model_parallel_size=2
    python -m reco_megatron.trainer.memory_check --json             # machine-readable

It exits 1 when any item differs by more than :data:`TOLERANCE`. Runs on a CPU in seconds
(after megatron-core's import) for any model size, in a process of its own (it starts a fake
process group). Activation memory is not part of it: that term stays an estimate.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass

from reco_megatron.megatron import GIB, ModelState, stage_state
from reco_megatron.trainer.memory import EXAMPLES

TOLERANCE = 0.02
"""Largest relative difference between measured and estimated bytes that passes."""


@dataclass(frozen=True)
class StageCheck:
    """One rank (TP rank 0, DP rank 0) of one pipeline stage of one layout."""

    layout: str
    stage: int
    measured: ModelState
    estimate: ModelState

    @property
    def worst(self) -> float:
        """The largest relative difference over weights, gradients and optimizer state."""
        return max(
            abs(getattr(self.estimate, k) - getattr(self.measured, k))
            / max(getattr(self.measured, k), 1)
            for k in ("weights", "grads", "optimizer")
        )


def compare(layouts: list[tuple[str, str, int]], overrides: list[str] = ()) -> list[StageCheck]:
    """``(label, config path, DP size)`` per layout (each with the dotted ``overrides``) ->
    one :class:`StageCheck` per pipeline stage."""
    from reco_megatron.config import load_config
    from reco_megatron.megatron import measure_rank_state
    from reco_megatron.trainer.config import TrainConfig

    out = []
    for label, path, dp in layouts:
        cfg = load_config(TrainConfig, path, list(overrides))
        for stage in range(cfg.parallel.pipeline_model_parallel_size):
            got = measure_rank_state(
                cfg.model, cfg.parallel, cfg.optimizer, data_parallel_size=dp, pipeline_stage=stage
            )
            want = stage_state(
                cfg.model,
                cfg.parallel,
                data_parallel_size=dp,
                stage=stage,
                distributed_optimizer=cfg.optimizer.use_distributed_optimizer,
            )
            measured = ModelState(weights=got.weights, grads=got.grads, optimizer=got.optimizer)
            out.append(StageCheck(label, stage, measured, want))
    return out


def table(checks: list[StageCheck]) -> str:
    """Markdown: GiB per rank, measured / estimated, and the largest relative difference."""
    lines = [
        "| layout | stage | weights | fp32 grads | optimizer | largest difference |",
        "|---|---|---|---|---|---|",
    ]
    for c in checks:
        cells = [
            f"{getattr(c.measured, k) / GIB:.3f} / {getattr(c.estimate, k) / GIB:.3f}"
            for k in ("weights", "grads", "optimizer")
        ]
        lines.append(f"| {c.layout} | {c.stage} | {' | '.join(cells)} | {c.worst:.2e} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config", nargs="?", help="a training config (default: the examples)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. model.num_layers=8")
    parser.add_argument("--dp", type=int, default=1, help="data-parallel size for CONFIG")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)
    layouts = [(args.config, args.config, args.dp)] if args.config else list(EXAMPLES)
    if args.overrides and not args.config:
        parser.error("overrides need a CONFIG")
    checks = compare(layouts, args.overrides)
    if args.json:
        rows = [{**asdict(c), "worst": c.worst} for c in checks]
        sys.stdout.write(json.dumps(rows, indent=1) + "\n")
    else:
        sys.stdout.write(table(checks) + "\n")
    bad = [c for c in checks if c.worst > TOLERANCE]
    for c in bad:
        sys.stderr.write(
            f"{c.layout} stage {c.stage}: the estimate is off by {c.worst:.1%} "
            f"(> {TOLERANCE:.0%}): update megatron/memory/estimate.py's stage_state\n"
        )
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
