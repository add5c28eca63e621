"""Packed sequences (THD): several sequences of a micro-batch in one row, no padding between.

With ``update.sequence_packing`` (and an attention that takes packed rows: transformer-engine's,
or torch's, :mod:`reco_megatron.megatron.model.attention`, on CPU and GPU) a micro-batch of
``n`` rows becomes one row of ``T <= max_tokens_per_microbatch`` positions: row ``i``'s first
``n_i`` input positions (its needed positions, ``microbatching.needed_lengths``) sit at
``[start_i, start_i + n_i)``, padded to a multiple the attention kernels want. megatron-core
gets ``PackedSeqParams(qkv_format="thd", cu_seqlens_q = cu_seqlens_kv = starts + [T])`` so that
attention never crosses a boundary, and position ids restart at 0 for every sequence (RoPE).

Only the model's input is packed. The statistics op runs on the packed logits
``[1, T, V/TP]`` with the packed labels, and the per-token statistics (a few floats per token,
not the logits) are unpacked to the micro-batch's ``[n, S]`` layout before the loss, which
therefore sees exactly what it sees without packing (``loss_layer`` asks
``LossContext.packed``). Tested on CPU against the padded path, with a reference attention that
honours the boundaries (``tests/megatron/test_packing.py``) and with the whole engine on torch's
attention at TP 1, TP 2 + SP and PP 2 (``tests/megatron/test_packed_engine.py``); the
transformer-engine run itself needs a GPU.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import torch

from reco_megatron.megatron.device import check_on_device
from reco_megatron.megatron.step.microbatching import round_up
from reco_megatron.parallel.batch import RolloutBatch
from reco_megatron.utils.logging import get_logger

logger = get_logger(__name__)


def packing_available(attention: str) -> tuple[bool, str]:
    """Whether THD packing can run with the resolved attention (``te``, ``torch`` or
    ``local``), and if not, the one line that says why."""
    if attention == "local":
        return False, (
            "model.attention_backend=local (megatron's DotProductAttention) takes no packed "
            "rows; use 'torch' or 'auto'"
        )
    return True, ""


@dataclass(frozen=True)
class PackedLayout:
    """Where each sequence of a micro-batch sits in its packed row.

    Sequence ``i`` owns positions ``[starts[i], ends[i])`` (its ``lengths[i]`` real positions,
    then padding up to a multiple); the last one also owns the tail up to ``total``."""

    lengths: tuple[int, ...]
    """Real (needed) positions of each sequence, in the micro-batch's row order."""
    starts: tuple[int, ...]
    """First packed position of each sequence."""
    total: int
    """``T``, the packed row's length."""

    @property
    def ends(self) -> tuple[int, ...]:
        """End (exclusive) of each sequence's segment, padding included."""
        return (*self.starts[1:], self.total)

    def cu_seqlens(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """``[n + 1]`` int32 segment boundaries (``cu_seqlens_q`` = ``cu_seqlens_kv``)."""
        return torch.tensor([*self.starts, self.total], dtype=torch.int32, device=device)

    @property
    def max_seqlen(self) -> int:
        """Longest segment."""
        return max(e - s for s, e in zip(self.starts, self.ends, strict=True))

    def position_ids(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """``[1, T]`` positions restarting at 0 at every segment."""
        pos = torch.empty(self.total, dtype=torch.long)
        for s, e in zip(self.starts, self.ends, strict=True):
            pos[s:e] = torch.arange(e - s)
        return pos.unsqueeze(0).to(device)

    def _index(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(row, column, packed position) of every real position."""
        rows = [i for i, n in enumerate(self.lengths) for _ in range(n)]
        cols = [t for n in self.lengths for t in range(n)]
        flat = [s + t for s, n in zip(self.starts, self.lengths, strict=True) for t in range(n)]
        return tuple(torch.tensor(x, dtype=torch.long, device=device) for x in (rows, cols, flat))

    def pack(self, x: torch.Tensor, fill: float | int = 0) -> torch.Tensor:
        """``x [n, S]`` (row ``i`` valid on its first ``lengths[i]`` columns) -> ``[1, T]``."""
        rows, cols, flat = self._index(x.device)
        out = x.new_full((self.total,), fill)
        out[flat] = x[rows, cols]
        return out.unsqueeze(0)

    def unpack(self, y: torch.Tensor, width: int) -> torch.Tensor:
        """Per-token ``y [1, T]`` (or ``[T]``) -> ``[n, width]``, zeros past each sequence's
        length. Differentiable (a gather and a scatter)."""
        y = y.reshape(-1)
        rows, cols, flat = self._index(y.device)
        out = y.new_zeros((len(self.lengths), width))
        return out.index_put((rows, cols), y[flat])


def pack_layout(needed: Sequence[int], multiple: int = 1, row_multiple: int = 1) -> PackedLayout:
    """Segments of ``round_up(n_i, multiple)`` positions, one after the other; the row is
    padded to a multiple of ``row_multiple`` (TP with sequence parallelism)."""
    starts, at = [], 0
    for n in needed:
        starts.append(at)
        at += round_up(n, multiple)
    return PackedLayout(tuple(needed), tuple(starts), round_up(at, row_multiple))


@dataclass(frozen=True)
class PackedLabels:
    """What the loss layer needs of a packed micro-batch (``LossContext.packed``)."""

    labels: torch.Tensor
    """``[1, T]`` packed next-token labels."""
    layout: PackedLayout
    """Where the sequences sit."""

    def unpack(self, y: torch.Tensor, width: int) -> torch.Tensor:
        """Per-token statistics ``[1, T]`` -> ``[n, width]``."""
        return self.layout.unpack(y, width)


@dataclass(frozen=True)
class PackedMicroBatch:
    """One micro-batch for the packed forward step: the rows as the loss sees them (unpacked,
    ``[n, S]``) and their layout in the packed row."""

    mb: RolloutBatch
    layout: PackedLayout


def packed_seq_params(layout: PackedLayout, device: torch.device) -> Any:
    """megatron-core's ``PackedSeqParams`` (THD) for ``layout``."""
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = layout.cu_seqlens(device)
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        max_seqlen_q=layout.max_seqlen,
        max_seqlen_kv=layout.max_seqlen,
    )


def make_packed_forward_step(
    loss_func: Callable[..., Any], ctx: Any, device: torch.device, fused_output_layer: bool
) -> Callable[[Iterator[PackedMicroBatch], Any], tuple[torch.Tensor, Callable[..., Any]]]:
    """A ``forward_step_func`` running each :class:`PackedMicroBatch` as one packed row.

    The model gets the packed input ids ``[1, T]``, per-sequence position ids and
    ``packed_seq_params``; the loss function gets the unpacked rows and a context whose
    ``packed`` field holds the packed labels and layout."""

    def forward_step(data_iterator: Iterator[PackedMicroBatch], model: Any):
        item = next(data_iterator)
        mb, layout = item.mb, item.layout
        check_on_device(vars(mb), device, "micro-batch entering the model")
        input_ids = layout.pack(mb.input_ids)
        labels = PackedLabels(layout.pack(mb.labels), layout)
        output = model(
            input_ids,
            layout.position_ids(input_ids.device),
            None,
            packed_seq_params=packed_seq_params(layout, input_ids.device),
        )
        loss_ctx = replace(ctx, packed=labels)
        if fused_output_layer:
            from reco_megatron.megatron.model.build import output_weight

            loss_ctx = replace(loss_ctx, output_weight=output_weight(model))
        return output, partial(loss_func, mb, loss_ctx)

    return forward_step
