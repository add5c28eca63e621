"""The mechanism experiment at length: which response weights stop acting as the answer
length L grows, and which keep valid answers alive. Resumable across sessions, on CPU::

    python examples/mechanism/length.py                      # L in 4 16 64 256, 16 seeds
    python examples/mechanism/length.py --lengths 4 --seeds 2 --steps 4 --sft-steps 10 \\
        --units /tmp/units --results /tmp/length.md          # smoke

Per length L and seed: a tree task (``TaskSpec(tree=True)``: each prompt's 4..8 valid answers
are 4 choices at the starts of L/4-token segments followed by free filler tokens, and share
openings), one SFT start of the segment policy
(cached in ``--out``), then every method of :data:`METHODS` from it with the same prompts,
budget, clip and sampler seeds. Each finished (L, method, seed) unit is a small JSON file under
``--units`` (committed to the repository: a unit on disk is never redone, so the same command
continues an interrupted run in a later session); ``--stop-after`` minutes stops starting new
units. The report (``--results``) is written from the units on disk at the end of every call
(``--report-only``: only that).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path[:0] = [str(HERE), str(ROOT)]

from length_report import write_length_report  # noqa: E402
from rl import RunSpec, run_one  # noqa: E402
from task import Task, TaskSpec, make_policy, sft, valid_stats  # noqa: E402

METHODS = ("grpo", "reco", "reco_prefix", "reco_prefix_empirical", "reco_geometric",
           "reco_empirical")  # fmt: skip
"""GRPO, ReCo with its ``sequence`` weight, and ReCo with each other weight (``rl.py``)."""


def _write_json(path: Path, obj: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj, indent=0))
    tmp.replace(path)  # atomic: an interrupted run never leaves a half-written unit


def start_state(out: Path, spec: TaskSpec, seed: int, steps: int, batch: int) -> dict:
    """The SFT start of (L, seed), cached in ``out`` (recomputed identically when missing)."""
    path = out / f"L{spec.length}" / f"start-s{seed}.pt"
    if path.exists():
        return torch.load(path)
    task = Task(spec, seed)
    torch.manual_seed(seed)
    policy = make_policy(spec)
    nll = sft(policy, task, steps, seed, batch=batch)
    saved = {"state": policy.state_dict(), "nll": nll, "stats": valid_stats(policy, task, 16)}
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(saved, path.with_suffix(".tmp"))
    path.with_suffix(".tmp").replace(path)
    return saved


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[4, 16, 64, 256])
    p.add_argument("--seeds", type=int, default=16, help="seeds 1..N")
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    p.add_argument("--sft-steps", type=int, default=400)
    p.add_argument("--sft-batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=100, help="rollout batches per RL run")
    p.add_argument("--eval-every", type=int, default=20)
    p.add_argument("--out", type=Path, default=Path("runs/mechanism_length"), help="SFT cache")
    p.add_argument("--units", type=Path, default=ROOT / "docs/results/mechanism_length")
    p.add_argument("--results", type=Path, default=ROOT / "docs/results/mechanism_length.md")
    p.add_argument("--stop-after", type=float, default=None, help="minutes; then report")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--report-only", action="store_true", help="only rewrite the report")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    run = RunSpec(steps=args.steps, eval_every=args.eval_every)
    seeds = list(range(1, args.seeds + 1))
    # seed-major: every length gains seeds at the same pace, so an interrupted run reports
    # all lengths on the same (fewer) seeds
    for seed in [] if args.report_only else seeds:
        if args.stop_after is not None and time.perf_counter() - t_start > 60 * args.stop_after:
            break
        for length in args.lengths:
            spec = TaskSpec(length=length, tree=True)
            todo = [
                m for m in args.methods if not (args.units / f"L{length}/{m}-s{seed}.json").exists()
            ]
            if not todo:
                continue
            t0 = time.perf_counter()
            start = start_state(args.out.resolve(), spec, seed, args.sft_steps, args.sft_batch)
            t_sft = time.perf_counter() - t0
            for method in todo:
                t0 = time.perf_counter()
                result = run_one(method, seed, spec, run, start["state"])
                result.pop("pool")
                result.update(length=length, start=start["stats"], sft_s=t_sft,
                              rl_s=time.perf_counter() - t0)  # fmt: skip
                _write_json(args.units / f"L{length}/{method}-s{seed}.json", result)
                print(f"L={length} {method} seed {seed}: {result['rl_s']:.1f} s", flush=True)
                t_sft = 0.0
    info = {
        "spec": dataclasses.asdict(TaskSpec(tree=True)),
        "run": dataclasses.asdict(run),
        "sft_steps": args.sft_steps,
        "sft_batch": args.sft_batch,
        "lengths": args.lengths,
        "seeds": seeds,
        "methods": args.methods,
        # the command that makes the units (and continues them); --report-only is left out
        "command": " ".join(
            a for a in (sys.argv[1:] if argv is None else argv) if a != "--report-only"
        ),
    }
    write_length_report(args.results, args.units, info)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
