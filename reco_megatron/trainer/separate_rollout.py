"""Separate placement: groups from rollout workers that generate while the trainer trains.

The trainer keeps the order of everything: its one sampler draws each step's prompts, its
first rank sends them to the workers (split by groups, each prompt seeded as colocated) up to
``K = rollout.max_staleness`` steps ahead of the weights, so while step ``s`` trains the
workers already generate steps ``s + 1 .. s + K`` with weights at most ``K`` steps old. Each
result carries the version of the weights that generated it; step ``s`` takes only groups of
version ``>= s - 1 - K`` (an older one is dropped, counted in ``groups_dropped_stale`` and
generated again), so staleness is bounded by construction and checked anyway. With ``K = 0``
the trainer waits for the groups of its own weights: a synchronous run on other devices,
bit for bit the colocated one with one worker.

After each update the ranks that hold the weights push them to every worker
(:mod:`reco_megatron.rollout.weight_transport`), and the workers load them between two
generation calls. A worker that dies or falls silent is noticed within
``rollout.worker_timeout_s``: the run stops resumably (``worker_failure=stop``) or its groups
go to the others (``continue``).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from reco_megatron.parallel.layout import RankLayout
from reco_megatron.rollout.base import RolloutEngine, SamplingParams
from reco_megatron.rollout.weight_transport import PushPlan, TensorSpec, dtype_name
from reco_megatron.trainer.config import TrainConfig
from reco_megatron.trainer.rollout_source import PromptSource, StepPrompts, StepRollout, prompt_seed
from reco_megatron.trainer.rollout_workers import WorkerLost, WorkerPool
from reco_megatron.trainer.weight_push import StageWeights, WeightPusher
from reco_megatron.utils.logging import get_logger

logger = get_logger(__name__)


class SeparateRollout:
    """The loop's source of groups under ``rollout.placement=separate`` (every trainer rank;
    the first rank talks to the workers)."""

    def __init__(
        self,
        cfg: TrainConfig,
        spec: dict[str, Any],
        sampling: SamplingParams,
        expected: dict[str, tuple[int, ...]],
        policy: StageWeights,
        prompts: PromptSource,
        layout: RankLayout,
        run_dir: Path,
        run_id: str,
    ) -> None:
        r = cfg.rollout
        self.cfg = cfg
        self.k = r.staleness_bound
        self.prompts = prompts
        self.layout = layout
        self.sampling = sampling
        self.max_steps = cfg.trainer.max_steps
        self.pending: deque[tuple[int, StepPrompts]] = deque()  # dispatched, not yet trained
        self.results: dict[tuple[int, int], dict[str, Any]] = {}  # (step, chunk) -> result
        self.requests: dict[int, tuple[int, int]] = {}  # request id -> (step, chunk)
        self.chunks: dict[
            int, list[tuple[int, int, list[int]]]
        ] = {}  # step -> [(chunk, wid, groups)]
        self.next_request = 0
        self.version = -1
        self.dropped = 0
        self.failure: WorkerLost | None = None  # raised at the next step, on every rank
        self.pool = WorkerPool(r, run_dir, run_id) if layout.rank == 0 else None
        plan = PushPlan(
            tuple(
                TensorSpec(name, shape, dtype_name(dtype), stage)
                for name, shape, dtype, stage in policy.plan()
            ),
            senders=layout.pp_size,
            bucket_bytes=r.weight_bucket_mb * 2**20,
        )
        self.pusher = WeightPusher(
            cfg, plan, policy.role(), policy, self.pool, spec, expected, run_id
        )
        if self.pool is not None:
            self.pool.wait_ready()

    # ------------------------------------------------------------------ the protocol
    def start(self, step: int) -> None:
        self._push(step)
        self._dispatch_ahead(step)

    def next_step(self, step: int) -> StepRollout:
        if not self.pending or self.pending[0][0] != step + 1:
            raise RuntimeError(f"separate rollout: step {step + 1} was never dispatched")
        _, drawn = self.pending.popleft()
        payload: list[Any] = [None]
        if self.layout.rank == 0:
            try:
                if self.failure is not None:
                    raise self.failure
                payload[0] = self._collect(step + 1, drawn)
            except WorkerLost as exc:
                payload[0] = (exc.worker, exc.why)
        dist.broadcast_object_list(payload, src=0)
        got = payload[0]
        if isinstance(got[0], int):  # (worker, message): every rank stops the same way
            raise WorkerLost(got[0], got[1])
        groups, metrics = got
        mine = self.prompts.mine(len(drawn.indices), self.layout.dp_rank, self.layout.dp_size)
        prompt_ids, golds = self.prompts.encode(drawn.indices, mine)
        return StepRollout(
            drawn.indices, prompt_ids, [groups[g] for g in mine], golds, False, metrics
        )

    def before_update(self) -> None:
        pass  # the workers have devices of their own

    def after_update(self, version: int) -> dict[str, float]:
        seconds = self._push(version)
        self._dispatch_ahead(version)
        return {"weight_push_s": seconds}

    def sampler_state(self) -> dict[str, Any]:
        if self.pending:
            return self.pending[0][1].sampler_before  # a resume draws the in-flight steps again
        return self.prompts.sampler.state_dict()

    def state_dict(self) -> dict[str, Any]:
        groups = len(self.pending) * self.cfg.rollout.prompts_per_step
        return {
            "placement": "separate",
            "in_flight_steps": [s for s, _ in self.pending],
            "in_flight_groups": groups,
            "version": self.version,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("placement") != "separate" or not state.get("in_flight_groups"):
            return
        steps = state.get("in_flight_steps") or []
        logger.info(
            "resume: %d group(s) of steps %s were in flight at the checkpoint; they are "
            "discarded and generated again with the resumed weights",
            state["in_flight_groups"],
            steps,
        )

    @property
    def engine(self) -> RolloutEngine:
        raise RuntimeError(
            "separate placement: the trainer holds no rollout engine (evaluate checkpoints "
            "with reco-eval)"
        )

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()

    # ------------------------------------------------------------------ internals
    def _push(self, version: int) -> float:
        seconds, lost = self.pusher.push(version)
        self.version = version
        for wid in lost:
            self._lose(wid, f"failed to receive the weights of step {version}")
        return seconds

    def _lose(self, wid: int, why: str) -> None:
        """A lost worker (rank 0 acts; the others learn it at the next step): stop the run
        there, or hand its requests to the live workers."""
        if self.pool is None:
            return
        self.pool.mark_dead(wid)
        alive = self.pool.alive
        if self.cfg.rollout.worker_failure == "stop" or not alive:
            self.failure = self.failure or WorkerLost(wid, why)
            return
        logger.warning("rollout worker %d %s; carrying on with workers %s", wid, why, alive)
        self._reassign(wid)

    def _dispatch_ahead(self, version: int) -> None:
        last = min(version + 1 + self.k, self.max_steps)
        while (self.pending[-1][0] if self.pending else version) < last:
            step = self.pending[-1][0] + 1 if self.pending else version + 1
            drawn = self.prompts.draw()
            self.pending.append((step, drawn))
            if self.pool is not None:
                self._send_step(step, drawn)

    def _send_step(self, step: int, drawn: StepPrompts) -> None:
        """Split step ``step``'s groups over the live workers, one request each (rank 0)."""
        assert self.pool is not None
        alive = self.pool.alive
        if self.failure is not None or not alive:
            return  # the run stops at the next step (the failure is recorded)
        n = len(drawn.indices)
        bounds = [round(i * n / len(alive)) for i in range(len(alive) + 1)]
        self.chunks[step] = []
        for c, wid in enumerate(alive):
            groups = list(range(bounds[c], bounds[c + 1]))
            if groups:
                self.chunks[step].append((c, wid, groups))
                self._request(step, c, wid, groups, drawn)

    def _request(
        self, step: int, chunk: int, wid: int, groups: list[int], drawn: StepPrompts
    ) -> None:
        assert self.pool is not None
        prompts, _ = self.prompts.encode(drawn.indices, groups)
        seed = self.cfg.trainer.seed
        sampling = [replace(self.sampling, seed=prompt_seed(seed, step - 1, g)) for g in groups]
        rid = self.next_request
        self.next_request += 1
        self.requests[rid] = (step, chunk)
        msg = {"kind": "generate", "id": rid, "prompts": prompts, "n": self.cfg.rollout.group_size}
        msg.update(sampling=sampling, min_version=self.version)
        try:
            self.pool.send(wid, msg)
        except WorkerLost as exc:
            self._lose(wid, exc.why)

    def _reassign(self, dead: int) -> None:
        """Send the dead worker's unanswered requests to the live ones (rank 0)."""
        assert self.pool is not None
        for step, chunks in self.chunks.items():
            drawn = next((d for s, d in self.pending if s == step), None)
            for i, (c, wid, groups) in enumerate(chunks):
                if wid == dead and (step, c) not in self.results and drawn is not None:
                    new = self.pool.alive[(step + c) % len(self.pool.alive)]
                    chunks[i] = (c, new, groups)
                    self._request(step, c, new, groups, drawn)

    def _collect(self, step: int, drawn: StepPrompts) -> tuple[list[Any], dict[str, float]]:
        """Every group of ``step`` from the workers, fresh enough (rank 0)."""
        assert self.pool is not None
        start = time.perf_counter()
        oldest = (step - 1) - self.k
        dropped = 0
        while any((step, c) not in self.results for c, _, _ in self.chunks[step]):
            try:
                wid, msg = self.pool.next_event(f"the groups of step {step}")
            except WorkerLost as exc:
                self._lose(exc.worker, exc.why)
                if self.failure is not None:
                    raise self.failure from None
                continue
            if msg["kind"] == "error":
                raise WorkerLost(wid, f"failed generating: {msg['message']}")
            if msg["kind"] != "result" or msg["request"] not in self.requests:
                continue
            key = self.requests.pop(msg["request"])
            if key[0] == step and int(msg["version"]) < oldest:
                c, _, groups = next(x for x in self.chunks[step] if x[0] == key[1])
                dropped += len(groups)
                self._request(step, c, wid, groups, drawn)
                continue
            self.results[key] = msg
        groups: list[Any] = [None] * len(drawn.indices)
        ages, idle, generate = [], 0.0, 0.0
        for c, _, members in self.chunks.pop(step):
            msg = self.results.pop((step, c))
            age = (step - 1) - int(msg["version"])
            if age < 0 or age > self.k:
                raise RuntimeError(
                    f"step {step}: groups of weights version {msg['version']} (staleness {age}) "
                    f"passed the staleness check of max_staleness={self.k}"
                )
            for g, completions in zip(members, msg["completions"], strict=True):
                groups[g] = completions
            ages += [age] * len(members)
            idle += float(msg["idle_s"])
            generate = max(generate, float(msg["generate_s"]))
        self.dropped += dropped
        ages_t = torch.tensor(ages, dtype=torch.float64)
        metrics = {
            "staleness_mean": float(ages_t.mean()),
            "staleness_max": float(ages_t.max()),
            "groups_dropped_stale": float(dropped),
            "trainer_wait_s": time.perf_counter() - start,
            "worker_idle_s": idle,
            "worker_generate_s": generate,
            "rollout_workers_alive": float(len(self.pool.alive)),
        }
        return groups, metrics
