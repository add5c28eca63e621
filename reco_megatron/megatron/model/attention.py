"""Core attention on torch's fused kernels, for megatron's local layer spec (no
transformer-engine), and the choice of attention (``model.attention_backend``).

:class:`TorchDotProductAttention` is what megatron-core's ``SelfAttention`` calls as its
``core_attention`` in place of megatron's local ``DotProductAttention`` whenever the model runs
without transformer-engine (``model.attention_backend`` ``auto`` or ``torch``). It keeps that
class's constructor, its call (``core_attention(query, key, value, attention_mask,
attn_mask_type=..., attention_bias=None, packed_seq_params=...)``) and its conventions: tensors
``[s, b, heads/TP, d]`` in, ``[s, b, heads/TP * d]`` out; the heads are those of this
tensor-parallel rank (megatron splits them, sequence parallelism has gathered the sequence
before the QKV projection, so nothing here communicates); softmax scale ``softmax_scale`` or
``1/sqrt(kv_channels)`` (``apply_query_key_layer_scaling`` divides the scores by the layer
number and multiplies them back inside the softmax, so the net scale is the same); a causal
mask unless megatron passes a mask of its own (``True`` = masked out) or ``no_mask`` (decode
steps with a KV cache). Where the query is shorter than the keys (a decode step), the causal
diagonal is aligned to the last key, as megatron's cache expects.

What runs, by the batch's layout:

* **Padded rows** (``[s, b, h, d]``): ``torch.nn.functional.scaled_dot_product_attention`` with
  ``is_causal`` and ``enable_gqa=True``: the key/value heads are shared by their query group
  inside the kernel, never copied (megatron's local attention ``repeat_interleave``-s them).
  On CUDA that is FlashAttention-2 / cuDNN / the memory-efficient kernel, on the CPU torch's
  fused flash kernel (fp32, fp64, bf16): the ``[b, h, s, s]`` scores never exist, and what
  autograd keeps is linear in ``s`` (``benchmarks/activation_memory.py``).
* **Packed rows** (THD, ``packed_seq_params.qkv_format == "thd"``: ``[T, h, d]``, segments
  ``cu_seqlens``): on CUDA, ``torch.nn.attention.varlen.varlen_attn`` (FlashAttention over
  ``cu_seqlens``, causal, GQA) when this torch has it with ``window_size`` and ``enable_gqa``
  and the tensors are bf16/fp16 (FlashAttention's dtypes); otherwise, and on the CPU, one
  fused SDPA call per segment (a loop over ``cu_seqlens``). Why the loop and not a
  document-causal FlexAttention block mask: FlexAttention runs only compiled (Triton on GPU,
  Inductor on CPU); on the CPU every new packed length compiles again (tens of seconds per
  shape on two cores, and the token-budget rows change length every micro-batch), where the
  loop costs one kernel launch per sequence, is exact, and keeps memory linear in the row
  length (each segment's fused kernel is linear in its length). On a GPU the loop is the
  fallback only: it reads ``cu_seqlens`` on the host, one sync per layer (megatron's own
  unfused THD RoPE already reads them there), and is logged once with its reason.

Not supported here, each refused with one line naming the fix: context parallelism (needs
transformer-engine's attention), attention dropout, sliding windows, non-vanilla softmax,
an attention bias. :func:`resolve_attention_backend` chooses between ``te``, ``torch`` and
``local``.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import math
from typing import Any, Literal

import torch
import torch.nn.functional as F

from reco_megatron.utils.logging import get_logger

logger = get_logger(__name__)

AttentionBackend = Literal["auto", "te", "torch", "local"]
ATTENTION_BACKENDS: tuple[str, ...] = ("auto", "te", "torch", "local")
_DESCRIPTION = {
    "te": "transformer-engine's fused attention (TE layer spec)",
    "torch": "torch's fused kernels (scaled_dot_product_attention; packed rows: {packed})",
    "local": "megatron's unfused local DotProductAttention ([b, h, s, s] scores)",
}
_announced: set[str] = set()


def transformer_engine_importable() -> bool:
    """Whether ``import transformer_engine`` works here."""
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def resolve_attention_backend(requested: str, on_gpu: bool, te_importable: bool) -> str:
    """``te``, ``torch`` or ``local`` for ``model.attention_backend=requested``.

    ``auto`` is ``te`` on a GPU where transformer-engine imports, else ``torch``; ``te`` is
    refused (one line) where it cannot run."""
    if requested not in ATTENTION_BACKENDS:
        raise ValueError(
            f"model.attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, got "
            f"{requested!r}"
        )
    if requested == "auto":
        return "te" if on_gpu and te_importable else "torch"
    if requested == "te" and not (on_gpu and te_importable):
        where = "transformer-engine is not importable" if on_gpu else "the model runs on CPU"
        raise ValueError(
            f"model.attention_backend=te but {where}: use 'auto' or 'torch' (torch's fused "
            "attention), or install transformer-engine on a GPU"
        )
    return requested


def announce(backend: str, on_gpu: bool, dtype: torch.dtype, groups_ratio: int) -> None:
    """Log once per process which attention runs (the start-up line)."""
    if backend in _announced:
        return
    _announced.add(backend)
    why = varlen_reason(on_gpu, dtype, groups_ratio)
    packed = "varlen_attn" if why is None else f"one fused SDPA call per sequence ({why})"
    logger.info("attention: %s, %s", backend, _DESCRIPTION[backend].format(packed=packed))


@functools.cache
def _varlen_signature() -> tuple[str, ...] | str:
    """The keyword parameters of this torch's ``varlen_attn``, or why it is not there."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return f"torch {torch.__version__} has no torch.nn.attention.varlen.varlen_attn"
    return tuple(inspect.signature(varlen_attn).parameters)


