"""Benchmark: the weight push of this checkout against another checkout's, side by side.

A change to the push path (its header, checks or transport) must not slow the push. This
times :func:`benchmarks.async_rollout.time_push` (one sender, one receiver over gloo on
loopback, fp32 tensors of 1 MiB in 256 MiB buckets, the receiver's median of 3 pushes) with
the code of two trees: this one and ``--other`` (for example a ``git worktree add --detach
/tmp/before <commit>`` of the commit before the change). Each measurement runs in a fresh
interpreter whose ``PYTHONPATH`` puts that tree first (the printed module path says which
code ran); the trees alternate inside every round, in an order that swaps from one round to
the next, so load on a shared machine hits both alike. The table gives, per size, each tree's
median MiB/s over the rounds with the lowest and highest, and the ratio this / other per round
(median [lowest, highest]). Raw seconds, the load average before every measurement, the
machine and the command go to ``--json``.

Run::

    git worktree add --detach /tmp/before <commit>
    python benchmarks/push_compare.py --other /tmp/before --rounds 3 --push-mib 16 64 256
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.async_rollout import machine, spread  # noqa: E402

_MEASURE = (
    "import json, sys, reco_megatron.rollout.weight_transport as w\n"
    "from benchmarks.async_rollout import time_push\n"
    "print(json.dumps({'module': w.__file__, 'seconds': time_push(int(sys.argv[1]))}))\n"
)


def measure(tree: Path, mib: int, timeout_s: float) -> dict:
    """One :func:`time_push` of ``mib`` MiB with ``tree``'s code, in a fresh interpreter."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    done = subprocess.run(
        [sys.executable, "-c", _MEASURE, str(mib)],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    if done.returncode != 0:
        raise SystemExit(f"push of {mib} MiB with {tree} failed:\n{done.stderr[-2000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if not Path(result["module"]).resolve().is_relative_to(tree.resolve()):
        raise SystemExit(f"{tree}: the push code came from {result['module']}, not that tree")
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--other", type=Path, required=True, help="the other checkout's root")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--push-mib", type=int, nargs="+", default=[16, 64, 256])
    p.add_argument("--timeout-s", type=float, default=900.0, help="bound on one measurement")
    p.add_argument("--json", type=Path, default=ROOT / "docs/results/push_compare.json")
    args = p.parse_args()
    if not (args.other / "reco_megatron/rollout/weight_transport.py").is_file():
        raise SystemExit(f"--other {args.other}: no reco_megatron/rollout/weight_transport.py")
    if args.rounds < 1:
        raise SystemExit(f"--rounds {args.rounds}: give at least 1")
    trees = {"this": ROOT, "other": args.other.resolve()}
    started = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    raw: list[dict] = []
    for r in range(args.rounds):
        order = list(trees) if r % 2 == 0 else list(reversed(trees))
        for mib in args.push_mib:
            for name in order:
                load = os.getloadavg()[0]
                got = measure(trees[name], mib, args.timeout_s)
                raw.append({"round": r, "tree": name, "mib": mib, "load_before": load} | got)
                print(
                    f"round {r + 1} {name} {mib} MiB: {got['seconds']:.3f} s, load {load:.1f}",
                    file=sys.stderr,
                )
    table = {}
    for mib in args.push_mib:
        secs = {t: [x["seconds"] for x in raw if x["tree"] == t and x["mib"] == mib] for t in trees}
        rate = {t: [mib / s for s in v] for t, v in secs.items()}
        ratio = [o / t for t, o in zip(secs["this"], secs["other"], strict=True)]
        table[mib] = {
            "this": spread(rate["this"]),
            "other": spread(rate["other"]),
            "ratio": spread(ratio) | {"rounds": ratio},
        }
    loads = [x["load_before"] for x in raw]
    print(
        f"{args.rounds} round(s), {started}; load average (1 min) {min(loads):.1f}-"
        f"{max(loads):.1f}; this = {ROOT}, other = {trees['other']}\n"
    )
    print(
        "| push MiB | this MiB/s [min, max] | other MiB/s [min, max] "
        "| this / other: median [min, max] |\n|---|---|---|---|"
    )
    for mib, row in table.items():
        t, o, q = row["this"], row["other"], row["ratio"]
        print(
            f"| {mib} | {t['median']:.0f} [{t['min']:.0f}, {t['max']:.0f}] | {o['median']:.0f} "
            f"[{o['min']:.0f}, {o['max']:.0f}] | {q['median']:.2f} [{q['min']:.2f}, "
            f"{q['max']:.2f}] |"
        )
    out = {
        "command": "python benchmarks/push_compare.py " + " ".join(sys.argv[1:]),
        "started": started,
        "machine": machine(),
        "summary": table,
        "raw": raw,
    }
    args.json.write_text(json.dumps(out, indent=1) + "\n", encoding="utf-8")
    print(f"\nraw measurements: {args.json}", file=sys.stderr)


if __name__ == "__main__":
    main()
