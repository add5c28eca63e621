"""Benchmark: fixed vs token-budget micro-batches, with and without data-parallel balancing.

Rollout batches whose response lengths follow a long-tailed distribution: **lognormal,
clipped** (``--median``, ``--sigma``, clipped to ``[16, --max-new]``; prompts uniform in
``[--prompt-min, --prompt-max]``). Three modes run side by side (interleaved rounds, each
mode in its own pair of processes, 2 data-parallel ranks over gloo, one thread each), on the
same global batch and a small Llama-style model:

* ``fixed``: today's split, ``--micro-batch-size`` sequences per micro-batch, every one at its
  rank's longest sequence (each rank pads its own batch, as the trainer does);
* ``budget``: ``update.max_tokens_per_microbatch`` = micro-batch size x longest possible
  sequence (the same bound on a micro-batch's activations), groups stay on their rank;
* ``budget_balanced``: the same, with whole groups balanced over the ranks.

Per mode: the padding fraction of the computed positions (old-policy pass + one update over the
batch), the wall time of the old-policy pass and of one update (the slowest rank's: a step
waits for it), tokens per second (needed positions / time), micro-batches per rank, the most
and fewest positions computed on a rank, and peak RSS. ``time_ratio`` is budget_balanced over
fixed (old-policy pass + one update). A planning-only section (no model, instant) reports the
padding at the 8B example's scale: 128 prompts x 8, prompts uniform in [64, 1024], responses
lognormal (median 600, sigma 0.8) clipped to [16, 3072], DP 4, 4 mini-batches, budget 4096.

Run::

    python benchmarks/token_budget.py                       # markdown table
    python benchmarks/token_budget.py --json token_budget.json --rounds 2
"""

from __future__ import annotations

import argparse
import json
import math
import random
import resource
import statistics
import time

import torch

from reco_megatron.testing import run_distributed

ARCH = dict(
    family="llama",
    num_layers=2,
    hidden_size=128,
    ffn_hidden_size=352,
    num_attention_heads=4,
    num_query_groups=2,
    vocab_size=2048,
    max_position_embeddings=2048,
    make_vocab_size_divisible_by=64,
)
MODES = ("fixed", "budget", "budget_balanced")


def lengths(
    n_groups: int, group: int, args: argparse.Namespace, seed: int = 0
) -> tuple[list[int], list[int]]:
    """Prompt lengths (one per group) and response lengths (one per sequence)."""
    rng = random.Random(seed)
    prompts = [rng.randint(args.prompt_min, args.prompt_max) for _ in range(n_groups)]
    mu = math.log(args.median)
    responses = [
        min(args.max_new, max(16, int(rng.lognormvariate(mu, args.sigma))))
        for _ in range(n_groups * group)
    ]
    return prompts, responses


