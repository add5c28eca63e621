"""Per-chunk math of :mod:`reco_megatron.parallel.vocab_stats`, communication-free.

Two pure functions, each over one chunk of ``n`` tokens of the local vocabulary shard:
the forward partial sums and the backward gradient (the ``eager`` and ``compiled``
implementations; ``triton`` lives in :mod:`vocab_stats_triton`). They run either eagerly or compiled
with ``torch.compile`` (Triton on GPU, C++/OpenMP on CPU), which fuses the upcast, the
exponential and the reductions into one pass that reads the logits once: on CPU that is
~6x faster than eager (measured in ``docs/benchmarks.md``) at the price of a one-off
compile (~20 s on CPU, cached on disk by inductor afterwards).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch

SHIFT_MIN = -1000.0
"""Floor of ``z - m`` and ``log p`` in the eager math: ``exp(-1000)`` is exactly 0 in fp32 and
fp64, so the floor changes no exponential, but a ``-inf`` logit (a masked vocabulary entry)
then adds ``0 * -1000 = 0`` to ``T`` and to the entropy gradient instead of ``0 * -inf = NaN``."""

Implementation = Literal["auto", "eager", "compiled", "triton"]
IMPLEMENTATIONS = ("auto", "eager", "compiled", "triton")


def triton_available() -> bool:
    """Whether Triton can be imported (it comes with torch's CUDA wheels)."""
    import importlib.util

    return importlib.util.find_spec("triton") is not None


def resolve(implementation: str, logits: torch.Tensor) -> str:
    """The concrete implementation ``auto`` stands for, for these logits.

    ``auto``: the Triton kernels on CUDA when Triton imports and the dtype is bf16/fp16/fp32,
    else ``compiled`` on CUDA; ``eager`` on CPU (no compile time, the reference).
    """
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"implementation must be one of {', '.join(map(repr, IMPLEMENTATIONS))}, "
            f"got {implementation!r}"
        )
    if implementation != "auto":
        return implementation
    if logits.device.type != "cuda":
        return "eager"
    supported = logits.dtype in (torch.bfloat16, torch.float16, torch.float32)
    return "triton" if supported and triton_available() else "compiled"


def forward_partials(
    logits: torch.Tensor,
    logits_max: torch.Tensor,
    safe_target: torch.Tensor,
    in_shard: torch.Tensor,
) -> torch.Tensor:
    """Local partial sums of one chunk.

    Args:
        logits: ``[n, V_valid]`` in the input dtype (valid columns only).
        logits_max: ``[n]`` global max over the vocabulary (compute dtype).
        safe_target: ``[n]`` local column of the target (0 where it is not in this shard).
        in_shard: ``[n]`` whether the target column lives in this shard.

    Returns:
        ``[n, 4]`` in the compute dtype: ``S = sum e``, ``T = sum e (z - m)``,
        ``Q = sum e^2`` and ``z_t - m`` (0 off-shard), with ``e = exp(z - m)``.
    """
    shifted = logits.to(logits_max.dtype) - logits_max.unsqueeze(-1)
    picked = shifted.gather(-1, safe_target.unsqueeze(-1)).squeeze(-1)  # -inf stays -inf
    shifted = shifted.clamp(min=SHIFT_MIN)
    exp = shifted.exp()
    return torch.stack(
        [
            exp.sum(-1),
            torch.linalg.vecdot(exp, shifted),
            torch.linalg.vecdot(exp, exp),
            torch.where(in_shard, picked, torch.zeros_like(picked)),
        ],
        dim=-1,
    )


def backward_grad(
    logits: torch.Tensor,
    lse: torch.Tensor,
    entropy: torch.Tensor,
    sum_p2: torch.Tensor,
    safe_target: torch.Tensor,
    in_shard: torch.Tensor,
    g_logprob: torch.Tensor | None,
    g_entropy: torch.Tensor | None,
    g_sum_p2: torch.Tensor | None,
) -> torch.Tensor:
    """Gradient of one chunk w.r.t. its logits, in the logits' dtype.

    With upstream gradients ``gL, gH, gQ`` (any may be None, meaning zero) and
    ``p = exp(z - lse)``:

        dz = gL (onehot - p) - gH p (log p + H) + 2 gQ p (p - Q)
           = p * (a - gH log p + 2 gQ p) + gL onehot,   a = -gL - gH H - 2 gQ Q

    Shapes: ``logits [n, V_valid]``, every other tensor ``[n]``.
    """
    a = gradient_coefficient(lse, entropy, sum_p2, g_logprob, g_entropy, g_sum_p2)
    # In-place updates of fresh temporaries keep eager mode at two fp32 chunk buffers;
    # torch.compile turns the same code into one fused pass.
    logp = (logits.to(lse.dtype) - lse.unsqueeze(-1)).clamp_(min=SHIFT_MIN)
    if g_entropy is None:
        p = logp.exp_()
        if g_sum_p2 is None:
            grad = p.mul_(a.unsqueeze(-1))
        else:
            grad = torch.addcmul(a.unsqueeze(-1), p, (2.0 * g_sum_p2).unsqueeze(-1)).mul_(p)
    else:
        p = logp.exp()
        grad = logp.mul_(-g_entropy.unsqueeze(-1)).add_(a.unsqueeze(-1))
        if g_sum_p2 is not None:
            grad.addcmul_(p, (2.0 * g_sum_p2).unsqueeze(-1))
        grad.mul_(p)
    if g_logprob is not None:
        onehot = torch.where(in_shard, g_logprob, torch.zeros_like(g_logprob))
        grad.scatter_add_(-1, safe_target.unsqueeze(-1), onehot.unsqueeze(-1))
    return grad.to(logits.dtype)


def gradient_coefficient(
    lse: torch.Tensor,
    entropy: torch.Tensor,
    sum_p2: torch.Tensor,
    g_logprob: torch.Tensor | None,
    g_entropy: torch.Tensor | None,
    g_sum_p2: torch.Tensor | None,
) -> torch.Tensor:
    """Per-token ``a = -gL - gH H - 2 gQ sum_p2`` of the gradient (absent terms left out)."""
    a = torch.zeros_like(lse)
    if g_logprob is not None:
        a = a - g_logprob
    if g_entropy is not None:
        a = a - g_entropy * entropy
    if g_sum_p2 is not None:
        a = a - 2.0 * g_sum_p2 * sum_p2
    return a


_COMPILED: dict[str, Callable[..., torch.Tensor]] = {}


def kernels(implementation: str) -> tuple[Callable[..., torch.Tensor], Callable[..., torch.Tensor]]:
    """The (forward, backward) chunk functions of ``eager`` or ``compiled`` (resolved)."""
    if implementation == "eager":
        return forward_partials, backward_grad
    if not _COMPILED:
        _COMPILED["forward"] = torch.compile(forward_partials, dynamic=True)
        _COMPILED["backward"] = torch.compile(backward_grad, dynamic=True)
    return _COMPILED["forward"], _COMPILED["backward"]
