"""Triton kernels of :mod:`reco_megatron.parallel.vocab_stats`: one read of the logits per pass.

Forward (``_stats_forward``), one program per token row. The row's ``V_valid`` local columns
are read in tiles of ``ROWS x SUB`` logits, the tile viewed as ``ROWS`` sub-rows of ``SUB``
contiguous columns (``SUB`` = one 16-byte load per thread: 8 bf16/fp16, 4 fp32). Every
sub-row keeps its own *online* state (max ``m``, and relative to it ``S = sum e``,
``T = sum e d``, ``Q = sum e^2`` with ``d = (z - m) log2(e)``, ``e = 2^d = exp(z - m)``), so
the reductions of the main loop stay inside one thread: no shared memory, no barrier. When a
tile raises a sub-row's max from ``m`` to ``m'`` (``a = 2^((m - m') log2 e)``)::

    S' = a S,   T' = a (T + (m - m') log2(e) S),   Q' = a^2 Q

Two tiles per loop iteration (two 16-byte loads in flight per thread); the tiles before the
last pair are loaded without a mask, the last (partial) pair once, masked.
After the row, the ``ROWS`` states merge with the same rescaling into one (a block-wide
reduction, once per row), which is also how tensor-parallel shards combine (``_combine``).

``-inf`` logits (a masked vocabulary entry): ``d`` is clamped at ``-200`` (``2^-200`` is 0
in fp32, flushed), so such an entry adds exactly 0 to ``S``, ``T`` (``0 * -200``, never
``0 * -inf``) and ``Q``; a sub-row, a tile or a whole shard of ``-inf`` keeps ``m = -inf``,
``S = 0`` and rescales with a finite stand-in for its max. Its gradient is 0. (A row with
every logit ``-inf`` on every shard has no distribution: its statistics are not finite.)

With ``FINISH`` (no tensor parallelism) the epilogue writes the statistics themselves::

    logprob = (z_t - m) - log S,   entropy = log S - T/S,   sum_p2 = Q/S^2,   lse = m + log S

(``logprob = 0`` at ignored positions, ``target < 0``; ``NaN`` for a target at or above
``vocab_size``, the error signal that needs no host synchronisation). Otherwise it writes
this shard's ``m_local`` (twice: one copy is all-reduced in place) and ``[S, T, Q, z_t]``
(``T`` in natural units, ``z_t`` the raw target logit, 0 off-shard), then ``_combine``
rescales them to the all-reduced max and ``_finish`` turns the summed partials into the
statistics: three launches and two all-reduces per forward.

Backward (``_stats_backward``), one program per row walking its tiles, with ``p = exp(z - lse)``
and per-row scalars the program computes itself from the saved statistics and the upstream
gradients ``gL, gH, gQ`` (terms of an absent one compiled out)::

    dz = p (a - gH log p + 2 gQ p) + gL [v = t],   a = -gL - gH H - 2 gQ sum_p2

The main loop writes ``p (...)`` without the one-hot term; the target column is rewritten
once after a barrier (one scalar store per row). Padded columns (``>= V_valid``) get 0 in the
masked tail. The gradient may overwrite the logits (``INPLACE``): a program reads each tile
before it writes it, and reads the target logit before the loop.

Bytes moved per logit, for ``b``-byte logits (bf16/fp16: b = 2, fp32: 4): forward reads ``b``;
backward reads ``b`` and writes ``b``: ``3b`` in total (6 bytes for bf16), the minimum for an
op that must see every logit twice around the all-reduces and write its gradient. Per row a
few tens of bytes more. Accumulation is fp32 (fp64 logits are the eager path's job). SASS
instructions per logit, registers and occupancy on sm_90: ``benchmarks/kernel_sass.py``.

The launchers, block sizes and the ``@triton.jit`` wrapping (at the first launch, so that
``TRITON_INTERPRET=1`` set by then runs these kernels on CPU tensors through Triton's
interpreter) live in :mod:`vocab_stats_triton`. This module imports without Triton (the
kernels are plain functions until then). Only APIs present in Triton 3.6 are used.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

try:
    import triton.language as tl
except ImportError:  # torch's CPU-only wheels do not pull Triton
    tl = None  # type: ignore[assignment]

if tl is not None:
    _LOG2E = tl.constexpr(1.4426950408889634)
    _LN2 = tl.constexpr(0.6931471805599453)
    _D_MIN = tl.constexpr(-200.0)  # base-2 floor of z - m: 2^-200 is 0 in fp32


def _online_update(z1, z2, m, s, t, q):
    """Fold two tiles ``z [ROWS, SUB]`` (fp32, ``-inf`` allowed) into the sub-row states."""
    m_new = tl.maximum(m, _max(tl.maximum(z1, z2), 1))
    m_safe = tl.where(m_new > -float("inf"), m_new, 0.0)
    shift = (m - m_safe) * _LOG2E  # -inf while a sub-row has seen only -inf (then s = 0)
    alpha = tl.exp2(shift)
    m2 = (m_safe * _LOG2E)[:, None]
    d1 = tl.maximum(z1 * _LOG2E - m2, _D_MIN)
    d2 = tl.maximum(z2 * _LOG2E - m2, _D_MIN)
    e1 = tl.exp2(d1)
    e2 = tl.exp2(d2)
    t = alpha * (t + tl.where(s > 0.0, shift, 0.0) * s) + _sum(e1 * d1 + e2 * d2, 1)
    s = alpha * s + _sum(e1 + e2, 1)
    q = alpha * alpha * q + _sum(e1 * e1 + e2 * e2, 1)
    return m_new, s, t, q


def _stats_forward(
    logits_ptr,
    row_stride,
    target_ptr,
    vocab_start,
    n_valid,
    vocab_size,
    out0_ptr,
    out1_ptr,
    out2_ptr,
    out3_ptr,
    out4_ptr,
    n_rows,
    ROWS: tl.constexpr,
    SUB: tl.constexpr,
    FINISH: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * row_stride
    offsets = tl.arange(0, ROWS)[:, None] * SUB + tl.arange(0, SUB)[None, :]
    m = tl.full([ROWS], -float("inf"), tl.float32)
    s = tl.zeros([ROWS], tl.float32)
    t = tl.zeros([ROWS], tl.float32)
    q = tl.zeros([ROWS], tl.float32)
    n_full = n_valid - n_valid % (2 * ROWS * SUB)
    for start in range(0, n_full, 2 * ROWS * SUB):  # unmasked, two tiles at a time
        z1 = tl.load(base + start + offsets).to(tl.float32)
        z2 = tl.load(base + start + ROWS * SUB + offsets).to(tl.float32)
        m, s, t, q = _online_update(z1, z2, m, s, t, q)
    if n_full < n_valid:  # the partial last pair of tiles, masked
        c1 = n_full + offsets
        c2 = c1 + ROWS * SUB
        z1 = tl.load(base + c1, mask=c1 < n_valid, other=-float("inf")).to(tl.float32)
        z2 = tl.load(base + c2, mask=c2 < n_valid, other=-float("inf")).to(tl.float32)
        m, s, t, q = _online_update(z1, z2, m, s, t, q)
    # Merge the sub-rows: the same rescaling as across tensor-parallel shards.
    m_row = _max(m, 0)
    m_safe = tl.where(m_row > -float("inf"), m_row, 0.0)
    shift = (m - m_safe) * _LOG2E
    w = tl.exp2(shift)
    s_row = _sum(w * s, 0)
    t_row = _sum(w * (t + tl.where(s > 0.0, shift, 0.0) * s), 0) * _LN2
    q_row = _sum(w * w * q, 0)

    tgt = tl.load(target_ptr + row)
    local = tgt - vocab_start
    in_shard = (tgt >= 0) & (local >= 0) & (local < n_valid)
    z_t = tl.load(base + local, mask=in_shard, other=0.0).to(tl.float32)
    z_t = tl.where(tgt >= vocab_size, float("nan"), z_t)  # out of range: NaN, no host sync
    if FINISH:
        log_s = tl.log(s_row)
        logprob = tl.where(tgt < 0, 0.0, z_t - m_row - log_s)
        tl.store(out0_ptr + row, logprob)
        tl.store(out1_ptr + row, log_s - t_row / s_row)
        tl.store(out2_ptr + row, q_row / (s_row * s_row))
        tl.store(out3_ptr + row, m_row + log_s)
    else:
        tl.store(out0_ptr + row, m_row)  # m_local
        tl.store(out1_ptr + row, m_row)  # all-reduced (MAX) in place into the global max
        tl.store(out2_ptr + row, s_row)  # out2 is [4, N]: S, T, Q, z_t
        tl.store(out2_ptr + n_rows + row, t_row)
        tl.store(out2_ptr + 2 * n_rows + row, q_row)
        tl.store(out2_ptr + 3 * n_rows + row, z_t)


def _combine(
    local_max_ptr,
    max_ptr,
    part_ptr,
    target_ptr,
    vocab_start,
    n_valid,
    n_rows,
    BLOCK: tl.constexpr,
):
    """Rescale ``[4, N]`` partials from the shard's max to the global one, in place."""
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = rows < n_rows
    m_l = tl.load(local_max_ptr + rows, mask=ok, other=0.0)
    m = tl.load(max_ptr + rows, mask=ok, other=0.0)
    s = tl.load(part_ptr + rows, mask=ok, other=0.0)
    t = tl.load(part_ptr + n_rows + rows, mask=ok, other=0.0)
    q = tl.load(part_ptr + 2 * n_rows + rows, mask=ok, other=0.0)
    z_t = tl.load(part_ptr + 3 * n_rows + rows, mask=ok, other=0.0)
    has = s > 0.0
    shift = tl.where(has, m_l - m, 0.0)
    r = tl.where(has, tl.exp(shift), 0.0)
    tgt = tl.load(target_ptr + rows, mask=ok, other=-1)
    local = tgt - vocab_start
    owner = (tgt >= 0) & (local >= 0) & (local < n_valid)
    tl.store(part_ptr + rows, s * r, mask=ok)
    tl.store(part_ptr + n_rows + rows, r * (t + shift * s), mask=ok)
    tl.store(part_ptr + 2 * n_rows + rows, q * r * r, mask=ok)
    tl.store(part_ptr + 3 * n_rows + rows, z_t - tl.where(owner, m, 0.0), mask=ok)


