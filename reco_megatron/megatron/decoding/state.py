"""The device-side state of one decode call, and one decode step that never reads it back.

:class:`CallState` holds per-row progress on the engine's device (response counts, stop flags,
the sampled tokens and log-probs, the uniforms); :class:`Slots` holds the batch being decoded
(which row each cache slot holds, the token it feeds next and at which position). A step
(:func:`advance`) is tensor code only: the sampled token of every slot is written at its row's
next response index (finished rows write to a spare column, so no row is ever skipped by a
host-side test), counts and stop flags are updated in place, the next token and position are
set. The host reads the state every few steps (the decoder's ``sync_every``) to stop and to
move the live rows into a smaller batch (:meth:`Slots.compacted`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Decoded:
    """One row's result: response tokens, their log-probs, whether a stop id ended it, and
    (MoE models, when recording) the experts of every position, ``[prompt + response, layers,
    top-k]`` int16 with ``-1`` where unknown."""

    token_ids: list[int]
    logprobs: list[float]
    stopped: bool
    routed_experts: torch.Tensor | None = None


@dataclass
class CallState:
    """Per-row state of one call (``b`` rows, up to ``max_new`` response tokens each)."""

    noise: torch.Tensor
    """``[b, max_new]`` fp64 uniforms: response token ``t`` of row ``r`` uses ``noise[r, t]``."""
    stops: torch.Tensor
    """``[n]`` stop ids (``-1`` pads: no token matches it)."""
    count: torch.Tensor
    """``[b]`` long: response tokens sampled so far."""
    stopped: torch.Tensor
    """``[b]`` bool: a stop id was sampled."""
    finished: torch.Tensor
    """``[b]`` bool: stopped or ``count == max_new``."""
    out_tokens: torch.Tensor
    """``[b, max_new + 1]`` long; column ``max_new`` takes the writes of finished rows."""
    out_logprobs: torch.Tensor
    """``[b, max_new + 1]`` fp32, as ``out_tokens``."""
    routed: torch.Tensor | None = None
    """``[b, window, layers, top-k]`` int16 experts of every fed position (-1: never fed)."""

    @classmethod
    def new(cls, noise: torch.Tensor, stop_ids: list[int], device: torch.device) -> CallState:
        b, max_new = noise.shape
        stops = torch.tensor(sorted(set(stop_ids)) or [-1], dtype=torch.long, device=device)
        return cls(
            noise=noise.to(device),
            stops=stops,
            count=torch.zeros(b, dtype=torch.long, device=device),
            stopped=torch.zeros(b, dtype=torch.bool, device=device),
            finished=torch.zeros(b, dtype=torch.bool, device=device),
            out_tokens=torch.zeros(b, max_new + 1, dtype=torch.long, device=device),
            out_logprobs=torch.zeros(b, max_new + 1, dtype=torch.float32, device=device),
        )

    def refill(self, new: CallState) -> bool:
        """Take ``new``'s values into these tensors when the shapes match (False if not)."""
        fields = ("noise", "stops", "count", "stopped", "finished", "out_tokens", "out_logprobs")
        if any(getattr(self, f).shape != getattr(new, f).shape for f in fields):
            return False
        for f in fields:
            getattr(self, f).copy_(getattr(new, f))
        self.routed = None
        return True

    def results(self, lengths: list[int], routed: torch.Tensor | None) -> list[Decoded]:
        """One :class:`Decoded` per row (prompt ``lengths``; ``routed``: every stage's
        experts, on the CPU): the one read of the outputs."""
        count, stopped = self.count.cpu(), self.stopped.cpu()
        tokens, logprobs = self.out_tokens.cpu(), self.out_logprobs.cpu()
        rows = []
        for r, length in enumerate(lengths):
            n = int(count[r])
            rows.append(
                Decoded(
                    token_ids=tokens[r, :n].tolist(),
                    logprobs=logprobs[r, :n].tolist(),
                    stopped=bool(stopped[r]),
                    routed_experts=None if routed is None else routed[r, : length + n].clone(),
                )
            )
        return rows

    @property
    def max_new(self) -> int:
        return self.noise.shape[1]

    def record(
        self,
        records: dict[int, torch.Tensor],
        s: int,
        entries: tuple[torch.Tensor, torch.Tensor],
        rows: torch.Tensor,
        positions: torch.Tensor,
    ) -> None:
        """Store experts of the last forward (``records``: global layer -> ``[s * slots, k]``
        in megatron's ``[s, slots]`` order): entry ``(slot, step) = entries[0][i],
        entries[1][i]`` goes to row ``rows[i]``, position ``positions[i]`` (all ``[n]``)."""
        assert self.routed is not None
        for j, layer in enumerate(sorted(records)):
            chosen = records[layer].view(s, -1, records[layer].shape[-1])
            picked = chosen[entries[1], entries[0]]
            self.routed[rows, positions, j] = picked.to(self.routed.dtype)

    def uniforms(self, rows: torch.Tensor) -> torch.Tensor:
        """``[n]`` uniforms of the next response token of ``rows``."""
        return self.noise[rows, self.count[rows].clamp(max=self.max_new - 1)]


