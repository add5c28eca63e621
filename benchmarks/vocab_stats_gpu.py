"""GPU mode of ``benchmarks/vocab_stats.py``: every method side by side in one process.

Run on a machine with one CUDA GPU (TP 1, bf16)::

    python benchmarks/vocab_stats.py --gpu                      # the target shapes
    python benchmarks/vocab_stats.py --gpu --shapes 8192x128256 --reps 10 --json out.json

Statistics from logits ``[N, V]`` (forward + backward of the sum of the outputs):

* ``ours_triton_inplace`` / ``ours_triton``: ``vocab_parallel_stats(implementation="triton")``,
  log p + entropy + sum p^2, gradient written into the logits / into a new buffer;
* ``ours_compiled`` / ``ours_eager``: the ``torch.compile`` and eager paths (CUDA default chunk);
* ``megatron_ce``: ``megatron.core.tensor_parallel.vocab_parallel_cross_entropy`` (log p only);
* ``torch_ce``: ``torch.nn.functional.cross_entropy`` (log p only);
* ``liger_ce``: Liger-Kernel's cross entropy (log p only), if ``liger_kernel`` imports.

Output layer + statistics from hidden ``[N, H]`` and weight ``[V, H]`` (``--hidden``, 4096):

* ``matmuls``: ``h W^T`` forward and its two backward matmuls alone (what any fused layer must do);
* ``matmul_ours_inplace``: the matmul, then ``ours_triton_inplace``;
* ``fused_ours``: ``parallel.linear_stats.vocab_parallel_linear_stats`` (Triton, default
  blocks: the logits never exist whole; 4 matmuls, its backward recomputes the logits);
* ``fused_loss_ours``: ``parallel.linear_loss.vocab_parallel_linear_loss`` with the loss
  ``sum(log p + H + sum p^2)`` inside (3 matmuls: the backward runs in the forward);
* ``liger_flce``: Liger's fused linear cross entropy (log p only), if ``liger_kernel`` imports.

Reported: median CUDA-event time over ``--reps`` after a warm-up, the bound (6 bytes per
bf16 logit: 2 read in forward, 2 read in backward, 2 written for the gradient) from a copy bandwidth
measured in the same run, and the peak of ``torch.cuda.max_memory_allocated`` above the inputs
during forward + backward, relative to the bf16 logits ``N x V x 2`` bytes (so a gradient
buffer of the logits' size counts 1.0x), and in GiB (for the layer rows that peak includes
the weight and hidden gradients: subtract ``V H + N H`` bf16 for the target's "beyond inputs,
outputs and weight gradient"). ``--device cpu`` runs the same code on tiny shapes
(with ``TRITON_INTERPRET=1`` for the Triton methods) to check the script without a GPU.

``--skip PATTERN,...`` leaves out the methods whose names match (``fnmatch``; the device check
skips ``ours_compiled,ours_eager``, whose cold ``torch.compile`` costs about a minute).
``--json FILE`` is rewritten (atomically) after each shape's op table and again after its
layer table, with ``"complete": false`` until the end, so a run stopped by a time limit
leaves every finished measurement readable.
"""

from __future__ import annotations

import fnmatch
import os
import statistics
import tempfile
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from reco_megatron.parallel import vocab_parallel_stats
from reco_megatron.utils.jsonfile import write_json

DEFAULT_SHAPES = ("8192x128256", "8192x64128", "32768x128256")
BYTES_PER_LOGIT_BOUND = 6  # bf16: read (forward) + read (backward) + write (gradient)


def _ours(implementation: str, inplace: bool) -> Callable:
    def run(x, target):
        s = vocab_parallel_stats(
            x, target, x.shape[-1], implementation=implementation, inplace_backward=inplace
        )
        return s.logprob.sum() + s.entropy.sum() + s.sum_p2.sum()

    return run


def _megatron_ce(x, target):
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    return vocab_parallel_cross_entropy(x[:, None, :], target[:, None]).sum()


def _torch_ce(x, target):
    return F.cross_entropy(x, target, reduction="sum")


def _liger_ce(x, target):
    from liger_kernel.transformers import LigerCrossEntropyLoss

    out = LigerCrossEntropyLoss(reduction="sum")(x, target)
    return out[0] if isinstance(out, tuple) else out


def _matmuls(h, w, target):
    # The three matmuls of the output layer, outside autograd; the logits stand in for their
    # own upstream gradient (same shape and dtype: the values do not change the time).
    with torch.no_grad():
        logits = torch.matmul(h, w.t())
        torch.matmul(logits, w)
        torch.matmul(logits.t(), h)


