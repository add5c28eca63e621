"""The trainer's side of the weight push to separate rollout workers.

At start-up the first rank creates one ``FileStore`` per worker in the run's private
directory (``<output_dir>/rollout``, mode 0700: no other user can read or write it, unlike a
TCP store) and sends each worker its setup over the authenticated control channel (engine
settings, the push plan and its digest, the names and shapes every push must carry, where its
store is, and the tokens of its group); then every sending rank (one per pipeline stage, see
:meth:`StageWeights.role`) and each worker form a process group of their own (gloo on CPU;
NCCL when the trainer and the workers are on GPUs) and check each other's tokens before a
push (:func:`~reco_megatron.rollout.weight_transport.check_members`). One group per worker: a
worker that dies fails its own group only.

:meth:`WeightPusher.push` is collective over the trainer's ranks: the first rank announces the
version to the live workers, the exporting ranks export their stage, the senders send it in
buckets, and all ranks agree on which workers failed to receive it. The workers acknowledge
each version they received; their results carry the version that generated them.
"""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

from reco_megatron.parallel.collectives import collective_device
from reco_megatron.rollout.weight_transport import (
    TOKEN_BYTES,
    PushMismatch,
    PushPlan,
    check_members,
    send_push,
    weight_group,
)
from reco_megatron.trainer.config import TrainConfig
from reco_megatron.trainer.orchestration.workers import WorkerPool
from reco_megatron.utils.logging import get_logger

logger = get_logger(__name__)


class PushRole(Protocol):
    """This rank's part in a push."""

    @property
    def exporter(self) -> bool:
        """Runs its stage's export (collective over its TP group)."""
        ...

    @property
    def sender(self) -> int | None:
        """Its stage's index when it sends the stage's tensors, else None."""
        ...


class StageWeights(Protocol):
    """What the push needs of the policy
    (:class:`~reco_megatron.trainer.orchestration.engines.PolicyStages` binds the adapter's
    export)."""

    @property
    def on_gpu(self) -> bool:
        """Whether the policy trains on a GPU (NCCL groups then, when the workers have one)."""
        ...

    def role(self) -> PushRole:
        """This rank's part in a push."""
        ...

    def plan(self) -> list[tuple[str, tuple[int, ...], torch.dtype, int]]:
        """``(hf_name, shape, dtype, stage)`` of every tensor a push carries, in order
        (collective over the pipeline group)."""
        ...

    def stage_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """This pipeline stage's ``(hf_name, tensor)`` pairs (collective over its TP group)."""
        ...


