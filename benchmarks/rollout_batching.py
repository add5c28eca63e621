"""Benchmark: per-prompt seeds in one batched ``generate`` vs one ``generate`` call per prompt.

The trainer gives every prompt its own seed (responses independent of the data-parallel
layout). Before per-prompt ``SamplingParams`` existed it made one engine call per prompt;
now it makes one call with a seed per prompt. Both run side by side here, on the embedded
engine with the architecture of ``examples/tiny_cpu.yaml`` (random weights, eos disabled so
every response has ``max_new_tokens`` tokens: the same work in both arms), alternating arms
over ``--reps`` repetitions; reported: median wall time per arm, their ratio, whether the
tokens agree, the largest log-prob difference, and the process's peak RSS.

Run::

    python benchmarks/rollout_batching.py                       # tiny_cpu.yaml shapes
    python benchmarks/rollout_batching.py --prompts 32 --group 8 --new-tokens 64
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time
from dataclasses import replace

import torch

from reco_megatron.megatron.hf.config import hf_config_from_model_config
from reco_megatron.megatron.model.config import ModelConfig
from reco_megatron.rollout import EmbeddedEngine, EmbeddedEngineConfig, SamplingParams


def tiny_model_config() -> ModelConfig:
    """``examples/tiny_cpu.yaml``'s model, with room for 80 + 64 tokens."""
    from reco_megatron.config import load_config
    from reco_megatron.trainer.config import TrainConfig

    cfg = load_config(TrainConfig, "examples/tiny_cpu.yaml", ["model.max_position_embeddings=256"])
    return cfg.model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8, help="prompts per step")
    parser.add_argument("--group", type=int, default=8, help="responses per prompt")
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    hf = hf_config_from_model_config(tiny_model_config())
    engine = EmbeddedEngine(hf, EmbeddedEngineConfig(max_model_len=256, eos_token_ids=()))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        state = {k: torch.randn_like(v) * 0.05 for k, v in engine.model.state_dict().items()}
    engine.update_weights(state.items())
    gen = torch.Generator().manual_seed(1)
    prompts = [
        torch.randint(
            3, 128, (int(torch.randint(20, 80, (1,), generator=gen)),), generator=gen
        ).tolist()
        for _ in range(args.prompts)
    ]
    base = SamplingParams(max_new_tokens=args.new_tokens)
    params = [replace(base, seed=1000 + i) for i in range(args.prompts)]

    def per_prompt():
        return [
            engine.generate([p], args.group, s)[0] for p, s in zip(prompts, params, strict=True)
        ]

    def batched():
        return engine.generate(prompts, args.group, params)

    times: dict[str, list[float]] = {"per_prompt": [], "batched": []}
    outs = {}
    per_prompt(), batched()  # warm-up
    for _ in range(args.reps):
        for name, fn in (("per_prompt", per_prompt), ("batched", batched)):
            start = time.perf_counter()
            outs[name] = fn()
            times[name].append(time.perf_counter() - start)
    same = all(
        a.token_ids == b.token_ids
        for ga, gb in zip(outs["per_prompt"], outs["batched"], strict=True)
        for a, b in zip(ga, gb, strict=True)
    )
    dlogp = max(
        abs(x - y)
        for ga, gb in zip(outs["per_prompt"], outs["batched"], strict=True)
        for a, b in zip(ga, gb, strict=True)
        for x, y in zip(a.logprobs, b.logprobs, strict=True)
    )
    med = {k: statistics.median(v) for k, v in times.items()}
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(
        f"| {args.prompts} x {args.group} x {args.new_tokens} | {med['per_prompt']:.3f} | "
        f"{med['batched']:.3f} | {med['per_prompt'] / med['batched']:.1f}x | {same} | "
        f"{dlogp:.1e} | {rss_mb:.0f} |"
    )


if __name__ == "__main__":
    main()