@dataclass
class Slots:
    """The decode batch: slot ``i`` (row ``i`` of the KV cache) holds row ``rows[i]`` of the
    call, feeds ``tokens[i]`` at position ``positions[i]`` next. Slots past the live rows
    repeat a finished row (they write nothing)."""

    rows: torch.Tensor
    """``[n]`` long."""
    tokens: torch.Tensor
    """``[n]`` long."""
    positions: torch.Tensor
    """``[n]`` long."""
    index: torch.Tensor
    """``[n, 1]`` long: ``arange(n)``, the cache slots."""

    @property
    def size(self) -> int:
        return self.rows.numel()

    def compacted(self, order: torch.Tensor) -> Slots:
        """The slots ``order`` (``[m]`` long, device) moved to the front, as a new batch."""
        m = order.numel()
        return Slots(
            rows=self.rows[order].clone(),
            tokens=self.tokens[order].clone(),
            positions=self.positions[order].clone(),
            index=torch.arange(m, device=order.device)[:, None],
        )


def advance(state: CallState, slots: Slots, tokens: torch.Tensor, logprobs: torch.Tensor) -> None:
    """Record the sampled ``tokens``/``logprobs`` ``[n]`` of every slot and step the batch.

    Live rows store the token at their next response index, count it, check it against the
    stop ids and feed it next at the following position; finished rows store it in the spare
    column and feed their last token again at the same position (the same keys rewritten).
    In-place device ops only: no host synchronisation.
    """
    rows = slots.rows
    live = ~state.finished[rows]
    count = state.count[rows]
    column = torch.where(live, count, state.max_new)
    state.out_tokens[rows, column] = tokens
    state.out_logprobs[rows, column] = logprobs.float()
    count = count + live.long()
    state.count[rows] = count
    hit = (tokens[:, None] == state.stops[None, :]).any(dim=-1) & live
    stopped = state.stopped[rows] | hit
    state.stopped[rows] = stopped
    state.finished[rows] = stopped | (count >= state.max_new)
    slots.tokens.copy_(torch.where(live, tokens, slots.tokens))
    slots.positions.add_(live.long())


def prompt_batch(
    prompts: Sequence[Sequence[int]],
    pad_id: int,
    device: torch.device,
    starts: Sequence[int] | None = None,
    window: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The prefill batch of ``prompts`` whose first ``starts[r]`` positions are already in
    the cache (None: none are): ``tokens``, ``positions`` ``[b, s]`` with ``s`` the longest
    rest (right padding with ``pad_id``; row ``r`` at its absolute positions ``starts[r] ..``,
    padding clipped to ``window - 1``: padded positions write keys that the causal bias hides
    and a later write replaces), each row's last prompt token's index in the batch ``[b]``
    and its position ``[b]``, on ``device``."""
    b = len(prompts)
    starts = [0] * b if starts is None else list(starts)
    rests = [len(p) - s for p, s in zip(prompts, starts, strict=True)]
    longest = max(rests)
    buf = torch.full((b, longest), pad_id, dtype=torch.long)
    for r, (p, s) in enumerate(zip(prompts, starts, strict=True)):
        buf[r, : rests[r]] = torch.tensor(list(p[s:]), dtype=torch.long)
    offsets = torch.tensor(starts, dtype=torch.long)[:, None]
    positions = offsets + torch.arange(longest)
    if window is not None:
        positions = positions.clamp(max=window - 1)
    index = torch.tensor(rests, device=device) - 1
    last = torch.tensor([len(p) for p in prompts], device=device) - 1
    return buf.to(device), positions.to(device), index, last


def bucket(live: int, current: int) -> int:
    """The batch size for ``live`` rows decoded in a batch of ``current``: unchanged until
    half of it or fewer are live, then the next power of two >= ``live`` (a small set of
    sizes, so the GPU's captured steps are reused)."""
    if live * 2 > current:
        return current
    size = 1
    while size < live:
        size *= 2
    return size


WINDOW_MULTIPLE = 64
"""Attention windows are rounded up to this many positions (fewer distinct step shapes)."""


def window_for(total: int, max_model_len: int) -> int:
    """Cache positions a call of ``total`` positions attends over: rounded up to
    :data:`WINDOW_MULTIPLE`, at most ``max_model_len``."""
    rounded = -(-total // WINDOW_MULTIPLE) * WINDOW_MULTIPLE
    return min(rounded, max_model_len)
