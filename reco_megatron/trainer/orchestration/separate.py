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

from collections import deque
from pathlib import Path
from typing import Any

import torch.distributed as dist

from reco_megatron.parallel.layout import RankLayout
from reco_megatron.rollout.base import RolloutEngine
from reco_megatron.rollout.requests import SamplingParams
from reco_megatron.rollout.weight_transport import PushPlan, TensorSpec, dtype_name
from reco_megatron.trainer.config import TrainConfig
from reco_megatron.trainer.orchestration.dispatch import GroupDispatcher
from reco_megatron.trainer.orchestration.push import StageWeights, WeightPusher
from reco_megatron.trainer.orchestration.source import PromptSource, StepPrompts, StepRollout
from reco_megatron.trainer.orchestration.workers import WorkerLost, WorkerPool
from reco_megatron.utils.logging import get_logger

logger = get_logger(__name__)


class SeparateRollout:
    """The loop's source of groups under ``rollout.placement=separate`` (every trainer rank;
    the first rank talks to the workers through its :class:`GroupDispatcher`)."""

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
        env: dict[str, Any] | None = None,
    ) -> None:
        """``env``: the environment settings (``EnvSettings.to_wire()``) when every response
        is an episode (``rollout.env``): the workers run the episodes."""
        r = cfg.rollout
        self.cfg = cfg
        self.k = r.staleness_bound
        self.prompts = prompts
        self.layout = layout
        self.max_steps = cfg.trainer.max_steps
        self.pending: deque[tuple[int, StepPrompts]] = deque()  # dispatched, not yet trained
        self.version = -1
        self.pool = WorkerPool(r, run_dir, run_id) if layout.rank == 0 else None
        self.book = (
            GroupDispatcher(
                self.pool,
                prompts.encode,
                sampling,
                seed=cfg.trainer.seed,
                group_size=r.group_size,
                max_staleness=self.k,
                stop_on_failure=r.worker_failure == "stop",
                rows=prompts.rows if env is not None else None,
            )
            if self.pool is not None
            else None
        )
        plan = PushPlan(
            tuple(
                TensorSpec(name, shape, dtype_name(dtype), stage)
                for name, shape, dtype, stage in policy.plan()
            ),
            senders=layout.pp_size,
            bucket_bytes=r.weight_bucket_mb * 2**20,
        )
        self.pusher = WeightPusher(
            cfg, plan, policy.role(), policy, self.pool, spec, expected, run_id, env
        )
        if self.pool is not None:
            self.pool.wait_ready(plan.digest())

    # ------------------------------------------------------------------ the protocol
    def start(self, step: int) -> None:
        self._push(step)
        self._dispatch_ahead(step)

    def next_step(self, step: int) -> StepRollout:
        if not self.pending or self.pending[0][0] != step + 1:
            raise RuntimeError(f"separate rollout: step {step + 1} was never dispatched")
        _, drawn = self.pending.popleft()
        payload: list[Any] = [None]
        if self.book is not None:
            try:
                payload[0] = self.book.collect(step + 1)
            except WorkerLost as exc:
                payload[0] = (exc.worker, exc.why)
        dist.broadcast_object_list(payload, src=0)
        got = payload[0]
        if isinstance(got[0], int):  # (worker, message): every rank stops the same way
            raise WorkerLost(got[0], got[1])
        groups, episodes, metrics = got
        mine = self.prompts.mine(len(drawn.indices), self.layout.dp_rank, self.layout.dp_size)
        prompt_ids, golds = self.prompts.encode(drawn.indices, mine)
        completions = [groups[g] for g in mine]
        if episodes is None:
            return StepRollout(drawn.indices, prompt_ids, completions, golds, False, metrics)
        records = [episodes[g] for g in mine]  # as the colocated run's episodes of these groups
        names = records[0]["metrics"] if records else {}
        return StepRollout(
            drawn.indices,
            [r["prompt"] for r in records],
            completions,
            golds,
            False,
            metrics,
            turn_rewards=[r["turn_rewards"] for r in records],
            failed=[r["failed"] for r in records],
            counters={k: sum(r["metrics"][k] for r in records) for k in names},
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
            for path in self.pusher.store_files:
                path.unlink(missing_ok=True)

    # ------------------------------------------------------------------ internals
    def _push(self, version: int) -> float:
        seconds, lost = self.pusher.push(version)
        self.version = version
        if self.book is not None:
            self.book.version = version
            for wid in lost:
                said = self.pool.last_word(wid) if self.pool is not None else None
                why = f"failed to receive the weights of step {version}"
                self.book.lose(wid, f"{why} (it said: {said})" if said else why)
        return seconds

    def _dispatch_ahead(self, version: int) -> None:
        last = min(version + 1 + self.k, self.max_steps)
        while (self.pending[-1][0] if self.pending else version) < last:
            step = self.pending[-1][0] + 1 if self.pending else version + 1
            drawn = self.prompts.draw()
            self.pending.append((step, drawn))
            if self.book is not None:
                self.book.send_step(step, drawn)
