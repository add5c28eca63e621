"""Benchmark: ``vocab_parallel_stats`` vs megatron's cross entropy vs cross entropy + entropy.

Three ways to get per-token statistics from bf16 vocabulary-sharded logits, forward+backward,
measured side by side in one run (ranks forked locally over gloo, one thread each):

* ``ours_eager`` / ``ours_compiled``: :func:`reco_megatron.parallel.vocab_parallel_stats`
  -> logprob, entropy, sum p^2, gradient through all three (eager ops / torch.compile'd chunks);
* ``megatron_ce``: ``megatron.core.tensor_parallel.vocab_parallel_cross_entropy`` -> logprob only
  (it upcasts the shard to fp32 and saves the fp32 softmax for backward);
* ``ce_plus_entropy``: megatron's cross entropy plus a separate autograd entropy pass over the
  fp32 softmax with differentiable all-reduces (the approach RL frameworks such as verl take).

Reported per configuration: median wall time of each method and the ratios; bytes
saved for backward (excluding the input logits, alive anyway) relative to the local logits;
peak resident memory above the inputs during forward+backward relative to the local logits
(measured with Linux's VmHWM after resetting it, so it includes the gradient of the logits).

Run (CPU, ~10 minutes on 2 cores)::

    python benchmarks/vocab_stats.py                       # full grid, markdown table
    python benchmarks/vocab_stats.py --tokens 2048 --vocab 32000 --tp 1 --reps 2

GPU mode (one process, one CUDA GPU, TP 1: the Triton kernels, Liger-Kernel and the output
layer too; see ``benchmarks/vocab_stats_gpu.py``)::

    python benchmarks/vocab_stats.py --gpu --reps 10 --json vocab_stats_gpu.json
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time

import torch
import torch.distributed as dist

from reco_megatron.parallel import vocab_parallel_stats
from reco_megatron.testing import run_distributed

METHODS = ("ours_eager", "ours_compiled", "megatron_ce", "ce_plus_entropy")


def _inputs(n_tokens: int, vocab: int, tp: int, rank: int):
    v_local = vocab // tp
    gen = torch.Generator().manual_seed(rank)
    logits = (torch.randn(n_tokens, v_local, generator=gen) * 2).to(torch.bfloat16)
    target = torch.randint(0, vocab, (n_tokens,), generator=torch.Generator().manual_seed(7))
    return logits, target


def _ours(logits, target, vocab, group, implementation):
    stats = vocab_parallel_stats(
        logits, target, vocab, tp_group=group, implementation=implementation
    )
    return stats.logprob.sum() + stats.entropy.sum() + stats.sum_p2.sum()


def _ours_eager(logits, target, vocab, group):
    return _ours(logits, target, vocab, group, "eager")


def _ours_compiled(logits, target, vocab, group):
    return _ours(logits, target, vocab, group, "compiled")


def _megatron_ce(logits, target, vocab, group):
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    return -vocab_parallel_cross_entropy(logits[:, None, :], target[:, None]).sum()


def _ce_plus_entropy(logits, target, vocab, group):
    import torch.distributed.nn.functional as dist_fn

    loss = _megatron_ce(logits, target, vocab, group)
    z = logits.float()
    m = z.detach().amax(-1)
    if group is not None:
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    e = torch.exp(z - m[:, None])
    s = e.sum(-1)
    if group is not None:
        s = dist_fn.all_reduce(s, group=group)
    p = e / s[:, None]
    ent_local = -(p * torch.log(p.clamp_min(1e-30))).sum(-1)
    ent = dist_fn.all_reduce(ent_local, group=group) if group is not None else ent_local
    return loss + ent.sum()


M_MMAP_THRESHOLD = -3  # glibc mallopt parameter

MAX_CE_ENTROPY_LOGITS = 1 << 28
"""ce_plus_entropy keeps ~14x the bf16 logits alive: skipped above this many local logits."""

_FNS = {
    "ours_eager": _ours_eager,
    "ours_compiled": _ours_compiled,
    "megatron_ce": _megatron_ce,
    "ce_plus_entropy": _ce_plus_entropy,
}


def _setup(tp: int):
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    return parallel_state.get_tensor_model_parallel_group() if tp > 1 else None


def _methods(n_tokens: int, vocab_local: int) -> tuple[str, ...]:
    if n_tokens * vocab_local > MAX_CE_ENTROPY_LOGITS:
        return METHODS[:-1]
    return METHODS


def _timing_body(rank, world_size, n_tokens, vocab, reps):
    group = _setup(world_size)
    logits, target = _inputs(n_tokens, vocab, world_size, rank)
    methods = _methods(n_tokens, vocab // world_size)
    times: dict[str, list[float]] = {m: [] for m in methods}
    for rep in range(reps + 1):  # rep 0 is a warm-up
        order = methods[rep % len(methods) :] + methods[: rep % len(methods)]
        for method in order:
            x = logits.clone().requires_grad_()
            dist.barrier()
            t0 = time.perf_counter()
            _FNS[method](x, target, vocab, group).backward()
            dist.barrier()
            if rep > 0:
                times[method].append(time.perf_counter() - t0)
            del x
    return {m: statistics.median(v) for m, v in times.items()}


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status (Linux only)")


def _memory_body(rank, world_size, n_tokens, vocab, method):
    # Every allocation above 64 KiB gets its own mmap and goes back to the OS when freed, so
    # resident memory is live memory (glibc's heap would otherwise keep freed chunks).
    ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, 1 << 16)
    group = _setup(world_size)
    logits, target = _inputs(n_tokens, vocab, world_size, rank)
    logits_bytes = logits.numel() * logits.element_size()
    x = logits.clone().requires_grad_()
    saved: list[int] = [0]

    def pack(t):
        if t.untyped_storage().data_ptr() not in (x.untyped_storage().data_ptr(),):
            saved[0] += t.numel() * t.element_size()
        return t

    # Warm once (allocator pools, lazy inits), then measure a clean forward+backward.
    _FNS[method](logits.clone().requires_grad_(), target, vocab, group).backward()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # hand freed pages back, so RSS is live memory
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS
    base = _status_kib("VmRSS")
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = _FNS[method](x, target, vocab, group)
    loss.backward()
    peak = _status_kib("VmHWM") - base
    return {"saved": saved[0] / logits_bytes, "peak": peak * 1024 / logits_bytes}


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--vocab", type=int, nargs="+", default=[32000, 128256])
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--gpu", action="store_true", help="GPU mode (vocab_stats_gpu.py)")
    parser.add_argument(
        "--device", choices=("cuda", "cpu"), default=None, help="GPU mode on this device"
    )
    parser.add_argument("--shapes", nargs="+", default=None, help="GPU mode: NxV ...")
    parser.add_argument("--hidden", type=int, default=4096, help="GPU mode: H of the layer")
    parser.add_argument("--json", default=None, help="GPU mode: also write the rows here")
    parser.add_argument(
        "--skip",
        default="",
        help="GPU mode: leave out these methods (comma-separated fnmatch patterns)",
    )
    args = parser.parse_args()
    if args.gpu or args.device:
        import vocab_stats_gpu  # beside this script

        shapes = args.shapes or list(vocab_stats_gpu.DEFAULT_SHAPES)
        skip = tuple(p for p in args.skip.split(",") if p)
        vocab_stats_gpu.run(
            shapes, args.hidden, args.reps, args.device or "cuda", args.json, skip=skip
        )
        return

    header = (
        "| N | V | TP | V/TP | eager s | compiled s | megatron CE s | CE+entropy s | "
        "CE / eager | CE / compiled | CE+ent / compiled | saved eager / compiled / CE / CE+ent "
        "| peak eager / compiled / CE / CE+ent |"
    )
    rows = [header, "|" + "---|" * 13]
    for tp in args.tp:
        for vocab in args.vocab:
            for n in args.tokens:
                t = run_distributed(_timing_body, tp, args=(n, vocab, args.reps), timeout=1800)
                methods = _methods(n, vocab // tp)
                t = {m: max(r[m] for r in t) for m in methods}  # slowest rank sets the pace
                t.setdefault("ce_plus_entropy", float("nan"))
                mem = {
                    m: run_distributed(_memory_body, tp, args=(n, vocab, m), timeout=1800)[0]
                    for m in methods
                }
                mem.setdefault("ce_plus_entropy", {"saved": float("nan"), "peak": float("nan")})
                saved = " / ".join(f"{mem[m]['saved']:.2f}x" for m in METHODS)
                peak = " / ".join(f"{mem[m]['peak']:.2f}x" for m in METHODS)
                eager, comp, ce = t["ours_eager"], t["ours_compiled"], t["megatron_ce"]
                rows.append(
                    f"| {n} | {vocab} | {tp} | {vocab // tp} | {eager:.3f} | {comp:.3f} | "
                    f"{ce:.3f} | {t['ce_plus_entropy']:.3f} | {ce / eager:.2f} | "
                    f"{ce / comp:.2f} | {t['ce_plus_entropy'] / comp:.2f} | {saved} | {peak} |"
                )
                print(rows[-1], flush=True)
    print("\n".join(rows))


if __name__ == "__main__":
    main()
