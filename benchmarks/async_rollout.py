"""Benchmark: colocated vs separate rollouts at staleness 0, 1 and 2, and the weight push.

Part 1 trains the tiny example (``examples/tiny_cpu.yaml``, no warm-up, a reward with signal
from the first step) for ``--steps`` RL steps in four modes, interleaved over ``--rounds``
rounds so load on the machine hits all of them alike:

* ``colocated``: generate, then train, on the trainer's process;
* ``separate K=0`` / ``K=1`` / ``K=2``: the trainer plus one worker process
  (``rollout.placement=separate``, ``rollout.max_staleness=K``, ``loss.tis_cap=2``).

Responses are long-tailed: the untrained model stops at its end-of-sequence token with a
probability of about 1/vocabulary per token, so lengths are geometric, clipped at
``--max-new``, and a batch decodes until its longest row ends (the median and maximum of the
steps' mean response length are printed; this is not the lognormal of ``token_budget.py``,
which shapes synthetic batches: here the lengths come from real generation). Colocated gets
both cores (2 threads); separate gives the trainer and the worker one thread each.

Per mode: response tokens trained per second (the median over steps after the first two,
which include start-up), the trainer's wait for groups and the workers' idle time per step,
the staleness histogram and the peak RSS of the trainer process. ``speedup`` is tokens per
second over colocated's *in the same round*; the table gives its median over the rounds and
the lowest and highest round.

**Load-sensitive.** The separate modes run two processes of one thread each, colocated one
of two threads: how a shared machine schedules them decides the ratio (a rerun on a machine
loaded by other work gave 0.62 / 0.82 / 1.04x where an earlier one gave 1.15 / 1.35 / 1.59x).
The load average is recorded before every run, and every measurement is stored with the
machine and the command (``--json``, default ``docs/results/async_rollout.json``): compare
ratios from one run, and read them with the load beside them.

Part 2 times the push alone: one sender and one receiver over gloo (two processes), a plan
of ``--push-mib`` MiB of fp32 tensors in 256 MiB buckets, the median of 3 pushes per size.

Run::

    python benchmarks/async_rollout.py                 # markdown tables + the raw JSON
    python benchmarks/async_rollout.py --json /tmp/async_rollout.json --rounds 4 --steps 12
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import multiprocessing as mp
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TINY = [
    "model.num_layers=2", "model.hidden_size=64", "model.ffn_hidden_size=128",
    "model.num_attention_heads=4", "model.num_query_groups=2", "rollout.group_size=4",
    "rollout.prompts_per_step=8", "parallel.micro_batch_size=8", "data.countdown.n_train=64",
    "data.countdown.n_eval=8", "trainer.progress=false", "trainer.loggers=[]", "sft.steps=0",
    "checkpoint.save_interval=0", "reward.reward=tests.trainer._dense_reward:digit_share",
]  # fmt: skip
MODES = {
    "colocated": [],
    "separate K=0": ["rollout.placement=separate", "rollout.max_staleness=0"],
    "separate K=1": ["rollout.placement=separate", "rollout.max_staleness=1", "loss.tis_cap=2"],
    "separate K=2": ["rollout.placement=separate", "rollout.max_staleness=2", "loss.tis_cap=2"],
}


def run_mode(extra: list[str], steps: int, max_new: int, out: Path) -> dict:
    """One training run; its per-step rows and the trainer's peak RSS (MiB)."""
    cmd = [
        sys.executable, "-c",
        "import resource, sys; from reco_megatron.train import main; code = main(sys.argv[1:]); "
        "print('PEAK_RSS_KB', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss); "
        "sys.exit(code)",
        "examples/tiny_cpu.yaml", *TINY, f"rollout.max_new_tokens={max_new}",
        f"model.max_position_embeddings={max_new + 128}", f"trainer.max_steps={steps}",
        f"trainer.output_dir={out}", *extra,
    ]  # fmt: skip
    threads = "1" if extra else "2"  # separate: trainer and worker, one core each
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": threads}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"{extra}: exit {done.returncode}\n{done.stderr[-3000:]}")
    rss = [int(x.split()[1]) for x in done.stdout.splitlines() if x.startswith("PEAK_RSS_KB")]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {"rows": rows, "peak_rss_mib": rss[0] / 1024 if rss else float("nan")}


RAW_KEYS = (
    "step", "tokens_per_s", "trainer_wait_s", "worker_idle_s", "staleness_max",
    "response_len_mean", "time_rollout", "time_train", "weight_push_s",
)  # fmt: skip
"""The per-step values the raw JSON keeps of each run's metrics rows."""


def machine() -> dict:
    """What the numbers were measured on."""
    model = "unknown"
    with open("/proc/cpuinfo", encoding="utf-8") as f:
        for line in f:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    import torch

    return {
        "cpu": model,
        "cores": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }


