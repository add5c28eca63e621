"""The first rank's book of the groups it asked the rollout workers for.

A step's groups are split into chunks, one request per live worker
(:meth:`GroupDispatcher.send_step`); each request carries the step's per-prompt seeds and the
lowest weight version it may be generated with. :meth:`GroupDispatcher.collect` waits for a
step's chunks, drops and asks again for any generated with weights older than the staleness
bound, and assembles the groups in the sampler's order. A lost worker's unanswered chunks go
to the live workers (``worker_failure=continue``), including those of the step being collected;
a chunk that no live worker holds is an error, never a wait.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Protocol

import torch

from reco_megatron.rollout.requests import SamplingParams
from reco_megatron.trainer.orchestration.source import StepPrompts, prompt_seed
from reco_megatron.trainer.orchestration.workers import WorkerLost
from reco_megatron.utils.logging import get_logger

logger = get_logger(__name__)


class Workers(Protocol):
    """What the book needs of the worker pool (:class:`~.rollout_workers.WorkerPool`)."""

    @property
    def alive(self) -> list[int]: ...

    def send(self, wid: int, msg: dict[str, Any]) -> None:
        """Raises :class:`WorkerLost` when the worker is gone."""

    def next_event(self, waiting_for: str) -> tuple[int, dict[str, Any]]:
        """The next message of a live worker; raises :class:`WorkerLost`."""

    def mark_dead(self, wid: int) -> None: ...


@dataclass
class Chunk:
    """Some of a step's groups, asked of one worker."""

    index: int
    worker: int
    groups: list[int]
    """Positions in the step's prompts."""


Encode = Callable[[list[int], list[int]], tuple[list[list[int]], list[str]]]
"""``(indices, groups) -> (prompt token ids, golds)``: :meth:`PromptSource.encode`."""
Rows = Callable[[list[int], list[int]], list[dict[str, Any]]]
"""``(indices, groups) -> records``: :meth:`PromptSource.rows` (what an episode's
environment resets from)."""


