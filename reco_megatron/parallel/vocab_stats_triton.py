"""Triton kernels of :mod:`reco_megatron.parallel.vocab_stats`: one read of the logits per pass.

Tiling. One program per token row walks the row's ``V_valid`` local columns in tiles of
``FORWARD_BLOCK`` (the last tile masked), keeping an *online* max ``m`` and the partial sums
relative to it. With ``e_v = exp(z_v - m)``:

    S = sum e_v,   T = sum e_v (z_v - m),   Q = sum e_v^2

When a tile raises the max from ``m`` to ``m'`` (``a = exp(m - m')``) the sums so far are
rescaled before the tile's own terms are added:

    S' = a S,   T' = a (T + (m - m') S),   Q' = a^2 Q

(the ``T`` line: ``e' (z - m') = a e (z - m + m - m')``). The target logit ``z_t`` (a single
load, masked off when the target is not in this shard) is read raw. The kernel writes
``[m_local, S, T, Q, z_t]`` per row. Across tensor-parallel ranks the same rescaling combines
the shards (``vocab_stats_kernels.combine_partials``): one MAX all-reduce of ``m_local``
gives the global ``m``, each rank rescales its sums to it, and one SUM all-reduce of
``[N, 4]`` adds them.

The backward launches a 2-D grid (row, tile of ``BACKWARD_BLOCK`` columns) and writes, per
logit, with ``log p = z - lse`` and per-row scalars precomputed from the forward:

    dz = p (a - gH log p + 2 gQ p) + gL [v = t],   a = -gL - gH H - 2 gQ sum_p2

dropping the terms of an upstream gradient that is ``None`` (a compile-time flag). Padded
columns (at or above ``V_valid``) get a zero gradient in the same pass. The gradient may be
written into the logits buffer itself (``inplace``): each program reads its tile before it
writes the same tile, and no two programs share a tile.

Bytes moved per logit, for ``b``-byte logits (bf16/fp16: b = 2, fp32: 4): forward reads ``b``;
backward reads ``b`` and writes ``b``: ``3b`` in total (6 bytes for bf16), the minimum for an
op that must see every logit twice around the all-reduces and write its gradient. Per row the
forward writes 20 bytes and the backward reads ~24: negligible next to ``V/TP`` logits.
Accumulation is fp32 whatever the input dtype (fp64 logits are the eager path's job).

Triton is imported by this module (optional: without it the module still imports and
:func:`check_device` says what is missing), which :mod:`vocab_stats` imports only when the
``triton`` implementation runs. The ``@triton.jit`` wrapping happens at the first launch, so that
``TRITON_INTERPRET=1`` set by then (e.g. in a freshly started test rank) runs the kernels on
CPU tensors through Triton's interpreter. Only APIs present in Triton 3.6 are used.
"""

from __future__ import annotations

import os
from typing import Any

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # torch's CPU-only wheels do not pull Triton; check_device says so
    triton = None  # type: ignore[assignment]
    tl = None  # type: ignore[assignment]