def rollout_batch(args: argparse.Namespace, vocab: int):
    """The global batch: right-padded to its longest sequence, group-major."""
    from reco_megatron.parallel.batch import RolloutBatch

    g, n = args.group_size, args.groups
    prompts, responses = lengths(n, g, args)
    rows = [prompts[i // g] + responses[i] for i in range(n * g)]
    length = max(rows)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(1, vocab, (n * g, length), generator=gen)
    mask = torch.zeros(n * g, length)
    for i, total in enumerate(rows):
        mask[i, prompts[i // g] : total] = 1.0
        tokens[i, total:] = 0
    return RolloutBatch(
        tokens=tokens,
        response_mask=mask,
        advantages=torch.randn(n * g, generator=gen),
        group_size=g,
        rollout_logprobs=-torch.rand(n * g, length - 1, generator=gen),
    )


def _body(rank: int, world_size: int, mode: str, args: argparse.Namespace) -> dict:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from reco_megatron.algo import LossConfig
    from reco_megatron.megatron.distributed import ParallelConfig, initialize_parallel
    from reco_megatron.megatron.model.config import ModelConfig
    from reco_megatron.megatron.model.optimizer import OptimConfig
    from reco_megatron.megatron.step.config import UpdateConfig
    from reco_megatron.megatron.step.engine import ReCoEngine
    from reco_megatron.megatron.step.microbatching import needed_lengths, round_up, take_rows
    from reco_megatron.parallel.batch import data_parallel_share

    parallel = ParallelConfig(micro_batch_size=args.micro_batch_size)
    initialize_parallel(parallel, seed=0)
    model = ModelConfig(**ARCH)
    budget = round_up(args.micro_batch_size * (args.prompt_max + args.max_new), 16)
    update = UpdateConfig(
        minibatches_per_rollout=1,
        stats_implementation="eager",
        max_tokens_per_microbatch=None if mode == "fixed" else budget,
        balance_data_parallel=mode == "budget_balanced",
    )
    engine = ReCoEngine(
        model,
        parallel,
        LossConfig.preset("reco", kl_coef=0.0),
        OptimConfig(lr=1e-5),
        update,
        total_optimizer_steps=100,
    )
    share = data_parallel_share(
        rollout_batch(args, model.vocab_size), ps.get_data_parallel_rank(), world_size, 1
    )
    # each rank pads its own batch to its longest sequence, rounded up to 8 (the trainer)
    own = round_up(max(needed_lengths(share.loss_mask)), 8)
    share = take_rows(share, range(share.num_sequences), own)
    times: dict[str, list[float]] = {"old": [], "update": []}
    last: dict = {}
    for rep in range(args.reps + 1):
        dist.barrier()
        t0 = time.perf_counter()
        prepared, prep = engine.prepare(share)
        t1 = time.perf_counter()
        step = engine.train_step(prepared)
        t2 = time.perf_counter()
        slowest = torch.tensor([t1 - t0, t2 - t1], dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        if rep == 0:
            continue  # warm-up
        times["old"].append(float(slowest[0]))
        times["update"].append(float(slowest[1]))
        last = {"prep": prep, "step": step}
    rss = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0])
    dist.all_reduce(rss, op=dist.ReduceOp.MAX)
    prep, step = last["prep"], last["step"]
    computed = prep["old_tokens_computed"] + step["tokens_computed"]
    real = prep["old_tokens_real"] + step["tokens_real"]
    return {
        "times": times,
        "pad_frac": 1.0 - real / computed,
        "real_tokens_per_pass": step["tokens_real"],
        "microbatches": step["microbatches"],
        "dp_tokens_max": step["rank_tokens_max"],
        "dp_tokens_min": step["rank_tokens_min"],
        "peak_rss_mib": float(rss),
        "budget": budget,
    }


def scale_planning() -> dict:
    """Padding of the plans alone at the 8B example's scale (no model)."""
    from reco_megatron.megatron.step.microbatching import budget_plan, fixed_plan, round_up

    ns = argparse.Namespace(prompt_min=64, prompt_max=1024, median=600, sigma=0.8, max_new=3072)
    groups, g, dp, minibatches, budget = 128, 8, 4, 4, 4096
    prompts, responses = lengths(groups, g, ns, seed=3)
    needed = [prompts[i // g] + responses[i] - 1 for i in range(groups * g)]
    per_rank = groups * g // dp
    fixed, budget_total = [0, 0], [0, 0]
    for r in range(dp):  # contiguous shares, as without balancing
        rank = needed[r * per_rank : (r + 1) * per_rank]
        passes = [rank] + [
            rank[k * len(rank) // minibatches : (k + 1) * len(rank) // minibatches]
            for k in range(minibatches)
        ]
        for p in passes:
            f = fixed_plan(p, round_up(max(rank), 8), 1)
            b = budget_plan(p, budget, 16)
            fixed = [fixed[0] + f.computed_tokens, fixed[1] + f.real_tokens]
            budget_total = [budget_total[0] + b.computed_tokens, budget_total[1] + b.real_tokens]
    return {
        "distribution": "prompts uniform [64, 1024]; responses lognormal(median 600, sigma 0.8) "
        "clipped to [16, 3072]; 128 prompts x 8, DP 4, 4 mini-batches, budget 4096, multiple 16",
        "pad_frac_fixed": 1 - fixed[1] / fixed[0],
        "pad_frac_budget": 1 - budget_total[1] / budget_total[0],
        "mean_response": statistics.mean(responses),
        "truncated_frac": sum(r == 3072 for r in responses) / len(responses),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--groups", type=int, default=8, help="prompts per step (global)")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--prompt-min", type=int, default=32)
    parser.add_argument("--prompt-max", type=int, default=128)
    parser.add_argument("--median", type=float, default=96.0, help="median response length")
    parser.add_argument("--sigma", type=float, default=1.0, help="lognormal sigma")
    parser.add_argument("--max-new", type=int, default=1024, help="response length clip")
    parser.add_argument(
        "--micro-batch-size", type=int, default=1, help="fixed split (1: the 7B/8B/70B examples)"
    )
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds per mode")
    parser.add_argument("--reps", type=int, default=2, help="timed reps per round")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    results: dict[str, list[dict]] = {m: [] for m in MODES}
    for _ in range(args.rounds):
        for mode in MODES:
            out = run_distributed(_body, 2, args=(mode, args), timeout=3000)[0]
            results[mode].append(out)
    table = {}
    for mode, runs in results.items():
        old = statistics.median(t for r in runs for t in r["times"]["old"])
        upd = statistics.median(t for r in runs for t in r["times"]["update"])
        r = runs[-1]
        table[mode] = {
            "pad_frac": r["pad_frac"],
            "time_old_s": old,
            "time_update_s": upd,
            "tokens_per_s_old": r["real_tokens_per_pass"] / old,
            "tokens_per_s_update": r["real_tokens_per_pass"] / upd,
            "microbatches_per_rank": r["microbatches"],
            "dp_tokens_max": r["dp_tokens_max"],
            "dp_tokens_min": r["dp_tokens_min"],
            "peak_rss_mib": max(x["peak_rss_mib"] for x in runs),
        }
    total = {m: table[m]["time_old_s"] + table[m]["time_update_s"] for m in MODES}
    summary = {
        "distribution": f"prompts uniform [{args.prompt_min}, {args.prompt_max}]; responses "
        f"lognormal(median {args.median:g}, sigma {args.sigma:g}) clipped to [16, "
        f"{args.max_new}]; {args.groups} prompts x {args.group_size}, DP 2, budget "
        f"{results['budget'][0]['budget']} tokens vs {args.micro_batch_size} sequences per "
        "micro-batch",
        "model": ARCH,
        "modes": table,
        "pad_frac_fixed": table["fixed"]["pad_frac"],
        "pad_frac_budget": table["budget_balanced"]["pad_frac"],
        "time_ratio": total["budget_balanced"] / total["fixed"],
        "time_ratio_unbalanced": total["budget"] / total["fixed"],
        "scale_planning": scale_planning(),
        "command": "python benchmarks/token_budget.py "
        + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "json"),
    }
    print(f"distribution: {summary['distribution']}")
    print(
        "| mode | pad frac | old-policy s | update s | tok/s old | tok/s update "
        "| micro-batches/rank | rank tokens max / min | peak RSS MiB |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for mode, t in table.items():
        print(
            f"| {mode} | {t['pad_frac']:.3f} | {t['time_old_s']:.2f} | {t['time_update_s']:.2f} "
            f"| {t['tokens_per_s_old']:.0f} | {t['tokens_per_s_update']:.0f} "
            f"| {t['microbatches_per_rank']:.0f} | {t['dp_tokens_max']:.0f} / "
            f"{t['dp_tokens_min']:.0f} | {t['peak_rss_mib']:.0f} |"
        )
    print(
        f"time_ratio (budget_balanced / fixed, old-policy + update): {summary['time_ratio']:.3f}; "
        f"unbalanced: {summary['time_ratio_unbalanced']:.3f}"
    )
    s = summary["scale_planning"]
    print(
        f"8B-example scale (planning only): pad_frac fixed {s['pad_frac_fixed']:.3f}, "
        f"budget {s['pad_frac_budget']:.3f} ({s['distribution']})"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