def spread(values: list[float]) -> dict:
    """Median, lowest and highest of per-round values."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarise(runs: list[dict]) -> dict:
    rows = [r for run in runs for r in run["rows"][2:]]
    every = [r for run in runs for r in run["rows"]]
    ages = collections.Counter(int(r.get("staleness_max", 0)) for r in every)
    return {
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in rows),
        "trainer_wait_s": statistics.median(
            r.get("trainer_wait_s", r["time_rollout"]) for r in rows
        ),
        "worker_idle_s": statistics.median(r.get("worker_idle_s", 0.0) for r in rows),
        "response_len_mean": statistics.mean(r["response_len_mean"] for r in every),
        "staleness_histogram": dict(sorted(ages.items())),
        "peak_rss_mib": max(run["peak_rss_mib"] for run in runs),
    }


# ---------------------------------------------------------------------------- the push alone
def _push_member(rank: int, port: int, mib: int, reps: int, out: mp.Queue) -> None:
    import torch
    import torch.distributed as dist

    from reco_megatron.rollout.weight_transport import (
        PushPlan,
        TensorSpec,
        receive_push,
        send_push,
        weight_group,
    )

    numel = 2**20 // 4  # 1 MiB of fp32 per tensor
    plan = PushPlan(
        tuple(TensorSpec(f"t{i}", (numel,), "float32", 0) for i in range(mib)), 1, 256 * 2**20
    )
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=120))
    group = weight_group(store, "push", rank, 2, backend="gloo", timeout_s=120)
    tensors = [(s.name, torch.randn(numel)) for s in plan.tensors]
    times = []
    for v in range(reps):
        start = time.perf_counter()
        if rank == 0:
            send_push([(group, 1)], plan, 0, v, tensors, torch.device("cpu"))
        else:
            for _ in receive_push(group, plan, 1, v, torch.device("cpu")):
                pass
        times.append(time.perf_counter() - start)
    out.put((rank, statistics.median(times)))


def time_push(mib: int, reps: int = 3) -> float:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_push_member, args=(r, port, mib, reps, out)) for r in (0, 1)]
    for p in procs:
        p.start()
    got = dict(out.get(timeout=600) for _ in procs)
    for p in procs:
        p.join(timeout=30)
    return got[1]  # the receiver's time: until the last byte arrived


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-new", type=int, default=96)
    p.add_argument("--push-mib", type=int, nargs="+", default=[1, 16, 64, 256])
    p.add_argument("--json", type=Path, default=ROOT / "docs/results/async_rollout.json")
    args = p.parse_args()
    started = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    with tempfile.TemporaryDirectory(prefix="async_rollout_") as tmp:
        for r in range(args.rounds):
            for mode, extra in MODES.items():
                out = Path(tmp) / f"{mode.replace(' ', '_').replace('=', '')}-{r}"
                load = os.getloadavg()
                run = run_mode(extra, args.steps, args.max_new, out)
                run.update(round=r, load_before=load, load_after=os.getloadavg())
                runs[mode].append(run)
                print(f"round {r + 1}/{args.rounds} {mode}: load {load[0]:.1f}", file=sys.stderr)
    table = {m: summarise(v) for m, v in runs.items()}
    for mode, row in table.items():  # per round: against that round's colocated run
        per_round = [
            summarise([mine])["tokens_per_s"] / summarise([ref])["tokens_per_s"]
            for mine, ref in zip(runs[mode], runs["colocated"], strict=True)
        ]
        row["speedup"] = spread(per_round) | {"rounds": per_round}
    lengths = [row["response_len_mean"] for run in runs["colocated"] for row in run["rows"]]
    loads = [run["load_before"][0] for v in runs.values() for run in v]
    push = {mib: time_push(mib) for mib in args.push_mib}
    print(
        f"{args.rounds} round(s) x {args.steps} steps per mode, {started}; load average (1 min) "
        f"before the runs: {min(loads):.1f}-{max(loads):.1f}; step mean response length: "
        f"median {statistics.median(lengths):.1f}, max {max(lengths):.1f} of "
        f"{args.max_new} tokens\n"
    )
    print(
        "| mode | tokens/s | speedup: median [lowest, highest round] | trainer wait s "
        "| worker idle s | staleness (steps) | peak RSS MiB |"
    )
    print("|---|---|---|---|---|---|---|")
    for mode, row in table.items():
        hist = ", ".join(f"{k}: {v}" for k, v in row["staleness_histogram"].items())
        sp = row["speedup"]
        print(
            f"| {mode} | {row['tokens_per_s']:.0f} | {sp['median']:.2f} [{sp['min']:.2f}, "
            f"{sp['max']:.2f}] | {row['trainer_wait_s']:.2f} | {row['worker_idle_s']:.2f} | "
            f"{hist} | {row['peak_rss_mib']:.0f} |"
        )
    print("\n| push MiB | seconds | MiB/s |\n|---|---|---|")
    for mib, sec in push.items():
        print(f"| {mib} | {sec:.3f} | {mib / sec:.0f} |")
    raw = {
        "command": "python benchmarks/async_rollout.py " + " ".join(sys.argv[1:]),
        "started": started,
        "machine": machine(),
        "summary": table,
        "push_s": push,
        "runs": {
            mode: [
                {
                    "round": run["round"],
                    "load_before": run["load_before"],
                    "load_after": run["load_after"],
                    "peak_rss_mib": run["peak_rss_mib"],
                    "rows": [{k: row.get(k) for k in RAW_KEYS} for row in run["rows"]],
                }
                for run in v
            ]
            for mode, v in runs.items()
        },
    }
    args.json.write_text(json.dumps(raw, indent=1) + "\n", encoding="utf-8")
    print(f"\nraw measurements: {args.json}", file=sys.stderr)


if __name__ == "__main__":
    main()
