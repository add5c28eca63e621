"""One pipeline stage's decoding forward: the trainer's live modules around our attention.

:class:`StageForward` walks a ``GPTModel`` chunk layer by layer and calls megatron's own
modules for everything but attention: the embedding, each layer's input norm, QKV projection
with its query/key norms (``SelfAttention.get_query_key_value_tensors``), output projection,
bias-dropout-add and MLP or MoE block (``TransformerLayer._forward_mlp``, the norm and the
residual included), the final norm and the output weight. Tensor parallelism stays inside
those modules (column/row-parallel linears, the vocabulary-parallel embedding), expert
parallelism inside the MoE layer. Attention is :mod:`.attention`: RoPE once on the new keys,
the KV cache written at the new positions only, grouped queries over the cached keys.

Rows have their own positions (``[b, s]``), so prompts of different lengths prefill in one
forward (right padding; a padded position writes keys that the causal bias hides and a later
write replaces), and an extension of some rows by forced tokens is the same call with those
rows' positions. Logits are computed for one position per row only (``last [b]``), after the
final norm, gathered over TP: ``[b, vocab]`` fp32.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from reco_megatron.megatron.decoding.attention import (
    KVCache,
    RotaryTables,
    causal_bias,
    grouped_attention,
)

PREFILL_SCORE_BYTES = 2**30
"""Bound on a prefill forward's attention scores (long prompts prefill in groups of rows)."""


def _unwrap(module: Any) -> Any:
    while hasattr(module, "module"):  # DDP, Float16Module
        module = module.module
    return module