def _finish(
    part_ptr,
    max_ptr,
    target_ptr,
    logprob_ptr,
    entropy_ptr,
    sum_p2_ptr,
    lse_ptr,
    n_rows,
    BLOCK: tl.constexpr,
):
    """Statistics from the summed ``[4, N]`` partials relative to the global max."""
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = rows < n_rows
    s = tl.load(part_ptr + rows, mask=ok, other=1.0)
    t = tl.load(part_ptr + n_rows + rows, mask=ok, other=0.0)
    q = tl.load(part_ptr + 2 * n_rows + rows, mask=ok, other=0.0)
    z_rel = tl.load(part_ptr + 3 * n_rows + rows, mask=ok, other=0.0)
    m = tl.load(max_ptr + rows, mask=ok, other=0.0)
    tgt = tl.load(target_ptr + rows, mask=ok, other=-1)
    log_s = tl.log(s)
    tl.store(logprob_ptr + rows, tl.where(tgt < 0, 0.0, z_rel - log_s), mask=ok)
    tl.store(entropy_ptr + rows, log_s - t / s, mask=ok)
    tl.store(sum_p2_ptr + rows, q / (s * s), mask=ok)
    tl.store(lse_ptr + rows, m + log_s, mask=ok)


def _tile_gradient(z, lse2, a, gh2, gq2, HAS_ENTROPY: tl.constexpr, HAS_SUM_P2: tl.constexpr):
    """``p (a - gH log p + 2 gQ p)`` of fp32 logits (``-inf`` gives 0); ``lse2 = lse log2 e``,
    ``gh2 = -gH ln 2`` (log p in base 2), ``gq2 = 2 gQ``."""
    lp2 = z * _LOG2E - lse2
    p = tl.exp2(lp2)
    coef = a
    if HAS_ENTROPY:
        coef = coef + gh2 * tl.maximum(lp2, _D_MIN)
    if HAS_SUM_P2:
        coef = coef + gq2 * p
    return p * coef


