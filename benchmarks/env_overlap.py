"""Benchmark: episodes per second with a slow tool, tool calls overlapped or one at a time.

Multi-turn episodes (``reco_megatron.envs``) whose tool sleeps a lognormal time
(``benchmarks/_sleepy_env.py``: median 50 ms, sigma 1, three calls per episode). The engine is
a stand-in that answers each call with six tokens ending on a stop token after
``--decode-ms`` (20 ms: a decoding call's time), so what is measured is the episode runner and
the isolated workers. Three arms, alternating over ``--reps``: ``rollout.env_workers=1``
(every tool call waits for the one before), ``--workers`` workers turn by turn (the calls of
a turn overlap, the next turn waits for the slowest), and ``--workers`` workers overlapped
(an episode acts again as soon as its own call is back; the default). All arms draw the same
sleeps (seeded by the prompt). Reported: median episodes per second of each arm, the
speed-ups, and each rep's seconds; nothing asserts on time.

Run::

    python benchmarks/env_overlap.py                 # 8 prompts x 4 episodes, 3 reps
    python benchmarks/env_overlap.py --prompts 16 --workers 16
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from reco_megatron.envs import EnvPool, run_episodes
from reco_megatron.rollout import Completion, SamplingParams

SPEC = f"{Path(__file__).with_name('_sleepy_env.py')}:SleepyTool"
STOP = 9


DECODE_S = [0.02]


def instant_engine(prompts, n, params):
    """Six tokens per action, the last a stop token, after ``DECODE_S`` seconds per call."""
    time.sleep(DECODE_S[0])
    return [
        [
            Completion(
                prompt_index=i,
                sample_index=j,
                token_ids=[20, 21, 22, 23, 24, STOP],
                logprobs=[-1.0] * 6,
                finish_reason="stop",
            )
            for j in range(n)
        ]
        for i in range(len(prompts))
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--decode-ms", type=float, default=20.0)
    args = ap.parse_args()
    DECODE_S[0] = args.decode_ms / 1000
    rows = [
        {"prompt": "", "answer": str(i), "prompt_ids": [3 + i % 100, 17, 5]}
        for i in range(args.prompts)
    ]
    params = [
        SamplingParams(max_new_tokens=64, seed=i, stop_token_ids=(STOP,)) for i in range(len(rows))
    ]
    pools = {w: EnvPool(SPEC, num_workers=w, step_timeout_s=60) for w in (1, args.workers)}
    arms = {"1 worker": (1, False), f"{args.workers} turn by turn": (args.workers, False)}
    arms[f"{args.workers} overlapped"] = (args.workers, True)
    times: dict[str, list[float]] = {a: [] for a in arms}
    first = 0
    try:
        for _ in range(args.reps):
            for arm, (w, overlap) in arms.items():
                start = time.perf_counter()
                got = run_episodes(
                    instant_engine, pools[w], rows, args.group, params,
                    max_turns=3, first_id=first, overlap=overlap,
                )  # fmt: skip
                times[arm].append(time.perf_counter() - start)
                first += args.prompts * args.group
                assert got.metrics["env_failed_sum"] == 0
                assert got.metrics["env_turns_sum"] == 3 * args.prompts * args.group
    finally:
        for pool in pools.values():
            pool.close()
    episodes = args.prompts * args.group
    rate = {a: episodes / statistics.median(t) for a, t in times.items()}
    print(
        f"{episodes} episodes x 3 tool calls (median sleep 50 ms, sigma 1), "
        f"{args.decode_ms:g} ms per engine call, {args.reps} reps"
    )
    base = rate["1 worker"]
    for arm in arms:
        spread = ", ".join(f"{t:.2f}" for t in times[arm])
        print(
            f"  {arm:<18} {rate[arm]:7.2f} episodes/s  {rate[arm] / base:5.2f}x  "
            f"(seconds per rep: {spread})"
        )


if __name__ == "__main__":
    main()
