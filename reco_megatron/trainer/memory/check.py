"""The memory estimate's static part against what megatron-core allocates, per rank.

For each layout of :data:`reco_megatron.trainer.memory.budget.EXAMPLES` (or a config given on the
command line) and each pipeline stage, :func:`~reco_megatron.trainer.memory.budget.compare` builds
that rank with megatron-core on the meta device (the adapter's memory census: real model
chunks, DDP gradient buffers, distributed-optimizer shards and Adam state, nothing allocated)
and sets its weight, gradient and optimizer bytes beside the memory estimate's
``stage_state``::

    python -m reco_megatron.trainer.memory.check                     # the examples' layouts
    python -m reco_megatron.trainer.memory.check my.yaml --dp 8     # a layout of your own
    python -m reco_megatron.trainer.memory.check my.yaml parallel.pipeline_model_parallel_size=2
    python -m reco_megatron.trainer.memory.check --json             # machine-readable

It exits 1 when any item differs by more than :data:`TOLERANCE`. Runs on a CPU in seconds
(after megatron-core's import) for any model size, in a process of its own (it starts a fake
process group). Activation memory is not part of it: that term stays an estimate.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

from reco_megatron.trainer.memory.budget import EXAMPLES, TOLERANCE, compare, table

__all__ = ["TOLERANCE", "compare", "main", "table"]


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
