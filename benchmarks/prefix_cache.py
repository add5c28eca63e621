"""Benchmark: multi-turn decoding on the megatron engine with and without its prefix cache.

Episodes are driven as ``reco_megatron/envs/episodes.py`` drives an engine: each turn is one
``generate`` call whose prompts are the episodes' whole contexts (prompt, earlier actions and
observations), one sample each, a seed per episode and turn. The observation here is a fixed
``--obs`` tokens (no environment: what is measured is the engine). Two arms on the same model
and prompts, alternating over ``--reps``: ``rollout.prefix_cache_gib=0`` (every turn prefills
the whole context) and the default (later turns prefill the last action token and the
observation only). Reported per arm: the median seconds of all turns and of the later turns,
the prompt positions prefilled and reused, and whether both arms produced the same tokens.
Model: the one of ``examples/calculator_cpu.yaml`` (4 layers, hidden 128), random weights,
fp32; nothing asserts on time.

Run::

    python benchmarks/prefix_cache.py                        # 64 episodes x 4 turns, 3 reps
    python benchmarks/prefix_cache.py --episodes 128 --prompt-len 80 --threads 1
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import torch
from rollout_engines import SMOKE  # benchmarks/ is the script's folder

from reco_megatron.megatron.decoding.decoder import MegatronDecoder
from reco_megatron.megatron.distributed import ParallelConfig, initialize_parallel
from reco_megatron.megatron.model.build import build_model, transformer_config
from reco_megatron.megatron.model.config import ModelConfig
from reco_megatron.rollout import SamplingParams
from reco_megatron.rollout.megatron_engine import MegatronEngine, MegatronEngineConfig

CALCULATOR = dict(family="llama", **SMOKE)  # examples/calculator_cpu.yaml: the tiny model


def _arguments() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--episodes", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=40)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=8, help="action tokens per turn")
    p.add_argument("--obs", type=int, default=3, help="observation tokens per turn")
    p.add_argument(
        "--rows-per-call",
        type=int,
        default=0,
        help="episodes per generate call (0: all; small: as the overlapped runner's calls)",
    )
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    return p.parse_args()


def _episodes(
    model: Any, max_len: int, gib: int | None, args: argparse.Namespace, prompts: list
) -> dict:
    """One arm's turns: seconds per turn, positions prefilled and reused, the tokens."""
    decoder = MegatronDecoder(
        [model],
        vocab_size=CALCULATOR["vocab_size"],
        max_model_len=max_len,
        prefix_cache_bytes=gib,
    )
    engine = MegatronEngine(decoder, MegatronEngineConfig(seed=0))
    contexts = [list(p) for p in prompts]
    seconds, tokens = [], []
    for t in range(args.turns):
        params = [
            SamplingParams(max_new_tokens=args.new_tokens, seed=1000 * t + i)
            for i in range(len(contexts))
        ]
        size = args.rows_per_call or len(contexts)
        start = time.perf_counter()
        got = []
        for lo in range(0, len(contexts), size):
            got += engine.generate(contexts[lo : lo + size], 1, params[lo : lo + size])
        seconds.append(time.perf_counter() - start)
        tokens.append([g[0].token_ids for g in got])
        observation = [7] * args.obs
        contexts = [c + g[0].token_ids + observation for c, g in zip(contexts, got, strict=True)]
    cache = decoder.prefix_cache
    engine.close()
    return {
        "seconds": seconds,
        "prefilled": cache.prefilled_positions,
        "reused": cache.reused_positions,
        "tokens": tokens,
    }


def main() -> None:
    args = _arguments()
    if args.threads:
        torch.set_num_threads(args.threads)
    max_len = args.prompt_len + args.turns * (args.new_tokens + args.obs)
    model_cfg = ModelConfig(**CALCULATOR, max_position_embeddings=max_len)
    parallel = ParallelConfig()
    initialize_parallel(parallel, seed=1234)
    config = transformer_config(model_cfg, parallel, False)
    model = build_model(model_cfg, config, pre_process=True, post_process=True, on_gpu=False)
    gen = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(0, model_cfg.vocab_size, (args.prompt_len,), generator=gen).tolist()
        for _ in range(args.episodes)
    ]
    arms: dict[str, list[dict]] = {"off": [], "on": []}
    for rep in range(args.reps + 1):  # rep 0 warms up
        order = [("off", 0), ("on", None)] if rep % 2 else [("on", None), ("off", 0)]
        for name, gib in order:
            run = _episodes(model, max_len, gib, args, prompts)
            if rep:
                arms[name].append(run)
    print(
        f"{args.episodes} episodes x {args.turns} turns, prompt {args.prompt_len}, "
        f"{args.new_tokens} action + {args.obs} observation tokens per turn, "
        f"{args.rows_per_call or args.episodes} episodes per call, "
        f"{torch.get_num_threads()} threads, load {os.getloadavg()[0]:.1f}"
    )
    for name, runs in arms.items():
        all_turns = statistics.median(sum(r["seconds"]) for r in runs)
        later = statistics.median(sum(r["seconds"][1:]) for r in runs)
        print(
            f"  prefix cache {name:3}: {all_turns:.3f} s per episode batch (later turns "
            f"{later:.3f} s), prefilled {runs[0]['prefilled']} positions, reused "
            f"{runs[0]['reused']}; reps {[round(sum(r['seconds']), 3) for r in runs]}"
        )
    same = arms["off"][0]["tokens"] == arms["on"][0]["tokens"]
    print(f"  same tokens in both arms: {same}")


if __name__ == "__main__":
    main()