def _matmul_ours(h, w, target):
    return _ours("triton", True)(torch.matmul(h, w.t()), target)


def _fused_ours(h, w, target):
    from reco_megatron.parallel.linear_stats import vocab_parallel_linear_stats

    s = vocab_parallel_linear_stats(h, w, target, w.shape[0], implementation="triton")
    return s.logprob.sum() + s.entropy.sum() + s.sum_p2.sum()


def _fused_loss_ours(h, w, target):
    from reco_megatron.parallel.linear_loss import vocab_parallel_linear_loss

    def loss_fn(s):
        return s.logprob.sum() + s.entropy.sum() + s.sum_p2.sum()

    loss, _ = vocab_parallel_linear_loss(h, w, target, loss_fn, w.shape[0], implementation="triton")
    return loss


def _liger_flce(h, w, target):
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    out = LigerFusedLinearCrossEntropyLoss(reduction="sum")(w, h, target)
    return out[0] if isinstance(out, tuple) else out


def _have(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def op_methods(device: str) -> dict[str, Callable]:
    methods: dict[str, Callable] = {}
    if device == "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        methods["ours_triton_inplace"] = _ours("triton", True)
        methods["ours_triton"] = _ours("triton", False)
    if device == "cuda":
        methods["ours_compiled"] = _ours("compiled", False)
    methods["ours_eager"] = _ours("eager", False)
    methods["megatron_ce"] = _megatron_ce
    methods["torch_ce"] = _torch_ce
    if device == "cuda" and _have("liger_kernel"):
        methods["liger_ce"] = _liger_ce
    return methods


def layer_methods(device: str) -> dict[str, Callable]:
    methods: dict[str, Callable] = {"matmuls": _matmuls}
    if device == "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        methods["matmul_ours_inplace"] = _matmul_ours
        methods["fused_ours"] = _fused_ours
        methods["fused_loss_ours"] = _fused_loss_ours
    if device == "cuda" and _have("liger_kernel"):
        methods["liger_flce"] = _liger_flce
    return methods


class _Timer:
    def __init__(self, device: str) -> None:
        self.cuda = device == "cuda"

    def __enter__(self):
        if self.cuda:
            torch.cuda.synchronize()
            self.start, self.end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            self.start.record()
        else:
            self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        if self.cuda:
            self.end.record()
            torch.cuda.synchronize()
            self.seconds = self.start.elapsed_time(self.end) / 1e3
        else:
            self.seconds = time.perf_counter() - self.t0


def copy_bandwidth(device: str, nbytes: int, reps: int) -> float:
    """Bytes per second of ``dst.copy_(src)`` (read + write counted), median of ``reps``."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(reps + 1):
        with _Timer(device) as t:
            dst.copy_(src)
        times.append(t.seconds)
    return 2 * nbytes / statistics.median(times[1:])


def _step(fn: Callable, inputs: tuple[torch.Tensor, ...], grad_of: tuple[int, ...]) -> None:
    out = fn(*inputs)
    if out is not None:  # the matmuls alone return nothing
        out.backward()
    for i in grad_of:
        inputs[i].grad = None


def measure(
    methods: dict[str, Callable],
    make: Callable[[], tuple[torch.Tensor, ...]],
    grad_of: tuple[int, ...],
    device: str,
    reps: int,
) -> dict[str, dict[str, float]]:
    """Median seconds and peak memory above the inputs (bytes) of each method."""
    names = list(methods)
    times: dict[str, list[float]] = {m: [] for m in names}
    for rep in range(reps + 1):  # rep 0 warms up (Triton JIT, torch.compile, allocator)
        order = names[rep % len(names) :] + names[: rep % len(names)]
        for name in order:
            inputs = make()
            with _Timer(device) as t:
                _step(methods[name], inputs, grad_of)
            if rep > 0:
                times[name].append(t.seconds)
            del inputs
    result = {m: {"seconds": statistics.median(v)} for m, v in times.items()}
    for name in names:
        peak = float("nan")
        inputs = make()
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            _step(methods[name], inputs, grad_of)
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - base
        result[name]["peak_bytes"] = peak
        del inputs
    return result


def _init_single_process(device: str) -> None:
    from megatron.core import parallel_state

    if not dist.is_initialized():
        init = tempfile.mkdtemp(prefix="vocab_stats_gpu_")
        dist.init_process_group(
            "nccl" if device == "cuda" else "gloo",
            init_method=f"file://{init}/rendezvous",
            rank=0,
            world_size=1,
        )
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)


def run(
    shapes: list[str],
    hidden: int,
    reps: int,
    device: str,
    json_path: str | None,
    skip: tuple[str, ...] = (),
) -> None:
    """Measure every method not matched by a ``skip`` pattern (``fnmatch``) at each shape.

    ``json_path`` is rewritten atomically after each shape's op rows and again after its
    layer rows, with ``"complete": false`` until the end: a run stopped by a time limit
    leaves every finished measurement in a readable file.
    """
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--gpu needs a CUDA GPU (CUDA_VISIBLE_DEVICES must show one)")
    _init_single_process(device)
    bw_bytes = 1 << 30 if device == "cuda" else 1 << 24
    bandwidth = copy_bandwidth(device, bw_bytes, reps)
    where = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    print(
        f"# {where}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, torch "
        f"{torch.__version__}; copy bandwidth {bandwidth / 1e12:.3f} TB/s\n",
        flush=True,
    )
    report = {
        "device": where,
        "torch": torch.__version__,
        "copy_bandwidth_Bps": bandwidth,
        "shapes": shapes,
        "hidden": hidden,
        "reps": reps,
        "skipped": sorted(
            m
            for m in {*op_methods(device), *layer_methods(device)}
            if any(fnmatch.fnmatchcase(m, p) for p in skip)
        ),
        "complete": False,
        "rows": [],
    }

    def emit(rows: list[dict]) -> None:
        report["rows"] += rows
        if json_path:
            write_json(json_path, report)

    emit([])
    gen = torch.Generator(device=device).manual_seed(0)
    for shape in shapes:
        _shape_rows(shape, hidden, reps, device, bandwidth, gen, skip, emit)
        _print(report["rows"], shape)
    report["complete"] = True
    emit([])
    dist.destroy_process_group()


def _kept(methods: dict[str, Callable], skip: tuple[str, ...]) -> dict[str, Callable]:
    return {m: f for m, f in methods.items() if not any(fnmatch.fnmatchcase(m, p) for p in skip)}


def _shape_rows(
    shape: str,
    hidden: int,
    reps: int,
    device: str,
    bandwidth: float,
    gen: torch.Generator,
    skip: tuple[str, ...],
    emit: Callable[[list[dict]], None],
) -> None:
    """Both tables' rows for one ``NxV``, each table passed to ``emit`` as soon as it is
    measured (the shape's tensors are freed on return)."""
    n, v = (int(x) for x in shape.split("x"))
    logits = (torch.randn(n, v, device=device, generator=gen) * 2).to(torch.bfloat16)
    target = torch.randint(0, v, (n,), device=device, generator=gen)
    bound = BYTES_PER_LOGIT_BOUND * n * v / bandwidth
    methods = _kept(op_methods(device), skip)
    res = measure(methods, lambda: (logits.clone().requires_grad_(), target), (0,), device, reps)
    rows = [
        {"kind": "op", "shape": shape, "method": m, "bound_s": bound, **r} for m, r in res.items()
    ]
    emit([{**r, "peak_x_logits": r["peak_bytes"] / (n * v * 2)} for r in rows])
    logits = None  # freed before the layer tensors are made
    h = (torch.randn(n, hidden, device=device, generator=gen) * 0.05).to(torch.bfloat16)
    w = (torch.randn(v, hidden, device=device, generator=gen) * 0.05).to(torch.bfloat16)
    res = measure(
        _kept(layer_methods(device), skip),
        lambda: (h.clone().requires_grad_(), w.clone().requires_grad_(), target),
        (0, 1),
        device,
        reps,
    )
    rows = [{"kind": f"layer H={hidden}", "shape": shape, "method": m, **r} for m, r in res.items()]
    emit([{**r, "peak_x_logits": r["peak_bytes"] / (n * v * 2)} for r in rows])


def _print(rows: list[dict], shape: str) -> None:
    print(f"| {shape} | method | ms | x bound / x matmuls | peak x logits | peak GiB |")
    print("|---|---|---|---|---|---|")
    matmuls = next(
        (r["seconds"] for r in rows if r["shape"] == shape and r["method"] == "matmuls"),
        float("nan"),  # left out with --skip
    )
    for r in (r for r in rows if r["shape"] == shape):
        ratio = r["seconds"] / (r["bound_s"] if r["kind"] == "op" else matmuls)
        print(
            f"| {r['kind']} | {r['method']} | {r['seconds'] * 1e3:.2f} | {ratio:.2f} | "
            f"{r['peak_x_logits']:.2f} | {r['peak_bytes'] / 2**30:.2f} |",
            flush=True,
        )
    print()