def _stats_backward(
    logits_ptr,
    row_stride,
    grad_ptr,
    grad_row_stride,
    target_ptr,
    lse_ptr,
    entropy_ptr,
    sum_p2_ptr,
    g_logprob_ptr,
    g_entropy_ptr,
    g_sum_p2_ptr,
    vocab_start,
    n_valid,
    n_cols,
    BLOCK: tl.constexpr,
    HAS_LOGPROB: tl.constexpr,
    HAS_ENTROPY: tl.constexpr,
    HAS_SUM_P2: tl.constexpr,
    INPLACE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    src = logits_ptr + row * row_stride
    dst = src if INPLACE else grad_ptr + row * grad_row_stride
    tgt = tl.load(target_ptr + row)
    local = tgt - vocab_start
    in_shard = (tgt >= 0) & (local >= 0) & (local < n_valid)
    lse2 = tl.load(lse_ptr + row) * _LOG2E
    a = 0.0
    g_t = 0.0
    gh2 = 0.0
    gq2 = 0.0
    if HAS_LOGPROB:  # an ignored position's logprob is the constant 0: no gradient
        g_t = tl.where(tgt >= 0, tl.load(g_logprob_ptr + row), 0.0)
        a = a - g_t
    if HAS_ENTROPY:
        g_h = tl.load(g_entropy_ptr + row)
        a = a - g_h * tl.load(entropy_ptr + row)
        gh2 = -g_h * _LN2
    if HAS_SUM_P2:
        gq2 = 2.0 * tl.load(g_sum_p2_ptr + row)
        a = a - gq2 * tl.load(sum_p2_ptr + row)
    z_t = tl.load(src + local, mask=in_shard, other=0.0).to(tl.float32)  # before any write
    offsets = tl.arange(0, BLOCK)
    n_full = n_valid - n_valid % BLOCK
    for start in range(0, n_full, BLOCK):  # unmasked
        z = tl.load(src + start + offsets).to(tl.float32)
        grad = _tile_gradient(z, lse2, a, gh2, gq2, HAS_ENTROPY, HAS_SUM_P2)
        tl.store(dst + start + offsets, grad.to(dst.dtype.element_ty))
    for start in range(n_full, n_cols, BLOCK):  # the partial tile and the padding, masked
        cols = start + offsets
        z = tl.load(src + cols, mask=cols < n_valid, other=-float("inf")).to(tl.float32)
        grad = _tile_gradient(z, lse2, a, gh2, gq2, HAS_ENTROPY, HAS_SUM_P2)
        tl.store(dst + cols, grad.to(dst.dtype.element_ty), mask=cols < n_cols)
    if HAS_LOGPROB:  # noqa: SIM102 (a compile-time flag around a run-time branch)
        if in_shard:  # the one-hot term: one scalar store, after every thread's tile stores
            tl.debug_barrier()
            grad_t = _tile_gradient(z_t, lse2, a, gh2, gq2, HAS_ENTROPY, HAS_SUM_P2) + g_t
            tl.store(dst + local, grad_t.to(dst.dtype.element_ty))


def _sum(x, axis: tl.constexpr):
    """``tl.sum(x, axis)``."""
    return tl.sum(x, axis=axis)


def _max(x, axis: tl.constexpr):
    """``tl.max(x, axis)``."""
    return tl.max(x, axis=axis)


def _interpreted_sum(x, axis):
    """``_sum`` for Triton's interpreter: ``tl.reduce`` with the combine function it runs
    as one numpy call (``tl.sum`` is a device function, which the interpreter re-patches
    ``triton.language`` for at every call: most of an interpreted test's time)."""
    return tl.reduce(x, axis, tl.standard._sum_combine)


def _interpreted_max(x, axis):
    """``_max`` for Triton's interpreter (see :func:`_interpreted_sum`)."""
    return tl.reduce(x, axis, tl.standard._elementwise_max)


KERNELS: dict[str, Callable[..., Any]] = {
    "forward": _stats_forward,
    "backward": _stats_backward,
    "combine": _combine,
    "finish": _finish,
}
"""The kernels' Python functions (``benchmarks/kernel_sass.py`` compiles them)."""
HELPERS: dict[str, Callable[..., Any]] = {
    "_online_update": _online_update,
    "_tile_gradient": _tile_gradient,
    "_sum": _sum,
    "_max": _max,
}
"""Device functions the kernels call (jitted into the module globals with the kernels)."""
INTERPRETED_HELPERS: dict[str, Callable[..., Any]] = {
    **HELPERS,
    "_sum": _interpreted_sum,
    "_max": _interpreted_max,
}
"""What the kernels call under Triton's interpreter: the same, run as plain Python."""
