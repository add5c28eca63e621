"""The decoder's prefix cache: keys and values of finished rows, reused by prompts that extend them.

A multi-turn episode calls the engine once per turn with ``prompt + episode so far`` as a new
prompt (``reco_megatron/envs/episodes.py``). After a call, :class:`PrefixStore` keeps each
row's computed keys and values, those of ``prompt + response[:-1]`` (the last sampled token
was never fed), under exactly those token ids. At the next call a prompt that starts with a
stored sequence takes that sequence's keys and values into its cache slot and prefills only
the rest (the last action token and the observation) at its true positions
(:meth:`~reco_megatron.megatron.decoding.decoder.MegatronDecoder.decode`), as vLLM's
automatic prefix cache does with blocks.

* **What is reused is exact**: the keys and values at positions ``0..L-1`` depend on the
  tokens ``0..L-1`` and the weights only (causal attention, RoPE at the absolute position),
  so a hit gives the function a full prefill computes, up to the summation order of a
  differently shaped forward.
* **Deterministic across ranks**: hits, stores and evictions depend on the token ids and on a
  bound in positions that every rank of the model-parallel group agrees on (the smallest of
  theirs), never on a rank's own bytes or timing, so TP ranks and pipeline stages (each
  holding its own layers' keys) always make the same choices and run forwards of the same
  shape.
* **Bounded**: at most ``limit`` positions (LRU eviction; a sequence longer than the bound is
  not stored); a row that extended an entry replaces it (the episode's next turn needs the
  longer one only).
* **Never stale**: the owner clears it whenever the weights change
  (:meth:`PrefixStore.clear`; the megatron engine does at every weight sync and at sleep).
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import torch

from reco_megatron.megatron.decoding.attention import KVCache
from reco_megatron.megatron.decoding.groups import least
from reco_megatron.megatron.decoding.state import CallState

Key = tuple[int, ...]


class PrefixStore:
    """Keys and values ``[layers, 2, kv_heads, L, head_dim]`` per token sequence (``L`` its
    length), least recently used first; at most ``limit`` positions in all (0: off)."""

    def __init__(self, limit: int) -> None:
        if limit < 0:
            raise ValueError(f"the prefix cache bound must be >= 0 positions, got {limit}")
        self.limit = int(limit)
        self._entries: OrderedDict[Key, torch.Tensor] = OrderedDict()
        self._lengths: Counter[int] = Counter()
        self.positions = 0
        """Positions held now."""

    def __len__(self) -> int:
        return len(self._entries)

    def nbytes(self) -> int:
        """Bytes held now."""
        return sum(kv.numel() * kv.element_size() for kv in self._entries.values())

    def match(self, prompt: Sequence[int]) -> Key | None:
        """The longest stored sequence that ``prompt`` starts with and is longer than (at
        least one prompt token is left to feed: its logits sample the first response token),
        marked as used; None if there is none."""
        for length in sorted(self._lengths, reverse=True):
            if length >= len(prompt):
                continue
            key = tuple(prompt[:length])
            if key in self._entries:
                self._entries.move_to_end(key)
                return key
        return None

    def get(self, key: Key) -> torch.Tensor:
        return self._entries[key]

    def put(self, key: Key, kv: torch.Tensor) -> None:
        """Store ``kv`` (already a copy) under ``key``, evicting the least recently used
        entries to stay within the bound; a sequence longer than the bound is not stored."""
        if not key or len(key) > self.limit:
            return
        self.discard(key)
        while self.positions + len(key) > self.limit:
            self.discard(next(iter(self._entries)))
        self._entries[key] = kv
        self._lengths[len(key)] += 1
        self.positions += len(key)

    def discard(self, key: Key) -> None:
        """Drop ``key``'s entry if it is held."""
        if self._entries.pop(key, None) is None:
            return
        self._lengths[len(key)] -= 1
        if not self._lengths[len(key)]:
            del self._lengths[len(key)]
        self.positions -= len(key)

    def clear(self) -> None:
        """Drop every entry (the weights changed: the keys and values are stale)."""
        self._entries.clear()
        self._lengths.clear()
        self.positions = 0


