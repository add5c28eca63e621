"""Benchmark (CPU): the output layer + statistics + loss, unfused vs the two fused ops.

Three ways to get a loss of the per-token statistics from hidden states ``[N, H]`` and an
output weight ``[V, H]`` (bf16, TP 1), forward + backward:

* ``unfused``: ``F.linear`` (the whole logits), :func:`vocab_parallel_stats` with
  ``inplace_backward`` (what the engine runs without ``update.fused_output_layer``), the loss;
* ``stats_layer``: :func:`vocab_parallel_linear_stats` (logits in blocks), then the loss;
* ``loss_layer``: :func:`vocab_parallel_linear_loss` (the loss inside: backward in forward);
* ``block_matmuls``: the fused ops' three matmuls per block alone, no statistics (what the
  BLAS and one block of logits cost by themselves: the difference to ``loss_layer`` is the
  statistics' share).

Reported per method: matmul FLOPs over those of one ``N x H x V`` matmul (``torch.utils.
flop_counter``), and the peak resident memory above the inputs during forward + backward
(Linux's VmHWM after resetting it, in a fresh forked process per measurement), minus the
gradients of ``hidden`` and ``weight`` (``(N + V) H`` bf16, which every method returns): the
*extra* memory. CPU wall time is printed for completeness only (the eager statistics path).

Extrapolation to the GPU (``docs/benchmarks.md``): ``loss_layer``'s extra memory is one block
of logits plus fp32 temporaries of the eager math on a block plus a few ``[N]`` vectors, so it
does not grow with ``N`` (two ``N`` per run show it); on CUDA the Triton kernels need no
temporaries, leaving the bf16 block (``2^27`` logits, 256 MiB by default) and ``[N]``
vectors.

Run (CPU, several minutes on 2 cores)::

    python benchmarks/fused_layer.py
    python benchmarks/fused_layer.py --tokens 1024 4096 --vocab 32064 --hidden 512 --json f.json
    python benchmarks/fused_layer.py --tokens 4096 --block-tokens 32   # extra scales with it
"""

from __future__ import annotations

import argparse
import ctypes
import json
import time

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from reco_megatron.algo.token_stats import TokenStats
from reco_megatron.parallel import vocab_parallel_stats
from reco_megatron.parallel.linear_loss import vocab_parallel_linear_loss
from reco_megatron.parallel.linear_stats import vocab_parallel_linear_stats
from reco_megatron.testing import run_distributed

METHODS = ("unfused", "stats_layer", "loss_layer", "block_matmuls")
M_MMAP_THRESHOLD = -3  # glibc mallopt parameter


def _loss(stats: TokenStats) -> torch.Tensor:
    return (stats.logprob + stats.entropy + stats.sum_p2).sum()


def _step(method: str, h, w, target, block: int | None) -> None:
    vocab = w.shape[0]
    if method == "unfused":
        _loss(vocab_parallel_stats(F.linear(h, w), target, vocab, inplace_backward=True)).backward()
    elif method == "stats_layer":
        _loss(vocab_parallel_linear_stats(h, w, target, vocab, block_tokens=block)).backward()
    elif method == "loss_layer":
        vocab_parallel_linear_loss(h, w, target, _loss, vocab, block_tokens=block)[0].backward()
    else:
        _block_matmuls(h, w, block or max(1, (1 << 22) // vocab))


def _block_matmuls(h: torch.Tensor, w: torch.Tensor, block: int) -> None:
    with torch.no_grad():
        dh, dw = torch.empty_like(h), torch.zeros_like(w)
        for start in range(0, h.shape[0], block):
            sl = slice(start, min(start + block, h.shape[0]))
            z = torch.matmul(h[sl], w.t())
            torch.mm(z, w, out=dh[sl])
            torch.addmm(dw, z.t(), h[sl], out=dw)


def _status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        line = next(x for x in f if x.startswith(key + ":"))
    return int(line.split()[1]) * 1024


def _measure(rank, world_size, method: str, n: int, v: int, hidden: int, block: int | None):
    # Every allocation above 64 KiB mmap'd and freed pages handed back: RSS is live memory.
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(M_MMAP_THRESHOLD, 1 << 16)
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    h = (torch.randn(n, hidden, generator=gen) * 0.05).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(v, hidden, generator=gen) * 0.05).to(torch.bfloat16).requires_grad_()
    target = torch.randint(0, v, (n,), generator=gen)
    libc.malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS
    base = _status_bytes("VmRSS")
    start = time.perf_counter()
    _step(method, h, w, target, block)
    seconds = time.perf_counter() - start
    peak = _status_bytes("VmHWM") - base
    h.grad = w.grad = None
    with FlopCounterMode(display=False) as flops:
        _step(method, h, w, target, block)
    return {
        "method": method,
        "tokens": n,
        "vocab": v,
        "hidden": hidden,
        "block_tokens": block,
        "matmuls": flops.get_total_flops() / (2 * n * hidden * v),
        "peak_bytes": peak,
        "extra_bytes": peak - 2 * (n + v) * hidden,
        "logits_bytes": 2 * n * v,
        "cpu_seconds": seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--vocab", type=int, default=32064)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument(
        "--block-tokens", type=int, help="tokens per block of the fused ops (default: theirs)"
    )
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--json", help="also write the rows as JSON to this file")
    args = parser.parse_args()
    rows = []
    print("| N x V x H | method | matmuls | extra MiB | extra / bf16 logits | CPU s |")
    print("|---|---|---:|---:|---:|---:|")
    for n in args.tokens:
        for method in args.methods:
            shape = (method, n, args.vocab, args.hidden, args.block_tokens)
            row = run_distributed(_measure, 1, args=shape, timeout=900)[0]
            rows.append(row)
            print(
                f"| {n} x {args.vocab} x {args.hidden} | {method} | {row['matmuls']:.0f} | "
                f"{row['extra_bytes'] / 2**20:.0f} | "
                f"{row['extra_bytes'] / row['logits_bytes']:.2f} | {row['cpu_seconds']:.1f} |",
                flush=True,
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
