"""The mechanism experiment: does ReCo keep more of K equally valid answers than GRPO, and
which part does it? One command, resumable, on CPU::

    python examples/mechanism/run.py                  # full protocol -> docs/results/mechanism.md
    python examples/mechanism/run.py --smoke --out /tmp/mech   # 2 seeds, tiny budget (tests)

Per seed: a task (``task.Task``: every prompt has 4..8 valid answers), one SFT start on a
skewed mix, then every method of ``rl.METHODS`` from that start with the same prompts, budget,
clip and sampler seeds. Raw curves go to ``<out>/raw/<method>-s<seed>.json`` (a finished run
is never redone), the report (tables with 95 % bootstrap intervals over seeds, paired
sign-flip tests against GRPO) and a PNG to ``docs/results/mechanism.md`` (``--results``). Text
from a ``## Discussion`` heading on in an existing report is kept.
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

from report import write_report  # noqa: E402
from rl import METHODS, RunSpec, run_one  # noqa: E402
from sweep import activity  # noqa: E402
from task import Task, TaskSpec, make_policy, sft, token_pool, valid_stats  # noqa: E402

SWEEP_LENGTHS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 1024, 4096]


def _write_json(path: Path, obj: object) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj))
    tmp.replace(path)  # atomic: an interrupted run never leaves a half-written result


def start_state(out: Path, spec: TaskSpec, seed: int, sft_steps: int) -> dict:
    """The SFT start of ``seed`` (cached in ``<out>/start``) and its token pool."""
    path = out / "start" / f"s{seed}.pt"
    if path.exists():
        return torch.load(path)
    task = Task(spec, seed)
    torch.manual_seed(seed)
    policy = make_policy(spec)
    nll = sft(policy, task, sft_steps, seed)
    saved = {
        "state": policy.state_dict(),
        "nll": nll,
        "stats": valid_stats(policy, task, 16),
        "pool": token_pool(policy, 8, seed),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(saved, path.with_suffix(".tmp"))
    path.with_suffix(".tmp").replace(path)
    return saved


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path("runs/mechanism"))
    p.add_argument("--results", type=Path, default=None, help="default docs/results/mechanism.md")
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    p.add_argument("--seeds", type=int, default=16, help="seeds 1..N")
    p.add_argument("--sft-steps", type=int, default=800)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--minibatches", type=int, default=2, help="optimizer steps per rollout")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--smoke", action="store_true", help="2 seeds, tiny budget (tests)")
    args = p.parse_args(argv)
    if args.smoke:
        args.seeds, args.sft_steps, args.steps = 2, 20, 6
    torch.set_num_threads(args.threads)
    spec = TaskSpec()
    run = RunSpec(
        steps=args.steps,
        lr=args.lr,
        minibatches=args.minibatches,
        eval_every=2 if args.smoke else 10,
    )
    out = args.out.resolve()
    (out / "raw").mkdir(parents=True, exist_ok=True)
    (out / "pools").mkdir(parents=True, exist_ok=True)
    timing_path = out / "timings.json"
    timings = json.loads(timing_path.read_text()) if timing_path.exists() else {}
    seeds = list(range(1, args.seeds + 1))

    starts = {}
    for seed in seeds:
        t0 = time.perf_counter()
        starts[seed] = start_state(out, spec, seed, args.sft_steps)
        timings["sft"] = timings.get("sft", 0.0) + time.perf_counter() - t0
    for seed in seeds:
        for method in args.methods:
            path = out / "raw" / f"{method}-s{seed}.json"
            if path.exists():
                continue
            t0 = time.perf_counter()
            result = run_one(method, seed, spec, run, starts[seed]["state"])
            torch.save(torch.tensor(result.pop("pool")), out / "pools" / f"{method}-s{seed}.pt")
            _write_json(path, result)
            timings["rl"] = timings.get("rl", 0.0) + time.perf_counter() - t0
            print(f"{method} seed {seed}: {time.perf_counter() - t0:.1f} s", flush=True)
            _write_json(timing_path, timings)

    t0 = time.perf_counter()
    sweep = {}
    for label, files in (
        ("SFT start", [out / "start" / f"s{s}.pt" for s in seeds]),
        *(
            (f"after {m}", [out / "pools" / f"{m}-s{s}.pt" for s in seeds])
            for m in ("grpo", "reco")
            if m in args.methods
        ),
    ):
        pools = [torch.load(f)["pool"] if "start" in f.parts else torch.load(f) for f in files]
        lengths = SWEEP_LENGTHS[:5] if args.smoke else SWEEP_LENGTHS
        sweep[label] = activity(torch.cat(pools), lengths, groups=50 if args.smoke else 200)
    timings["sweep"] = time.perf_counter() - t0
    _write_json(timing_path, timings)

    results = [
        json.loads((out / "raw" / f"{m}-s{s}.json").read_text())
        for m in args.methods
        for s in seeds
    ]
    _write_json(out / "sweep.json", sweep)
    default = out / "mechanism.md" if args.smoke else ROOT / "docs" / "results" / "mechanism.md"
    write_report(
        args.results or default,
        results,
        sweep,
        {
            "spec": dataclasses.asdict(spec),
            "run": dataclasses.asdict(run),
            "seeds": seeds,
            "sft_steps": args.sft_steps,
            "start": {s: starts[s]["stats"] for s in seeds},
            "timings": timings,
            "command": " ".join(sys.argv[1:]) if argv is None else " ".join(argv),
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
