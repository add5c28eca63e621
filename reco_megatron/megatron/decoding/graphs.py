"""CUDA graphs of the decode step, one per batch size, captured after a warm-up and replayed.

A decode step (:meth:`MegatronDecoder._step`: the forward, the sampling, the state update)
has static shapes for a given batch size, window and call shape, and never reads the device
back, so on a CUDA device it can be captured once and replayed: the GPU then runs a step as
one launch instead of ~10 kernels per layer launched from Python. :class:`StepGraphs` keeps
the captured graphs (sharing one memory pool) and the tensors they read: the slots of each
batch size (:meth:`StepGraphs.slots`: a compaction copies into them, it never allocates new
ones) and the call's state (kept while the next call has the same rows, response length and
stop ids, so an RL loop captures once). Eager on the CPU, under pipeline parallelism (the
point-to-point exchange), with expert parallelism (the MoE token exchange reads counts back)
and while recording MoE routing (Python hooks): then :meth:`StepGraphs.run` just calls the
step.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import torch

from reco_megatron.megatron.decoding.state import Slots
from reco_megatron.utils.logging import get_logger

logger = get_logger(__name__)

WARMUP_STEPS = 2
"""Eager steps of a batch size before it is captured (lazy library initialisation)."""


class StepGraphs:
    """Captured decode steps keyed by ``(batch size, key)``; ``enabled=False``: eager."""

    def __init__(self, enabled: bool, device: torch.device) -> None:
        self.enabled = enabled and device.type == "cuda"
        self.device = device
        self._graphs: dict[Hashable, Any] = {}
        self._warm: dict[Hashable, int] = {}
        self._slots: dict[int, Slots] = {}
        self._pool: Any = None
        self.captures = 0
        """Graphs captured so far (a metric: one per batch size and call shape)."""

    def slots(self, size: int) -> Slots:
        """The persistent slot tensors of batch size ``size`` (what a graph of it reads)."""
        if size not in self._slots:
            zeros = torch.zeros(size, dtype=torch.long, device=self.device)
            self._slots[size] = Slots(
                rows=zeros.clone(),
                tokens=zeros.clone(),
                positions=zeros.clone(),
                index=torch.arange(size, device=self.device)[:, None],
            )
        return self._slots[size]

    def load(self, source: Slots) -> Slots:
        """Copy ``source`` into the persistent slots of its size and return them."""
        target = self.slots(source.size)
        if target is not source:
            target.rows.copy_(source.rows)
            target.tokens.copy_(source.tokens)
            target.positions.copy_(source.positions)
        return target

    def reset(self) -> None:
        """Forget every graph (the cache or the call's buffers were re-allocated)."""
        self._graphs.clear()
        self._warm.clear()

    def run(self, key: Hashable, step: Callable[[], None]) -> None:
        """One decode step: replayed if captured, else eager (and captured after
        :data:`WARMUP_STEPS` eager runs of the same key)."""
        if not self.enabled:
            step()
            return
        graph = self._graphs.get(key)
        if graph is not None:
            graph.replay()
            return
        warm = self._warm.get(key, 0)
        if warm < WARMUP_STEPS:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                step()
            torch.cuda.current_stream().wait_stream(side)
            self._warm[key] = warm + 1
            return
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self._pool):
                step()
        except RuntimeError as err:  # a module that cannot be captured: stay eager
            logger.warning("decode step not capturable (%s): decoding eagerly", err)
            self.enabled = False
            step()
            return
        self._graphs[key] = graph
        self.captures += 1
        graph.replay()  # capture records the step, it does not run it