class WeightPusher:
    """Weight groups to the workers and the push of each version (every trainer rank)."""

    def __init__(
        self,
        cfg: TrainConfig,
        plan: PushPlan,
        role: PushRole,
        policy: StageWeights,
        pool: WorkerPool | None,
        spec: dict[str, Any],
        expected: dict[str, tuple[int, ...]],
        run_id: str,
        env: dict[str, Any] | None = None,
    ) -> None:
        self.cfg = cfg
        self.plan = plan
        self.role = role
        self.policy = policy
        self.pool = pool
        self.digest = plan.digest()
        timeout = float(cfg.rollout.worker_timeout_s)
        shared: list[Any] = [None]
        if pool is not None:
            workers = pool.workers
            on_gpu = policy.on_gpu and all(h.cuda for h in workers.values())
            backend = "nccl" if on_gpu else "gloo"
            stores = {}
            for wid in sorted(workers):
                path = pool.dir / f"weights-{secrets.token_hex(8)}-w{wid}.store"
                os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600))
                stores[wid] = str(path)
            tokens = {w: (secrets.token_bytes(TOKEN_BYTES), secrets.token_bytes(TOKEN_BYTES))
                      for w in workers}  # fmt: skip
            shared[0] = (stores, tokens, sorted(workers), backend)
        dist.broadcast_object_list(shared, src=0)  # the trainer's own world (trusted)
        stores, tokens, self.worker_ids, self.backend = shared[0]
        self.store_files = [Path(p) for p in stores.values()] if pool is not None else []
        self.device = (
            torch.device("cuda", torch.cuda.current_device())
            if self.backend == "nccl"
            else torch.device("cpu")
        )
        prefix = f"reco-weights/{run_id}"
        if pool is not None:
            pool.setup(
                {
                    wid: {
                        "engine": spec,
                        "plan": plan.to_json(),
                        "plan_digest": plan.digest(),
                        "expected": {k: list(v) for k, v in expected.items()},
                        "store_path": stores[wid],
                        "group_prefix": f"{prefix}/{wid}",
                        "backend": self.backend,
                        "transport_device": "cuda" if self.backend == "nccl" else "cpu",
                        "timeout_s": timeout,
                        # a sender waits up to one timeout on each dead worker before it
                        # moves on: a live worker's receive must outlast all of them
                        "receive_timeout_s": timeout * (1 + len(self.worker_ids)),
                        "heartbeat_s": pool.heartbeat_s,
                        "generate_timeout_s": float(cfg.rollout.generate_timeout_s),
                        "worker_token": tokens[wid][0],
                        "trainer_token": tokens[wid][1],
                        "env": env,
                    }
                    for wid in self.worker_ids
                }
            )
        self.groups: dict[int, dist.ProcessGroup] = {}
        if role.sender is not None:
            for wid in self.worker_ids:
                # world size -1: the trainer deletes the file at the end, not the last member
                store = dist.FileStore(stores[wid], -1)
                self.groups[wid] = weight_group(
                    store,
                    f"{prefix}/{wid}",
                    role.sender,
                    plan.senders + 1,
                    backend=self.backend,
                    timeout_s=timeout,
                )
            for wid in self.worker_ids:  # every member is a worker this trainer admitted
                worker_token, trainer_token = tokens[wid]
                check_members(
                    self.groups[wid], role.sender, [plan.senders], trainer_token, worker_token,
                    self.device, receive_first=True,
                )  # fmt: skip
        self.alive = list(self.worker_ids)
        logger.info(
            "weight push: %d tensor(s), %.1f MiB in %d bucket(s) from %d sender(s) to %d "
            "worker(s) over %s",
            len(plan.tensors),
            plan.total_bytes / 2**20,
            len(plan.buckets),
            plan.senders,
            len(self.worker_ids),
            self.backend,
        )

    def push(self, version: int) -> tuple[float, list[int]]:
        """Send the current weights as ``version`` to every live worker (collective over the
        trainer's ranks). Returns the seconds it took and the workers that failed it (the
        same list on every rank)."""
        start = time.perf_counter()
        alive: list[Any] = [None]
        if self.pool is not None:
            alive[0] = [w for w in self.pool.alive if w in self.alive]
            for wid in list(alive[0]):
                try:
                    msg = {"kind": "weights", "version": version, "plan_digest": self.digest}
                    self.pool.send(wid, msg)
                except Exception:
                    alive[0].remove(wid)
        dist.broadcast_object_list(alive, src=0)
        targets = alive[0]
        # one more slot: this rank's stream disagreed with the plan (every rank stops on it)
        failed = torch.zeros(len(self.worker_ids) + 1, dtype=torch.float32)
        mismatch = ""
        if self.role.exporter:
            stream = self.policy.stage_weights()
            if self.role.sender is not None:
                pairs = [(self.groups[w], self.plan.senders) for w in targets]
                try:
                    _, bad = send_push(
                        pairs, self.plan, self.role.sender, version, stream, self.device
                    )
                except PushMismatch as exc:
                    bad, mismatch = set(), str(exc)
                    failed[-1] = 1.0
                    for _ in stream:  # the rest of the export is still collective
                        pass
                for i in bad:
                    failed[self.worker_ids.index(targets[i])] = 1.0
            else:
                for _ in stream:  # the TP all-gathers of the export are collective
                    pass
        for wid in self.worker_ids:
            if wid not in targets:
                failed[self.worker_ids.index(wid)] = 1.0
        failed = failed.to(collective_device(None))
        dist.all_reduce(failed, op=dist.ReduceOp.MAX)
        failed = failed.cpu()
        if failed[-1] > 0:
            raise PushMismatch(
                mismatch or "weight push: another rank's stream disagreed with the plan"
            )
        lost = [w for i, w in enumerate(self.worker_ids) if failed[i] > 0 and w in self.alive]
        self.alive = [w for w in self.alive if w not in lost]
        return time.perf_counter() - start, lost