class StageForward:
    """The decoding forward of one ``GPTModel`` chunk (one pipeline stage).

    Args:
        model: the chunk (unwrapped from DDP); read live, never copied.
        vocab_size: the true vocabulary (Megatron's padded columns are dropped).
        max_model_len: longest position + 1 (sizes the rotary tables).
        pp_group / prev_rank / next_rank: the pipeline group and neighbours (None at PP 1).
    """

    def __init__(
        self,
        model: Any,
        *,
        vocab_size: int,
        max_model_len: int,
        pp_group: Any = None,
        prev_rank: int | None = None,
        next_rank: int | None = None,
    ) -> None:
        from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

        self.model = _unwrap(model)
        self.config = self.model.config
        self.vocab_size = int(vocab_size)
        self.first = bool(self.model.pre_process)
        self.last = bool(self.model.post_process)
        self.pp_group, self.prev_rank, self.next_rank = pp_group, prev_rank, next_rank
        self.layers = list(self.model.decoder.layers)
        if getattr(self.config, "context_parallel_size", 1) > 1:
            raise ValueError(
                "the megatron rollout engine decodes without context parallelism, got "
                f"context_parallel_size={self.config.context_parallel_size}: use "
                "rollout.engine=vllm or parallel.context_parallel_size=1"
            )
        rotary = getattr(self.model, "rotary_pos_emb", None)
        if type(rotary) is not RotaryEmbedding:
            raise ValueError(
                f"the megatron decoder supports plain RoPE models, got position embedding "
                f"{type(rotary).__name__}: use rollout.engine=vllm or embedded"
            )
        self.params_dtype = self.config.params_dtype
        self.device = next(self.model.parameters()).device
        self.rotary = RotaryTables(
            rotary(max_model_len).to(self.device),
            self.params_dtype,
            interleaved=bool(getattr(self.config, "rotary_interleaved", False)),
        )
        attn = self.layers[0].self_attention if self.layers else None
        self.heads = attn.num_attention_heads_per_partition if attn else 0
        self.kv_heads = attn.num_query_groups_per_partition if attn else 0
        self.head_dim = attn.hidden_size_per_attention_head if attn else 0
        scale = getattr(self.config, "softmax_scale", None)
        self.scale = scale if scale is not None else 1.0 / math.sqrt(max(self.head_dim, 1))

    # ----------------------------------------------------------------- cache
    def new_cache(self, rows: int, length: int) -> KVCache:
        """A zeroed cache for ``rows`` slots of ``length`` positions (this stage's layers)."""
        return KVCache(
            len(self.layers),
            rows,
            self.kv_heads,
            length,
            self.head_dim,
            self.params_dtype,
            self.device,
        )

    def bytes_per_row(self, length: int) -> int:
        """Cache bytes of one row of ``length`` positions on this rank."""
        itemsize = torch.empty((), dtype=self.params_dtype).element_size()
        return 2 * len(self.layers) * self.kv_heads * length * self.head_dim * itemsize

    def prefill_rows(self, length: int, window: int) -> int:
        """Rows per prefill forward so that its fp32 attention scores
        ``[rows, heads, length, window]`` stay within :data:`PREFILL_SCORE_BYTES`."""
        per_row = 4 * max(self.heads, 1) * length * window
        return max(1, PREFILL_SCORE_BYTES // per_row)

    # ----------------------------------------------------------------- forward
    def hidden_shape(self, b: int, s: int) -> tuple[int, int, int]:
        return (s, b, self.config.hidden_size)

    def forward(
        self,
        cache: KVCache,
        window: int,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        last: torch.Tensor | None = None,
        first_slot: int = 0,
    ) -> torch.Tensor | None:
        """Feed ``tokens``/``positions`` ``[b, s]`` of cache slots ``slots [b, 1]`` (which
        are ``first_slot .. first_slot + b - 1``), attending over the first ``window``
        positions of the cache.

        Returns the logits ``[b, vocab]`` (fp32) of position ``last [b]`` of every row
        (``s - 1`` when None) on the last stage, None on the others (their hidden states
        ``[s, b, h]`` went to the next stage). Collective over TP (and PP, EP as the model).
        """
        b, s = tokens.shape
        if self.first:
            hidden = self.model.embedding(input_ids=tokens, position_ids=positions)
        else:
            hidden = torch.empty(
                self.hidden_shape(b, s), dtype=self._pipe_dtype(), device=self.device
            )
            dist.recv(hidden, src=self.prev_rank, group=self.pp_group)
            hidden = hidden.to(self.params_dtype)
        cos, sin = self.rotary.at(positions)
        bias = causal_bias(positions, self.heads // max(self.kv_heads, 1), window)
        rows = slice(first_slot, first_slot + b)
        for i, layer in enumerate(self.layers):
            hidden = self._layer(
                layer, i, hidden, cache, window, slots, rows, positions, cos, sin, bias
            )
        if not self.last:
            dist.send(
                hidden.to(self._pipe_dtype()).contiguous(), dst=self.next_rank, group=self.pp_group
            )
            return None
        if s == 1:
            picked = hidden
        else:
            index = last if last is not None else torch.full((b,), s - 1, device=self.device)
            picked = hidden[index, torch.arange(b, device=self.device)].unsqueeze(0)  # [1, b, h]
        return self._logits(picked)[0]

    def idle(self, pad_id: int) -> None:
        """A one-token forward of the whole chunk without the cache (megatron's own path):
        a rank's part of an MoE layer's token exchange when it has nothing to decode."""
        tokens = torch.full((1, 1), pad_id, dtype=torch.long, device=self.device)
        positions = torch.zeros(1, 1, dtype=torch.long, device=self.device)
        recv = None
        if not self.first:
            recv = torch.empty(
                self.hidden_shape(1, 1), dtype=self._pipe_dtype(), device=self.device
            )
            dist.recv(recv, src=self.prev_rank, group=self.pp_group)
        self.model.set_input_tensor(recv)
        out = self.model(tokens, positions, None)
        self.model.set_input_tensor(None)
        if not self.last:
            dist.send(out.contiguous(), dst=self.next_rank, group=self.pp_group)

    def _pipe_dtype(self) -> torch.dtype:
        return self.config.pipeline_dtype or self.params_dtype

    def _layer(
        self,
        layer: Any,
        index: int,
        hidden: torch.Tensor,
        cache: KVCache,
        window: int,
        slots: torch.Tensor,
        rows: slice,
        positions: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        bias: torch.Tensor,
    ) -> torch.Tensor:
        """One ``TransformerLayer``: megatron's modules, our attention core."""
        normed = layer.input_layernorm(hidden)
        residual = hidden
        if isinstance(normed, tuple):  # a norm that hands back its own residual
            normed, residual = normed
        attn = layer.self_attention
        q, k, v = attn.get_query_key_value_tensors(normed, None)
        q = self.rotary.apply(q, cos, sin)
        k = self.rotary.apply(k, cos, sin)
        cache.write(index, slots, positions, k, v)
        keys, values = cache.keys(index, rows, window), cache.values(index, rows, window)
        ctx = grouped_attention(q, keys, values, bias, self.scale)
        out_with_bias = attn.linear_proj(ctx)
        bda = layer.self_attn_bda(False, self.config.bias_dropout_fusion)
        hidden = bda(out_with_bias, residual, layer.hidden_dropout)
        return layer._forward_mlp(hidden)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[1, b, vocab]`` fp32 from final hidden states ``[1, b, h]`` (norm, output weight,
        gather over TP, padding dropped)."""
        from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

        from reco_megatron.megatron.model.build import output_weight

        norm = getattr(self.model.decoder, "final_layernorm", None)
        if norm is not None:
            hidden = norm(hidden)
        logits = F.linear(hidden, output_weight(self.model))
        bias = getattr(self.model.output_layer, "bias", None)
        if bias is not None:
            logits = logits + bias
        if self.config.tensor_model_parallel_size > 1:
            logits = gather_from_tensor_model_parallel_region(logits)
        return logits[..., : self.vocab_size].float()