def varlen_reason(on_cuda: bool, dtype: torch.dtype, groups_ratio: int) -> str | None:
    """None when ``varlen_attn`` runs packed rows here, else why not (one line)."""
    if not on_cuda:
        return "varlen_attn needs CUDA"
    if dtype not in (torch.bfloat16, torch.float16):
        return f"varlen_attn (FlashAttention) takes bf16/fp16, the model runs {dtype}"
    params = _varlen_signature()
    if isinstance(params, str):
        return params
    if "window_size" not in params or "enable_gqa" not in params:
        if "is_causal" in params and groups_ratio == 1:
            return None
        return (
            f"torch {torch.__version__}'s varlen_attn has no window_size/enable_gqa "
            "(causal grouped-query attention)"
        )
    return None


def _causal_mask(sq: int, sk: int, device: torch.device) -> torch.Tensor:
    """``[sq, sk]`` bool, True where query ``i`` may see key ``j``: the diagonal aligned to
    the last key (``j <= i + sk - sq``)."""
    i = torch.arange(sq, device=device)[:, None]
    j = torch.arange(sk, device=device)[None, :]
    return j <= i + (sk - sq)


class TorchDotProductAttention(torch.nn.Module):
    """megatron's ``core_attention`` on torch's fused kernels (module docstring).

    Built by megatron's ``SelfAttention`` with ``DotProductAttention``'s arguments.
    """

    def __init__(
        self,
        config: Any,
        layer_number: int,
        attn_mask_type: Any,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: Any = None,
    ) -> None:
        super().__init__()
        from megatron.core.process_groups_config import ProcessGroupCollection

        self.config = config
        if config.context_parallel_size > 1:
            raise ValueError(
                f"context_parallel_size={config.context_parallel_size} needs transformer-"
                "engine's attention: set it to 1, or model.attention_backend=te on a GPU with TE"
            )
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        unsupported = {
            "attention dropout": dropout > 0,
            "a sliding window": getattr(config, "window_size", None) is not None,
            "a non-vanilla softmax": getattr(config, "softmax_type", "vanilla") != "vanilla",
        }
        for what, present in unsupported.items():
            if present:
                raise ValueError(
                    f"model.attention_backend=torch does not implement {what}: use "
                    "model.attention_backend=local (or te)"
                )
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
        tp = pg_collection.tp.size()
        self.heads = config.num_attention_heads // tp
        """Query heads of this tensor-parallel rank."""
        self.groups = config.num_query_groups // tp
        """Key/value heads of this rank."""
        self.softmax_scale = (
            softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)
        )
        self._warned = False

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: Any = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: Any = None,
    ) -> torch.Tensor:
        """``query [sq, b, heads, d]``, ``key``/``value [sk, b, groups, d]`` -> ``[sq, b,
        heads * d]``; packed (THD): ``[T, heads, d]`` / ``[T, groups, d]`` -> ``[T, heads *
        d]``."""
        if attention_bias is not None:
            raise ValueError("an attention bias needs model.attention_backend=local or te")
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        causal = attention_mask is None and "causal" in getattr(mask_type, "name", "")
        if packed_seq_params is not None:
            return self._packed(query, key, value, packed_seq_params, causal)
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # [b, h, s, d]
        mask = None
        if attention_mask is not None:
            mask = ~attention_mask  # megatron: True = masked out; SDPA: True = attend
        elif causal and q.size(2) != k.size(2):
            mask = _causal_mask(q.size(2), k.size(2), q.device)
            causal = False
        out = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            is_causal=causal,
            scale=self.softmax_scale,
            enable_gqa=self.heads != self.groups,
        )  # [b, heads, sq, d]
        sq, b = query.shape[:2]
        return out.permute(2, 0, 1, 3).reshape(sq, b, -1)

    def _packed(self, query, key, value, params, causal: bool) -> torch.Tensor:
        """THD: ``[T, h, d]`` with segments ``cu_seqlens`` -> ``[T, heads * d]``."""
        if getattr(params, "qkv_format", "thd") != "thd":
            raise ValueError(f"packed_seq_params.qkv_format={params.qkv_format!r}: only 'thd'")
        cu_q = getattr(params, "cu_seqlens_q_padded", None)
        cu_q = params.cu_seqlens_q if cu_q is None else cu_q
        cu_k = getattr(params, "cu_seqlens_kv_padded", None)
        cu_k = params.cu_seqlens_kv if cu_k is None else cu_k
        if cu_k is not cu_q and not torch.equal(cu_k, cu_q):
            raise ValueError("packed self-attention needs cu_seqlens_q == cu_seqlens_kv")
        ratio = self.heads // self.groups
        why = varlen_reason(query.is_cuda, query.dtype, ratio)
        if why is None:
            return self._varlen(query, key, value, cu_q, params, causal, ratio)
        if query.is_cuda and not self._warned:
            self._warned = True
            logger.warning("packed rows: one SDPA call per sequence, not varlen_attn: %s", why)
        outs = []
        bounds = cu_q.tolist()
        for s, e in itertools.pairwise(bounds):
            if e == s:
                continue
            q, k, v = (x[s:e].transpose(0, 1).unsqueeze(0) for x in (query, key, value))
            out = F.scaled_dot_product_attention(
                q, k, v, is_causal=causal, scale=self.softmax_scale, enable_gqa=ratio > 1
            )  # [1, heads, n, d]
            outs.append(out[0].transpose(0, 1))
        return torch.cat(outs).reshape(query.size(0), -1)

    def _varlen(self, query, key, value, cu, params, causal: bool, ratio: int) -> torch.Tensor:
        """Packed rows through ``varlen_attn`` (CUDA, bf16/fp16)."""
        from torch.nn.attention.varlen import varlen_attn

        cu = cu.to(device=query.device, dtype=torch.int32)
        longest = getattr(params, "max_seqlen_q", None)
        if longest is None:
            longest = int((cu[1:] - cu[:-1]).max())
        kwargs: dict[str, Any] = {"scale": self.softmax_scale}
        if "window_size" in _varlen_signature():
            kwargs.update(window_size=(-1, 0) if causal else (-1, -1), enable_gqa=ratio > 1)
        else:
            kwargs["is_causal"] = causal
        out = varlen_attn(query, key, value, cu, cu, int(longest), int(longest), **kwargs)
        return out.reshape(query.size(0), -1)
