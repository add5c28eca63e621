"""Host side of the Triton statistics kernels: launchers, block sizes, the jit wrapping.

The kernels and their math (tiling, online rescaling, ``-inf`` handling, bytes per logit)
are in :mod:`vocab_stats_triton_kernels`. ``forward`` reads a shard once and gives its
statistics (no tensor parallelism: one launch) or its partials; ``combine`` and ``finish``
turn all-reduced partials into statistics (tensor parallelism); ``gradient`` writes the
shard's gradient (one launch), optionally over the logits.

Triton is imported by this module (optional: without it the module still imports and
:func:`check_device` says what is missing), which :mod:`vocab_stats_passes` imports only when
the ``triton`` implementation runs. The ``@triton.jit`` wrapping happens at the first launch,
so that ``TRITON_INTERPRET=1`` set by then (e.g. in a freshly started test rank) runs the
kernels on CPU tensors through Triton's interpreter. Only APIs present in Triton 3.6 are used.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from reco_megatron.parallel import vocab_stats_triton_kernels as device_code
from reco_megatron.parallel.vocab_stats_triton_kernels import (
    HELPERS,
    INTERPRETED_HELPERS,
    KERNELS,
)

try:
    import triton
except ImportError:  # torch's CPU-only wheels do not pull Triton; check_device says so
    triton = None  # type: ignore[assignment]

FORWARD_ROWS = 256
"""Sub-rows per forward tile: one per thread at ``NUM_WARPS = 8`` (tile = 2048 bf16 logits)."""
BACKWARD_BLOCK = 2048
"""Columns per backward tile: one 16-byte load per thread for bf16 at ``NUM_WARPS = 8``."""
VECTOR_BYTES = 16
"""Bytes per thread and load: a forward sub-row is ``VECTOR_BYTES / element size`` columns."""
NUM_WARPS = 8
"""Warps per program on GPU."""
COMBINE_BLOCK = 1024
"""Rows per program of the [N]-sized combine / finish kernels."""

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

LAUNCHES = {"count": 0}
"""Triton kernel launches so far (``benchmarks/kernel_sass.py`` counts them)."""

_JITTED: dict[str, Any] = {}


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def jit_all() -> dict[str, Any]:
    """The jitted kernels (interpreted when ``TRITON_INTERPRET`` is set at first use)."""
    mode = _interpreting()
    if _JITTED.get("mode") != mode:
        # The kernels find their helpers in the kernels module's globals when they are
        # compiled: jitted device functions there. The interpreter runs them as plain Python
        # inside the (already patched) kernel instead: a jitted device function would re-patch
        # triton.language at every call, which dominates the interpreted run time.
        if mode:
            helpers = INTERPRETED_HELPERS
        else:
            helpers = {name: triton.jit(fn) for name, fn in HELPERS.items()}
        vars(device_code).update(helpers)
        _JITTED.update(mode=mode, kernels={n: triton.jit(fn) for n, fn in KERNELS.items()})
    return _JITTED["kernels"]


def check_device(logits: torch.Tensor) -> None:
    """Raise unless the kernels can run on ``logits`` (CUDA, or CPU under the interpreter)."""
    if triton is None:
        raise ImportError(
            "implementation='triton' needs Triton, which torch's CUDA wheels install (pip "
            "install triton); use implementation='eager' or 'compiled' without it"
        )
    if logits.dtype not in SUPPORTED_DTYPES:
        raise TypeError(
            f"implementation='triton' takes bf16, fp16 or fp32 logits, got {logits.dtype}; "
            "use implementation='eager' (fp64 reference)"
        )
    if logits.device.type != "cuda" and not _interpreting():
        raise ValueError(
            f"implementation='triton' needs CUDA logits, got {logits.device}; on CPU use "
            "'eager', or set TRITON_INTERPRET=1 before the first launch (Triton's interpreter)"
        )


def _launch(name: str, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> None:
    LAUNCHES["count"] += 1
    kernel = jit_all()[name][grid]
    if not _interpreting():
        kernel(*args, **kwargs, num_warps=NUM_WARPS)
        return
    # Triton's interpreter emulates the kernel with torch/numpy copies: keep them out of a
    # dispatch mode that counts what the op launches (a GPU launch dispatches no torch op).
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():
        kernel(*args, **kwargs)


def forward_sub_row(dtype: torch.dtype) -> int:
    """Columns per forward sub-row: one 16-byte load (8 bf16/fp16, 4 fp32)."""
    return VECTOR_BYTES // torch.empty((), dtype=dtype).element_size()


def forward(
    logits: torch.Tensor,
    target: torch.Tensor,
    vocab_start: int,
    n_valid: int,
    vocab_size: int,
    finish: bool,
) -> tuple[torch.Tensor, ...]:
    """One read of the shard: its statistics (``finish``) or its partials.

    Args:
        logits: ``[N, V_local]``, last dimension contiguous (bf16, fp16 or fp32).
        target: ``[N]`` global token ids (int32 or int64; ``< 0`` ignored).
        vocab_start: global id of local column 0; ``n_valid``: local columns that are real
            vocabulary (the rest is padding); ``vocab_size``: the true vocabulary size.
        finish: the shard is the whole vocabulary (no tensor parallelism).

    Returns:
        ``finish``: ``logprob, entropy, sum_p2, lse``, each ``[N]`` fp32. Else
        ``m_local [N]``, ``m [N]`` (a copy of ``m_local`` to all-reduce with MAX) and
        ``[4, N]`` fp32 ``S, T, Q`` relative to ``m_local`` and the raw target logit (0 off
        the shard, NaN for an id ``>= vocab_size``).
    """
    n_rows = logits.shape[0]
    new = [torch.empty(n_rows, dtype=torch.float32, device=logits.device) for _ in range(4)]
    part = torch.empty(4, n_rows, dtype=torch.float32, device=logits.device)
    outs = (*new, part) if finish else (new[0], new[1], part, new[2], new[3])
    if n_rows:
        _launch(
            "forward",
            (n_rows,),
            logits,
            logits.stride(0),
            target,
            vocab_start,
            n_valid,
            vocab_size,
            *outs,
            n_rows,
            ROWS=FORWARD_ROWS,
            SUB=forward_sub_row(logits.dtype),
            FINISH=finish,
        )
    return tuple(new) if finish else (new[0], new[1], part)


def combine(
    local_max: torch.Tensor,
    global_max: torch.Tensor,
    part: torch.Tensor,
    target: torch.Tensor,
    vocab_start: int,
    n_valid: int,
) -> None:
    """Rescale ``part [4, N]`` in place from ``local_max`` to ``global_max`` (all ``[N]``);
    the target logit becomes ``z_t - m`` on the shard that owns it."""
    n_rows = part.shape[1]
    grid = (triton.cdiv(n_rows, COMBINE_BLOCK),)
    args = (local_max, global_max, part, target, vocab_start, n_valid, n_rows)
    if n_rows:
        _launch("combine", grid, *args, BLOCK=COMBINE_BLOCK)


def finish(
    part: torch.Tensor, global_max: torch.Tensor, target: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """``logprob, entropy, sum_p2, lse`` (each ``[N]`` fp32) from the summed ``[4, N]``."""
    n_rows = part.shape[1]
    new = [torch.empty(n_rows, dtype=torch.float32, device=part.device) for _ in range(4)]
    if n_rows:
        grid = (triton.cdiv(n_rows, COMBINE_BLOCK),)
        _launch("finish", grid, part, global_max, target, *new, n_rows, BLOCK=COMBINE_BLOCK)
    return tuple(new)


def gradient(
    logits: torch.Tensor,
    target: torch.Tensor,
    vocab_start: int,
    n_valid: int,
    lse: torch.Tensor,
    entropy: torch.Tensor,
    sum_p2: torch.Tensor,
    g_logprob: torch.Tensor | None,
    g_entropy: torch.Tensor | None,
    g_sum_p2: torch.Tensor | None,
    inplace: bool,
) -> torch.Tensor:
    """``d(loss)/d logits`` of one shard, in the logits' dtype, padded columns 0.

    ``logits [N, V_local]`` (last dimension contiguous; with ``inplace`` the result
    overwrites it, so its rows must not overlap), ``target [N]`` global ids, every other
    tensor ``[N]`` fp32 and contiguous. The per-row coefficient is computed in the kernel.
    """
    n_rows, n_cols = logits.shape
    grad = logits if inplace else torch.empty_like(logits)
    if n_rows == 0 or n_cols == 0:
        return grad
    given = [g for g in (g_logprob, g_entropy, g_sum_p2) if g is not None]
    dummy = given[0] if given else lse  # a pointer for absent upstream gradients (never read)
    _launch(
        "backward",
        (n_rows,),
        logits,
        logits.stride(0),
        grad,
        grad.stride(0),
        target,
        lse,
        entropy,
        sum_p2,
        dummy if g_logprob is None else g_logprob,
        dummy if g_entropy is None else g_entropy,
        dummy if g_sum_p2 is None else g_sum_p2,
        vocab_start,
        n_valid,
        n_cols,
        BLOCK=BACKWARD_BLOCK,
        HAS_LOGPROB=g_logprob is not None,
        HAS_ENTROPY=g_entropy is not None,
        HAS_SUM_P2=g_sum_p2 is not None,
        INPLACE=inplace,
    )
    return grad
