"""The decoder's attention: a KV cache it owns, RoPE applied once, grouped queries without copies.

Everything here is plain torch on tensors the caller hands in (no megatron import), so one
code path runs eagerly on the CPU and inside a CUDA graph on the GPU:

* :class:`KVCache`: one tensor ``[layers, 2, rows, kv_heads, length, head_dim]`` per pipeline
  stage (keys and values of this stage's layers, this TP rank's heads), head-major so a group's
  keys of one row are contiguous ``[length, head_dim]``. A key is written once, already
  rotated, at its row and position (:meth:`KVCache.write`, an indexed write of the new
  positions only), and never touched again: a decode step writes ``rows x kv_heads x
  head_dim`` numbers per layer whatever the context length.
* :class:`RotaryTables`: ``cos``/``sin`` of megatron's own rotary frequencies
  (``GPTModel.rotary_pos_emb``), computed once, gathered per position, applied with megatron's
  formula (``t * cos + rotate_half(t) * sin``, the cast to the activation dtype included).
* :func:`grouped_attention`: the ``r = heads / kv_heads`` query heads of a group are stacked
  along the query axis, so one batched matmul per group reads that group's cached keys once
  (no ``repeat_interleave`` of K and V, which megatron's local attention does), with an
  additive mask that also gives every row its own length (:func:`causal_bias`).
"""

from __future__ import annotations

import torch


class KVCache:
    """Keys and values of one pipeline stage, ``[layers, 2, rows, kv_heads, length, head_dim]``.

    Row ``i`` of the cache is slot ``i`` of the decode batch; :meth:`compact` moves rows when
    the batch shrinks. Positions past a row's last write hold stale numbers that the causal
    bias masks out.
    """

    def __init__(
        self,
        layers: int,
        rows: int,
        kv_heads: int,
        length: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.kv = torch.zeros(
            layers, 2, rows, kv_heads, length, head_dim, dtype=dtype, device=device
        )

    @property
    def rows(self) -> int:
        return self.kv.shape[2]

    @property
    def length(self) -> int:
        return self.kv.shape[4]

    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    def write(
        self,
        layer: int,
        slots: torch.Tensor,
        positions: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
    ) -> None:
        """Store ``k``/``v`` ``[s, b, kv_heads, head_dim]`` of slots ``[b, 1]`` at positions
        ``[b, s]`` (only these entries are written)."""
        self.kv[layer, 0][slots, :, positions] = k.transpose(0, 1)
        self.kv[layer, 1][slots, :, positions] = v.transpose(0, 1)

    def keys(self, layer: int, slots: slice, length: int) -> torch.Tensor:
        """``[rows, kv_heads, length, head_dim]`` view of the ``slots``."""
        return self.kv[layer, 0, slots, :, :length]

    def values(self, layer: int, slots: slice, length: int) -> torch.Tensor:
        """``[rows, kv_heads, length, head_dim]`` view of the ``slots``."""
        return self.kv[layer, 1, slots, :, :length]

    def read(self, slot: int, length: int) -> torch.Tensor:
        """A copy of slot ``slot``'s first ``length`` positions, ``[layers, 2, kv_heads,
        length, head_dim]`` (what the prefix cache stores)."""
        return self.kv[:, :, slot, :, :length].clone()

    def load(self, slot: int, kv: torch.Tensor) -> None:
        """Write ``kv`` (as :meth:`read` returns it) into slot ``slot``'s first positions."""
        self.kv[:, :, slot, :, : kv.shape[3]] = kv

    def compact(self, order: torch.Tensor) -> None:
        """Slot ``j`` takes slot ``order[j]``'s keys and values, for ``j < len(order)``."""
        n = order.numel()
        self.kv[:, :, :n] = self.kv[:, :, order]


class RotaryTables:
    """``cos``/``sin`` ``[max_len, rot_dim]`` in the activation dtype, from megatron's rotary
    frequencies ``freqs [max_len, 1, 1, rot_dim]`` (fp32), as
    ``megatron.core.models.common.embeddings.rope_utils._apply_rotary_pos_emb_bshd`` computes
    them: ``(cos(freqs) * mscale).to(dtype)``."""

    def __init__(
        self, freqs: torch.Tensor, dtype: torch.dtype, interleaved: bool, mscale: float = 1.0
    ) -> None:
        freqs = freqs.reshape(freqs.shape[0], freqs.shape[-1])
        self.cos = (torch.cos(freqs) * mscale).to(dtype)
        self.sin = (torch.sin(freqs) * mscale).to(dtype)
        self.interleaved = interleaved

    def at(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos, sin`` of positions ``[b, s]`` as ``[s, b, 1, rot_dim]`` (one gather per
        forward, shared by every layer)."""
        index = positions.t()
        return self.cos[index].unsqueeze(2), self.sin[index].unsqueeze(2)

    def apply(self, t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate ``t [s, b, heads, head_dim]`` (the first ``rot_dim`` channels)."""
        rot = cos.shape[-1]
        x, rest = (t, None) if rot == t.shape[-1] else (t[..., :rot], t[..., rot:])
        if self.interleaved:
            x1, x2 = x[..., ::2], x[..., 1::2]
            half = torch.stack((-x2, x1), dim=-1).view(x.shape)
        else:
            x1, x2 = torch.chunk(x, 2, dim=-1)
            half = torch.cat((-x2, x1), dim=-1)
        out = x * cos + half * sin
        return out if rest is None else torch.cat((out, rest), dim=-1)


def causal_bias(positions: torch.Tensor, group: int, length: int) -> torch.Tensor:
    """Additive fp32 mask ``[b, 1, group * s, length]`` for queries at ``positions [b, s]``
    (repeated for the ``group`` query heads of a KV head, head-major as in
    :func:`grouped_attention`): 0 where key position ``j <= `` the query's position, ``-inf``
    elsewhere. Per-row positions give every row its own length in one batch."""
    b, s = positions.shape
    query = positions[:, None, :].expand(b, group, s).reshape(b, 1, group * s, 1)
    keys = torch.arange(length, device=positions.device)
    zero = torch.zeros((), dtype=torch.float32, device=positions.device)
    return torch.where(keys <= query, zero, float("-inf"))


def grouped_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor, scale: float
) -> torch.Tensor:
    """Softmax attention of ``q [s, b, heads, d]`` over ``keys``/``values``
    ``[b, kv_heads, length, d]`` with ``bias [b, 1, r * s, length]``; returns ``[s, b, heads * d]``.

    Query head ``h`` uses KV head ``h // r`` (megatron's layout). Scores and softmax in fp32,
    the products in the activation dtype, as megatron's local attention does.
    """
    s, b, heads, d = q.shape
    groups = keys.shape[1]
    r = heads // groups
    qg = (q * scale).view(s, b, groups, r, d).permute(1, 2, 3, 0, 4).reshape(b, groups, r * s, d)
    scores = torch.matmul(qg, keys.transpose(-1, -2)).float() + bias
    probs = torch.softmax(scores, dim=-1).to(values.dtype)
    ctx = torch.matmul(probs, values)  # [b, groups, r * s, d]
    return ctx.view(b, groups, r, s, d).permute(3, 0, 1, 2, 4).reshape(s, b, heads * d)