FORWARD_BLOCK = 4096
"""Columns per forward tile (a power of two)."""
BACKWARD_BLOCK = 4096
"""Columns per backward program (a power of two)."""
NUM_WARPS = 8
"""Warps per program on GPU."""

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _stats_forward(
    logits_ptr,
    row_stride,
    target_ptr,
    out_ptr,
    n_valid,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * row_stride
    m = -float("inf")
    s = 0.0
    t = 0.0
    q = 0.0
    for start in range(0, n_valid, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_valid
        z = tl.load(base + cols, mask=mask, other=-float("inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(z, axis=0))
        alpha = tl.exp(m - m_new)  # 0 on the first tile (m = -inf)
        shift = tl.where(s > 0.0, m - m_new, 0.0)  # -inf * 0 avoided on the first tile
        d = tl.where(mask, z - m_new, 0.0)
        e = tl.where(mask, tl.exp(d), 0.0)
        t = alpha * (t + shift * s) + tl.sum(e * d, axis=0)
        s = alpha * s + tl.sum(e, axis=0)
        q = alpha * alpha * q + tl.sum(e * e, axis=0)
        m = m_new
    tgt = tl.load(target_ptr + row)  # local column, -1 when not in this shard or ignored
    z_t = tl.load(base + tl.maximum(tgt, 0), mask=tgt >= 0, other=0.0).to(tl.float32)
    out = out_ptr + row * 5
    tl.store(out, m)
    tl.store(out + 1, s)
    tl.store(out + 2, t)
    tl.store(out + 3, q)
    tl.store(out + 4, z_t)


def _stats_backward(
    logits_ptr,
    row_stride,
    grad_ptr,
    grad_row_stride,
    target_ptr,
    lse_ptr,
    a_ptr,
    g_logprob_ptr,
    g_entropy_ptr,
    g_sum_p2_ptr,
    n_valid,
    n_cols,
    BLOCK: tl.constexpr,
    HAS_LOGPROB: tl.constexpr,
    HAS_ENTROPY: tl.constexpr,
    HAS_SUM_P2: tl.constexpr,
    INPLACE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_row = cols < n_cols
    valid = cols < n_valid
    z = tl.load(logits_ptr + row * row_stride + cols, mask=valid, other=0.0).to(tl.float32)
    logp = z - tl.load(lse_ptr + row)
    p = tl.exp(logp)
    coef = tl.zeros([BLOCK], dtype=tl.float32) + tl.load(a_ptr + row)
    if HAS_ENTROPY:
        coef = coef - tl.load(g_entropy_ptr + row) * logp
    if HAS_SUM_P2:
        coef = coef + 2.0 * tl.load(g_sum_p2_ptr + row) * p
    grad = p * coef
    if HAS_LOGPROB:
        tgt = tl.load(target_ptr + row)
        grad = grad + tl.where(cols == tgt, tl.load(g_logprob_ptr + row), 0.0)
    grad = tl.where(valid, grad, 0.0)
    if INPLACE:
        dst = logits_ptr + row * row_stride + cols
    else:
        dst = grad_ptr + row * grad_row_stride + cols
    tl.store(dst, grad.to(dst.dtype.element_ty), mask=in_row)


_JITTED: dict[bool, dict[str, Any]] = {}


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def _kernel(name: str) -> Any:
    """The jitted kernel (interpreted when ``TRITON_INTERPRET`` is set at first use)."""
    mode = _interpreting()
    if mode not in _JITTED:
        _JITTED[mode] = {
            "forward": triton.jit(_stats_forward),
            "backward": triton.jit(_stats_backward),
        }
    return _JITTED[mode][name]


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


def _grid_launch(kernel: Any, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> None:
    if not _interpreting():
        kwargs["num_warps"] = NUM_WARPS
    kernel[grid](*args, **kwargs)


def local_partials(
    logits: torch.Tensor, target_local: torch.Tensor, n_valid: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """This shard's max and partial sums relative to it, reading every valid logit once.

    Args:
        logits: ``[N, V_local]``, last dimension contiguous (bf16, fp16 or fp32).
        target_local: ``[N]`` int64 local column of the target, -1 where it is not here.
        n_valid: the first ``n_valid`` columns are real vocabulary (the rest is padding).

    Returns:
        ``m_local [N]`` fp32 (``-inf`` when ``n_valid == 0``) and ``[N, 4]`` fp32
        ``S, T, Q`` relative to ``m_local`` and the raw target logit (0 off-shard).
    """
    n_tokens = logits.shape[0]
    out = torch.zeros(n_tokens, 5, dtype=torch.float32, device=logits.device)
    if n_valid == 0:
        out[:, 0] = float("-inf")
        return out[:, 0], out[:, 1:]
    block = min(FORWARD_BLOCK, triton.next_power_of_2(n_valid))
    _grid_launch(
        _kernel("forward"),
        (n_tokens,),
        logits,
        logits.stride(0),
        target_local,
        out,
        n_valid,
        BLOCK=block,
    )
    return out[:, 0], out[:, 1:]


def gradient(
    logits: torch.Tensor,
    target_local: torch.Tensor,
    lse: torch.Tensor,
    coef_a: torch.Tensor,
    g_logprob: torch.Tensor | None,
    g_entropy: torch.Tensor | None,
    g_sum_p2: torch.Tensor | None,
    n_valid: int,
    inplace: bool,
) -> torch.Tensor:
    """``d(loss)/d logits`` of one shard, in the logits' dtype, padded columns 0.

    ``logits [N, V_local]`` (last dimension contiguous), every other tensor ``[N]`` fp32
    (``target_local`` int64, -1 off-shard). ``coef_a = -gL - gH H - 2 gQ sum_p2`` with absent
    terms left out. With ``inplace`` the result is written into ``logits`` and returned.
    """
    n_tokens, n_cols = logits.shape
    grad = logits if inplace else torch.empty_like(logits)
    if n_tokens == 0 or n_cols == 0:
        return grad
    block = min(BACKWARD_BLOCK, triton.next_power_of_2(n_cols))
    dummy = lse  # a pointer argument for absent upstream gradients (never read)
    _grid_launch(
        _kernel("backward"),
        (n_tokens, triton.cdiv(n_cols, block)),
        logits,
        logits.stride(0),
        grad,
        grad.stride(0),
        target_local,
        lse,
        coef_a,
        dummy if g_logprob is None else g_logprob,
        dummy if g_entropy is None else g_entropy,
        dummy if g_sum_p2 is None else g_sum_p2,
        n_valid,
        n_cols,
        BLOCK=block,
        HAS_LOGPROB=g_logprob is not None,
        HAS_ENTROPY=g_entropy is not None,
        HAS_SUM_P2=g_sum_p2 is not None,
        INPLACE=inplace,
    )
    return grad