class GroupDispatcher:
    """Requests to the workers and their results, by step and chunk (global rank 0)."""

    def __init__(
        self,
        pool: Workers,
        encode: Encode,
        sampling: SamplingParams,
        *,
        seed: int,
        group_size: int,
        max_staleness: int,
        stop_on_failure: bool,
        rows: Rows | None = None,
    ) -> None:
        self.pool = pool
        self.encode = encode
        self.rows = rows
        """Multi-turn episodes (``rollout.env``): each request carries its prompts' records
        and the workers answer with whole episodes; None: single-turn responses."""
        self.sampling = sampling
        self.seed = seed
        self.group_size = group_size
        self.k = max_staleness
        self.stop_on_failure = stop_on_failure
        self.steps: dict[int, StepPrompts] = {}  # dispatched, not yet collected
        self.chunks: dict[int, list[Chunk]] = {}
        self.results: dict[tuple[int, int], dict[str, Any]] = {}  # (step, chunk) -> result
        self.requests: dict[int, tuple[int, int, int]] = {}  # id -> (step, chunk, min_version)
        self.next_request = 0
        self.version = -1
        """The newest weight version pushed: new requests may not be generated below it."""
        self.failure: WorkerLost | None = None
        """Set when the run must stop (``worker_failure=stop``, or no worker left)."""

    # ------------------------------------------------------------------ requests
    def send_step(self, step: int, drawn: StepPrompts) -> None:
        """Split step ``step``'s groups over the live workers, one request each."""
        self.steps[step] = drawn
        self.chunks[step] = []
        alive = self.pool.alive
        if self.failure is not None or not alive:
            return  # the run stops at the next collect (the failure is recorded)
        n = len(drawn.indices)
        bounds = [round(i * n / len(alive)) for i in range(len(alive) + 1)]
        for c, wid in enumerate(alive):
            groups = list(range(bounds[c], bounds[c + 1]))
            if groups:
                self.chunks[step].append(Chunk(c, wid, groups))
                self._request(step, self.chunks[step][-1])

    def _request(self, step: int, chunk: Chunk) -> None:
        drawn = self.steps[step]
        rows = self.rows(drawn.indices, chunk.groups) if self.rows is not None else None
        if rows is not None:
            prompts = [row["prompt_ids"] for row in rows]
        else:
            prompts, _ = self.encode(drawn.indices, chunk.groups)
        sampling = [
            replace(self.sampling, seed=prompt_seed(self.seed, step - 1, g)) for g in chunk.groups
        ]
        rid = self.next_request
        self.next_request += 1
        self.requests[rid] = (step, chunk.index, self.version)
        msg = {"kind": "generate", "id": rid, "prompts": prompts, "n": self.group_size}
        msg.update(sampling=sampling, min_version=self.version, rows=rows)
        try:
            self.pool.send(chunk.worker, msg)
        except WorkerLost as exc:
            self.lose(exc.worker, exc.why)

    # ------------------------------------------------------------------ failures
    def lose(self, wid: int, why: str) -> None:
        """A lost worker: record the run's stop, or hand its requests to the live workers."""
        self.pool.mark_dead(wid)
        alive = self.pool.alive
        if self.stop_on_failure or not alive:
            self.failure = self.failure or WorkerLost(wid, why)
            return
        logger.warning("rollout worker %d %s; carrying on with workers %s", wid, why, alive)
        for step, chunks in self.chunks.items():
            for chunk in chunks:
                key = (step, chunk.index)
                if chunk.worker == wid and key not in self.results:
                    for rid in [r for r, k in self.requests.items() if k[:2] == key]:
                        del self.requests[rid]  # the dead worker's answer is never taken
                    chunk.worker = alive[(step + chunk.index) % len(alive)]
                    self._request(step, chunk)

    # ------------------------------------------------------------------ results
    def collect(self, step: int) -> tuple[list[Any], list[Any] | None, dict[str, float]]:
        """Every group of ``step``, generated with weights at most ``K`` versions old:
        ``(groups, episodes, metrics)``, ``episodes[g]`` group ``g``'s ``result.episodes``
        record (multi-turn; None for single-turn responses).

        Raises :class:`WorkerLost` when the run must stop, and ``RuntimeError`` when a chunk
        is held by no live worker (a bookkeeping fault: never a wait without an end)."""
        if step not in self.steps:
            raise RuntimeError(f"separate rollout: step {step} was never sent to the workers")
        start = time.perf_counter()
        oldest = (step - 1) - self.k
        dropped = 0
        while True:
            if self.failure is not None:
                raise self.failure
            missing = [c for c in self.chunks[step] if (step, c.index) not in self.results]
            if not missing:
                break
            orphans = [c for c in missing if c.worker not in self.pool.alive]
            if orphans:
                raise RuntimeError(
                    f"separate rollout: the groups {orphans[0].groups} of step {step} were "
                    f"asked of rollout worker {orphans[0].worker}, which is gone, and of no "
                    "live worker"
                )
            try:
                wid, msg = self.pool.next_event(f"the groups of step {step}")
            except WorkerLost as exc:
                self.lose(exc.worker, exc.why)
                continue
            if msg["kind"] == "error":
                raise WorkerLost(wid, f"failed generating: {msg['message']}")
            if msg["kind"] != "result" or msg["request"] not in self.requests:
                continue
            *key, floor = self.requests.pop(msg["request"])
            version = int(msg["version"])
            if version < floor:  # it would be dropped and asked again without end
                raise RuntimeError(
                    f"rollout worker {wid} answered request {msg['request']} (step {key[0]}) with "
                    f"weights version {version}, below the version {floor} it was asked for"
                )
            if key[0] == step and version < oldest:
                chunk = next(c for c in self.chunks[step] if c.index == key[1])
                dropped += len(chunk.groups)
                chunk.worker = wid
                self._request(step, chunk)
                continue
            self.results[(key[0], key[1])] = msg
        return self._assemble(step, dropped, time.perf_counter() - start)

    def _assemble(
        self, step: int, dropped: int, waited: float
    ) -> tuple[list[Any], list[Any] | None, dict[str, float]]:
        drawn = self.steps.pop(step)
        groups: list[Any] = [None] * len(drawn.indices)
        episodes: list[Any] = [None] * len(drawn.indices)
        ages, idle, generate = [], 0.0, 0.0
        for chunk in self.chunks.pop(step):
            msg = self.results.pop((step, chunk.index))
            age = (step - 1) - int(msg["version"])
            if age < 0 or age > self.k:
                raise RuntimeError(
                    f"step {step}: groups of weights version {msg['version']} (staleness {age}) "
                    f"passed the staleness check of max_staleness={self.k}"
                )
            for g, completions in zip(chunk.groups, msg["completions"], strict=True):
                groups[g] = completions
            if (msg["episodes"] is None) != (self.rows is None):
                raise RuntimeError(
                    f"step {step}: rollout worker {chunk.worker} answered with "
                    f"{'single-turn responses' if self.rows else 'episodes'}, asked for "
                    f"{'episodes' if self.rows else 'single-turn responses'}"
                )
            if msg["episodes"] is not None:
                for g, record in zip(chunk.groups, msg["episodes"], strict=True):
                    episodes[g] = record
            ages += [age] * len(chunk.groups)
            idle += float(msg["idle_s"])
            generate = max(generate, float(msg["generate_s"]))
        ages_t = torch.tensor(ages, dtype=torch.float64)
        metrics = {
            "staleness_mean": float(ages_t.mean()),
            "staleness_max": float(ages_t.max()),
            "groups_dropped_stale": float(dropped),
            "trainer_wait_s": waited,
            "worker_idle_s": idle,
            "worker_generate_s": generate,
            "rollout_workers_alive": float(len(self.pool.alive)),
        }
        return groups, episodes if self.rows is not None else None, metrics
