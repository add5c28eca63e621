"""The decoder's KV cache between calls, the bound on its memory, and what a call needs of it.

:class:`CacheMemory` holds one stage's :class:`~reco_megatron.megatron.decoding.attention.KVCache`
from one call to the next (kept while it holds the call's rows and window, re-allocated
larger otherwise), the most it may take on this rank (``kv_cache_bytes``; by default half the
device memory free at the first call on CUDA, 4 GiB on the CPU), the rows a call may decode
within it, and a call's checks (:meth:`CacheMemory.window`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from reco_megatron.megatron.decoding.attention import KVCache
from reco_megatron.megatron.decoding.stage import StageForward
from reco_megatron.megatron.decoding.state import window_for


class CacheMemory:
    """One stage's KV cache and its bound (``max_batch_size`` None: rows as many as fit)."""

    def __init__(
        self,
        stage: StageForward,
        max_model_len: int,
        max_batch_size: int | None,
        kv_cache_bytes: int | None,
    ) -> None:
        self.stage = stage
        self.max_model_len = max_model_len
        self.max_batch_size = max_batch_size
        self._limit = kv_cache_bytes
        self.cache: KVCache | None = None

    def nbytes(self) -> int:
        """Bytes held by the KV cache now (0 after :meth:`free`)."""
        return 0 if self.cache is None else self.cache.nbytes()

    def free(self) -> None:
        self.cache = None
        if self.stage.device.type == "cuda":
            torch.cuda.empty_cache()

    def limit(self) -> int:
        """Bytes the KV cache may take on this rank (``kv_cache_bytes``, or the default)."""
        if self._limit is None:
            if self.stage.device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(self.stage.device)
                self._limit = (free + self.nbytes()) // 2
            else:
                self._limit = 4 * 2**30
        return self._limit

    def max_rows(self, length: int) -> int:
        """Rows one call may decode with ``length`` positions: ``max_batch_size``, or with
        ``auto`` as many as fit in :meth:`limit` (at least 1)."""
        if self.max_batch_size is not None:
            return self.max_batch_size
        per_row = max(self.stage.bytes_per_row(window_for(length, self.max_model_len)), 1)
        return max(1, self.limit() // per_row)

    def holds(self, rows: int, window: int) -> bool:
        """Whether the cache kept from earlier calls holds ``rows`` x ``window``."""
        cache = self.cache
        return cache is not None and cache.rows >= rows and cache.length >= window

    def allocate(self, rows: int, window: int) -> None:
        self.cache = self.stage.new_cache(rows, window)

    def window(self, lengths: Sequence[int], rows: int, max_new: int) -> int:
        """The attention window of a call of ``rows`` rows with prompts of ``lengths`` and
        ``max_new`` new tokens; raises if the call cannot run."""
        if rows != len(lengths) or rows < 1 or min(lengths) < 1:
            raise ValueError(
                f"{len(lengths)} prompts with noise ({rows}, {max_new}): need one non-empty "
                "prompt per noise row"
            )
        total = max(lengths) + max_new
        if total > self.max_model_len:
            raise ValueError(
                f"longest prompt {max(lengths)} + max_new_tokens {max_new} = {total} > "
                f"max_model_len {self.max_model_len}"
            )
        if rows > self.max_rows(total):
            raise ValueError(f"{rows} rows > {self.max_rows(total)} that fit the KV cache")
        return window_for(total, self.max_model_len)
