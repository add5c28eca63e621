"""Benchmark: the update's training throughput on an 8B-shaped slice, torch's attention against
megatron's local one, side by side in one process on the same weights.

One :class:`~reco_megatron.megatron.ReCoEngine` (TP 1, bf16, the distributed optimizer, the
ReCo loss with the statistics op) over ``--layers`` Llama-3.1-8B layers (hidden 4096, 32 heads,
8 KV groups, FFN 14336, vocabulary 128256); each self-attention holds both core attentions
(``model.attention_backend=torch``'s and megatron's ``DotProductAttention``) and the benchmark
swaps them between cases, so every case trains the same model. Cases, in this order (the one
likeliest to run out of memory last):

* ``4096``: rows of one 4096-token sequence, one row per micro-batch (torch, then local);
* ``16384 packed``: documents of mixed lengths (512-4096) packed into rows of 16384 tokens
  (torch only: megatron's local attention takes no packed rows);
* ``16384``: rows of one 16384-token sequence (torch, then local: its ``[b, 32, s, s]`` scores
  are 16 GiB per tensor per layer in bf16).

Per case one warm-up step, then ``--steps`` timed optimizer steps (``engine.train_step``, a
synchronize after each); reported: tokens/s, model TFLOP/s and MFU, peak memory. FLOPs are
Megatron's count (``num_floating_point_operations`` of Megatron-LM's ``training.py``: 12 x
layers x hidden^2 per token x [(1 + groups/heads + s/hidden) + 1.5 x FFN/hidden + vocab /
(2 layers hidden)], attention included, non-causal as Megatron counts it), with ``s`` each
document's own length for packed rows. MFU divides by the bf16 matmul rate measured in the
same process (8192^3 ``torch.matmul``, median of 10). A case that runs out of memory is
recorded as such and the next one runs. ``--out`` (JSON) is rewritten after every case with
``"complete": false`` until the end, so a run stopped by a time limit keeps what finished.

Run::

    python benchmarks/gpu/train_throughput.py --out OUT.json              # one CUDA GPU
    python benchmarks/gpu/train_throughput.py --tiny --out OUT.json       # CPU rehearsal
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import torch

SLICE = dict(
    hidden_size=4096,
    ffn_hidden_size=14336,
    num_attention_heads=32,
    num_query_groups=8,
    vocab_size=128256,
    rotary_base=500000.0,
    params_dtype="bfloat16",
)
TINY = dict(
    hidden_size=64,
    ffn_hidden_size=128,
    num_attention_heads=4,
    num_query_groups=2,
    vocab_size=512,
    params_dtype="float32",
)


def megatron_flops(lengths: list[int], layers: int, m: dict, padded_vocab: int) -> float:
    """Forward + backward FLOPs of sequences of ``lengths`` (Megatron-LM's formula, dense GQA
    SwiGLU, attention counted over each sequence's own length)."""
    h, heads, groups, ffn = (
        m[k] for k in ("hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size")
    )
    total = 0.0
    for s in lengths:
        per_token = (1 + groups / heads + s / h) + 1.5 * ffn / h + padded_vocab / (2 * layers * h)
        total += 12 * s * layers * h * h * per_token
    return total


def matmul_tflops(device: torch.device, dtype: torch.dtype, n: int) -> float:
    """Measured ``n^3`` matmul rate in TFLOP/s (median of 10 after 3 warm-ups)."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    times = []
    for i in range(13):
        _sync(device)
        t0 = time.perf_counter()
        torch.matmul(a, b)
        _sync(device)
        if i >= 3:
            times.append(time.perf_counter() - t0)
    return 2 * n**3 / sorted(times)[len(times) // 2] / 1e12


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _batch(lengths: list[int], vocab: int, gen: random.Random, prompt: int = 16):
    """A one-group rollout batch of sequences of ``lengths`` (a ``prompt``-token prompt each),
    with old log-probs and weights filled as the old-policy pass would."""
    from reco_megatron.parallel.batch import RolloutBatch

    width = max(lengths)
    g = torch.Generator().manual_seed(gen.randrange(2**31))
    tokens = torch.randint(0, vocab, (len(lengths), width), generator=g)
    mask = torch.zeros(len(lengths), width)
    for i, n in enumerate(lengths):
        mask[i, prompt:n] = 1.0
        tokens[i, n:] = 0
    return RolloutBatch(
        tokens=tokens,
        response_mask=mask,
        advantages=torch.randn(len(lengths), generator=g),
        group_size=len(lengths),
        old_logprobs=-torch.rand(len(lengths), width - 1, generator=g),
        old_sum_p2=torch.rand(len(lengths), width - 1, generator=g) * 0.5,
        weights=torch.ones(len(lengths)),
    )


def _documents(total: int, low: int, high: int, row: int, gen: random.Random) -> list[int]:
    """Mixed lengths in ``[low, high]`` filling rows of ``row`` tokens exactly (``total`` in
    all): a draw that would leave less than ``low`` in a row takes the rest of it."""
    out, used = [], 0
    while used < total:
        room = row - used % row
        n = gen.randint(low, high)
        if n > room - low:
            n = room
        out.append(n)
        used += n
    return out


def _attention_swapper(engine):
    """``use(name)`` puts ``torch`` or ``local`` core attention into every layer."""
    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    layers = [m for c in engine.unwrapped() for m in c.modules() if isinstance(m, SelfAttention)]
    fused = [m.core_attention for m in layers]
    local = [
        DotProductAttention(engine.config, m.layer_number, AttnMaskType.causal, "self").to(
            engine.device
        )
        for m in layers
    ]

    def use(name: str) -> None:
        for layer, a, b in zip(layers, fused, local, strict=True):
            layer.core_attention = a if name == "torch" else b

    return use


def run(args: argparse.Namespace) -> dict:
    from reco_megatron.algo import LossConfig
    from reco_megatron.megatron import (
        ModelConfig,
        OptimConfig,
        ParallelConfig,
        ReCoEngine,
        UpdateConfig,
        initialize_parallel,
    )
    from reco_megatron.utils.jsonfile import write_json

    arch = TINY if args.tiny else SLICE
    short, long = (64, 256) if args.tiny else (4096, 16384)
    tokens_per_step = 2 * long
    parallel = ParallelConfig(micro_batch_size=1)
    initialize_parallel(parallel, seed=1)
    model = ModelConfig(
        num_layers=args.layers,
        max_position_embeddings=long,
        make_vocab_size_divisible_by=128,
        attention_backend="torch",
        **arch,
    )
    start = time.perf_counter()
    engine = ReCoEngine(
        model,
        parallel,
        LossConfig.preset("reco", kl_coef=0.0),
        OptimConfig(lr=1e-6, weight_decay=0.0, clip_grad=1.0),
        UpdateConfig(
            max_tokens_per_microbatch=long,
            microbatch_length_multiple=16,
            sequence_packing=True,
            stats_implementation="auto",
        ),
        total_optimizer_steps=1000,
    )
    use = _attention_swapper(engine)
    device = engine.device
    cuda = device.type == "cuda"
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[arch["params_dtype"]]
    report: dict = {
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "torch": torch.__version__,
        "arch": {**arch, "num_layers": args.layers},
        "parameters": sum(p.numel() for c in engine.unwrapped() for p in c.parameters()),
        "setup_s": time.perf_counter() - start,
        "steps": args.steps,
        "tokens_per_step": tokens_per_step,
        "matmul_tflops": matmul_tflops(device, dtype, 512 if args.tiny else 8192),
        "cases": [],
        "complete": False,
    }
    write_json(args.out, report)
    padded_vocab = model.padded_vocab_size(1)
    gen = random.Random(0)
    low, high = (long // 32, long // 4)
    cases = [
        (f"{short}", "torch", [short] * (tokens_per_step // short), False),
        (f"{short}", "local", [short] * (tokens_per_step // short), False),
        (f"{long} packed", "torch", _documents(tokens_per_step, low, high, long, gen), True),
        (f"{long}", "torch", [long] * 2, False),
        (f"{long}", "local", [long] * 2, False),
    ]
    for name, attention, lengths, packed in cases:
        use(attention)
        engine.batcher.packing = packed
        engine.batcher.budget = long if packed else max(lengths)
        row = {"case": name, "attention": attention, "sequences": len(lengths)}
        row["flops_per_step"] = megatron_flops(lengths, args.layers, arch, padded_vocab)
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        try:
            times = []
            for i in range(args.steps + 1):
                batch = _batch(lengths, arch["vocab_size"], gen, prompt=min(16, low // 2))
                _sync(device)
                t0 = time.perf_counter()
                metrics = engine.train_step(batch)
                _sync(device)
                if i > 0:  # step 0: the warm-up
                    times.append(time.perf_counter() - t0)
            step_s = sorted(times)[len(times) // 2]
            row.update(
                status="ok",
                step_s=step_s,
                tokens_per_s=sum(lengths) / step_s,
                model_tflops=row["flops_per_step"] / step_s / 1e12,
                loss=metrics["loss"],
            )
            row["mfu"] = row["model_tflops"] / report["matmul_tflops"]
        except torch.OutOfMemoryError as exc:
            row.update(status="out of memory", error=str(exc).splitlines()[0][:200])
            for chunk in engine.model:
                chunk.zero_grad_buffer()
        if cuda:
            row["peak_allocated_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        report["cases"].append(row)
        write_json(args.out, report)
        print(
            f"{name:>14} {attention:>5}: {row['status']}",
            {k: round(v, 3) for k, v in row.items() if isinstance(v, float)},
            flush=True,
        )
    report["complete"] = True
    write_json(args.out, report)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="the JSON report")
    parser.add_argument("--tiny", action="store_true", help="CPU rehearsal sizes")
    parser.add_argument("--layers", type=int, default=2, help="8B layers in the slice")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per case")
    args = parser.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    run(args)


if __name__ == "__main__":
    main()