class CallPrefixes:
    """One decode call's use of the store: the rows' hits at the prefill, then each finished
    row's keys and values stored (:meth:`keep`, at the host reads)."""

    def __init__(self, store: PrefixStore, prompts: Sequence[Sequence[int]]) -> None:
        self.store = store
        self.prompts = prompts
        self.sources: list[Key | None] = [None] * len(prompts)
        self.kept: set[int] = set()

    def load_hits(self, cache: KVCache) -> list[int]:
        """Copy each hit's keys and values into its row's slot (slot ``r`` holds row ``r`` at
        the prefill); returns every row's cached positions (0: a miss)."""
        starts = []
        for r, prompt in enumerate(self.prompts):
            key = self.store.match(prompt)
            self.sources[r] = key
            if key is not None:
                cache.load(r, self.store.get(key))
            starts.append(0 if key is None else len(key))
        return starts

    def keep(
        self, cache: KVCache, state: CallState, slot_rows: list[int], done: list[bool]
    ) -> None:
        """Store the rows that finished (``done[i]`` for slot ``i`` holding row
        ``slot_rows[i]``) and are not stored yet: ``prompt + response[:-1]`` from their slot,
        replacing the entry they extended. Reads the counts and tokens once when any is new."""
        new = {}
        for slot, (row, finished) in enumerate(zip(slot_rows, done, strict=True)):
            if finished and row not in self.kept and row not in new:
                new[row] = slot
        if not new:
            return
        counts, tokens = state.count.cpu(), state.out_tokens.cpu()
        for row, slot in new.items():
            self.kept.add(row)
            fed = tokens[row, : int(counts[row]) - 1].tolist()
            key = tuple(self.prompts[row]) + tuple(fed)
            source = self.sources[row]
            if source is not None:
                self.store.discard(source)
            if len(key) <= self.store.limit:
                self.store.put(key, cache.read(slot, len(key)))


class PrefixCache:
    """A decoder's prefix cache: the store, built at the first call, and its counters.

    Args:
        limit_bytes: the most the store may hold on this rank (None: half the KV cache's
            limit; 0: off). The bound in positions is the smallest over ``group``.
        enabled: False where the decoder cannot use it (recording routing, expert parallel).
        group: the model-parallel group, whose ranks must make the same choices.
    """

    def __init__(self, limit_bytes: int | None, enabled: bool, group: Any) -> None:
        if limit_bytes is not None and limit_bytes < 0:
            raise ValueError(f"prefix_cache_bytes must be >= 0 or None, got {limit_bytes}")
        self.limit_bytes = limit_bytes
        self.enabled = enabled and limit_bytes != 0
        self.group = group
        self.store: PrefixStore | None = None
        """None until the first call, and while off."""
        self.prefilled_positions = 0
        """Prompt positions fed by prefills so far (hits leave theirs out)."""
        self.reused_positions = 0
        """Prompt positions taken from the store so far."""

    def call(
        self, prompts: Sequence[Sequence[int]], kv_limit: Callable[[], int], per_position: int
    ) -> CallPrefixes | None:
        """The store's use by a call of ``prompts`` (None while off); the first builds the
        store (collective over ``group``). ``per_position``: bytes of one position here."""
        if not self.enabled:
            return None
        if self.store is None:
            budget = kv_limit() // 2 if self.limit_bytes is None else self.limit_bytes
            self.store = PrefixStore(least(budget // max(per_position, 1), self.group))
        return CallPrefixes(self.store, prompts)

    def count(self, prompt_positions: int, reused: int) -> None:
        """Account a prefill of ``prompt_positions`` of which ``reused`` came from the store."""
        self.prefilled_positions += prompt_positions - reused
        self.reused_positions += reused

    def reset(self) -> None:
        """Drop every entry (the weights changed)."""
        if self.store is not None:
            self.store.clear()
