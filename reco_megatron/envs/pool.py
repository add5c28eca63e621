"""Environment workers: every episode's environment in an isolated process, every call timed.

The pool starts ``num_workers`` workers (:mod:`reco_megatron.envs._worker`, the reward
workers' keeper and containment). An episode lives in one worker (its environment object
holds the episode's state) and its calls run there one at a time; calls of episodes in
different workers run concurrently, so at most ``num_workers`` tool steps run at once. A call
past ``step_timeout_s`` gets its worker SIGKILLed and replaced (with everything the
environment started); a worker that dies or runs out of memory is replaced likewise. The
episode of that call fails (``timeout``, ``crash``, ``memory``), and so do the other episodes
that lived in the killed worker (``lost``: their state went with it). An exception in the
environment or an invalid return value fails only its episode (``error``, ``invalid``). The
pool never raises for what an environment does; a failed episode is scored 0 by the caller.

    with EnvPool("calculator", num_workers=4, step_timeout_s=30, tokenizer="tok.model") as pool:
        out = pool.reset({0: row, 1: row})             # episode id -> Outcome
        out = pool.step({0: (action_ids, "stop")})      # blocks until every step is back
        pool.submit({1: (action_ids, "stop")})          # or: start steps, ...
        out = pool.collect(block=True)                  # ... take them as they finish
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

import reco_megatron
from reco_megatron.envs.contract import MAX_MESSAGE_BYTES
from reco_megatron.envs.registry import EnvSpecError, resolve_env
from reco_megatron.rewards.containment import start_worker, stop_worker
from reco_megatron.utils.logging import get_logger

log = get_logger(__name__)

FAILURES: tuple[str, ...] = ("error", "invalid", "timeout", "crash", "memory", "lost")
"""How an environment call can fail (each counted in ``env/<kind>/sum``)."""


@dataclass
class Outcome:
    """One call's result: ``ok`` with the returned values, or a failure ``status``."""

    ok: bool
    status: str = "ok"
    detail: str = ""
    values: dict[str, Any] = field(default_factory=dict)
    """``reset``: ``prompt``, ``stop_ids``; ``step``: ``obs``, ``done``, ``reward``,
    ``stop_ids`` (validated token ids and numbers)."""
    seconds: float = 0.0


@dataclass
class _Worker:
    proc: subprocess.Popen
    conn: Connection
    ready: bool = False
    started: float = 0.0
    busy: int | None = None
    """The episode whose call is in flight."""
    since: float = 0.0


class EnvPool:
    """Isolated environment workers; use as a context manager or call :meth:`close`."""

    def __init__(
        self,
        spec: str,
        *,
        num_workers: int = 8,
        step_timeout_s: float = 30.0,
        memory_limit_mb: int | None = 4096,
        tokenizer: str = "",
        vocab_size: int | None = None,
        max_ids: int = 1 << 16,
        start_timeout_s: float = 60.0,
    ) -> None:
        resolve_env(spec)  # fail fast in the caller, with the spec's one-line error
        self.spec = spec
        self.step_timeout_s = step_timeout_s
        self.start_timeout_s = start_timeout_s
        self._first = (spec, memory_limit_mb, tokenizer, vocab_size, max_ids)
        self.home: dict[int, int] = {}
        """Episode id -> the worker holding its environment."""
        self.lost: set[int] = set()
        self.restarts = 0
        self._queues: list[deque[int]] = [deque() for _ in range(num_workers)]
        self._requests: dict[int, dict[str, Any]] = {}
        self._done: dict[int, Outcome] = {}
        self._warned: set[str] = set()
        self._workers: list[_Worker] = []
        try:
            self._workers = [self._start() for _ in range(num_workers)]
            for index in range(num_workers):
                self._wait_ready(index)
        except BaseException:
            self.close()
            raise

    # -- workers ------------------------------------------------------------------------
    def _start(self) -> _Worker:
        env = dict(os.environ)
        root = os.path.dirname(os.path.dirname(os.path.abspath(reco_megatron.__file__)))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        spec, memory, tokenizer, vocab, max_ids = self._first
        first = (list(sys.path), spec, memory, tokenizer, vocab, max_ids)
        proc, conn = start_worker(env, first, module="reco_megatron.envs._worker")
        return _Worker(proc=proc, conn=conn, started=time.monotonic())

    def _wait_ready(self, index: int) -> None:
        worker = self._workers[index]
        if not worker.conn.poll(self.start_timeout_s):
            raise RuntimeError(
                f"environment worker for rollout.env={self.spec!r} not ready after "
                f"{self.start_timeout_s} s"
            )
        try:
            msg = json.loads(worker.conn.recv_bytes(MAX_MESSAGE_BYTES))
        except (EOFError, OSError) as exc:
            raise RuntimeError(
                f"environment worker for rollout.env={self.spec!r} died while starting (exit "
                f"code {worker.proc.poll()}); is the memory limit too small to import it?"
            ) from exc
        if not isinstance(msg, dict) or msg.get("ready") is not True:
            detail = msg.get("init_error") if isinstance(msg, dict) else msg
            raise EnvSpecError(f"rollout.env={self.spec!r} failed in a worker: {detail}")
        worker.ready = True

    def _replace(self, index: int, why: str) -> None:
        """Kill worker ``index`` (and what it started), start another; its episodes are lost."""
        stop_worker(self._workers[index].proc, self._workers[index].conn)
        for eid, home in self.home.items():
            if home == index:
                self.lost.add(eid)
        self._workers[index] = self._start()
        self._wait_ready(index)
        self.restarts += 1
        log.debug("environment worker %d replaced (%s)", index, why)

    # -- calls --------------------------------------------------------------------------
    def reset(self, rows: dict[int, dict[str, Any]]) -> dict[int, Outcome]:
        """Build and reset one environment per episode id (ids must be new)."""
        for eid in rows:
            counts = [sum(1 for h in self.home.values() if h == w) for w in range(self.size)]
            self.home[eid] = counts.index(min(counts))
        return self._run({eid: {"op": "reset", "id": eid, "row": row} for eid, row in rows.items()})

    def step(self, actions: dict[int, tuple[list[int], str]]) -> dict[int, Outcome]:
        """One step of every given episode: ``{id: (action_ids, finish)}``."""
        return self._run({eid: self._step_request(eid, *a) for eid, a in actions.items()})

    def submit(self, actions: dict[int, tuple[list[int], str]]) -> None:
        """Start these steps and return at once; :meth:`collect` gives their outcomes."""
        for eid, (action, finish) in actions.items():
            self._enqueue(eid, self._step_request(eid, action, finish))

    def collect(self, block: bool) -> dict[int, Outcome]:
        """Outcomes of submitted steps that finished: with ``block``, at least one (unless
        none is in flight), else whatever is done now."""
        while True:
            self._pump(None if block else 0.0)
            if self._done or not block or not self._in_flight():
                done, self._done = self._done, {}
                return done

    @staticmethod
    def _step_request(eid: int, action: list[int], finish: str) -> dict[str, Any]:
        return {"op": "step", "id": eid, "action": list(action), "finish": finish}

    def release(self, eids: list[int]) -> None:
        """Drop the environments of finished episodes (their workers free them)."""
        for eid in eids:
            home = self.home.pop(eid, None)
            self.lost.discard(eid)
            if home is not None and self._workers[home].ready:
                with contextlib.suppress(BrokenPipeError, OSError):
                    self._workers[home].conn.send_bytes(
                        json.dumps({"op": "close", "id": eid}).encode()
                    )

    @property
    def size(self) -> int:
        return len(self._workers)

    def _run(self, requests: dict[int, dict[str, Any]]) -> dict[int, Outcome]:
        """Run ``requests`` to their end (nothing else may be in flight)."""
        for eid, request in requests.items():
            self._enqueue(eid, request)
        while self._in_flight():
            self._pump(None)
        done, self._done = self._done, {}
        return done

    def _enqueue(self, eid: int, request: dict[str, Any]) -> None:
        if eid in self.lost or eid not in self.home:
            self._done[eid] = Outcome(False, "lost", "its worker was replaced")
        else:
            self._requests[eid] = request
            self._queues[self.home[eid]].append(eid)

    def _in_flight(self) -> bool:
        return any(self._queues) or any(w.busy is not None for w in self._workers)

    def _pump(self, wait_s: float | None) -> None:
        """Send queued calls to idle workers, wait up to ``wait_s`` (None: until something
        happens) for answers and deadlines, and file what finished in ``_done``."""
        for index, worker in enumerate(self._workers):
            queue = self._queues[index]
            while worker.busy is None and queue:
                eid = queue.popleft()
                request = self._requests.pop(eid)
                if eid in self.lost:
                    self._done[eid] = Outcome(False, "lost", "its worker was replaced")
                    continue
                try:
                    worker.conn.send_bytes(json.dumps(request).encode())
                except (BrokenPipeError, OSError):
                    self._done[eid] = self._fail(index, eid, "crash", "the worker was gone")
                    continue
                worker.busy, worker.since = eid, time.monotonic()
        busy = [w for w in self._workers if w.busy is not None]
        if not busy:
            return
        left = min(w.since for w in busy) + self.step_timeout_s - time.monotonic()
        timeout = max(0.0, left if wait_s is None else min(wait_s, left))
        ready = wait([w.conn for w in busy], timeout=timeout)
        now = time.monotonic()
        for index, worker in enumerate(self._workers):
            eid = worker.busy
            if eid is None:
                continue
            if worker.conn in ready:
                self._done[eid] = self._receive(index, eid, now - worker.since)
            elif now - worker.since > self.step_timeout_s:
                why = f"over rollout.env_step_timeout_s={self.step_timeout_s}"
                self._done[eid] = self._fail(index, eid, "timeout", why)

    def _receive(self, index: int, eid: int, seconds: float) -> Outcome:
        worker = self._workers[index]
        try:
            raw = worker.conn.recv_bytes(MAX_MESSAGE_BYTES)
            msg = json.loads(raw)
            if not isinstance(msg, dict) or msg.get("id") != eid:
                raise ValueError(f"an answer for another call: {str(msg)[:100]}")
        except (EOFError, OSError) as exc:
            with contextlib.suppress(subprocess.TimeoutExpired):
                worker.proc.wait(timeout=1)
            why = f"the worker died (exit code {worker.proc.poll()})"
            return self._fail(
                index, eid, "memory" if isinstance(exc, MemoryError) else "crash", why
            )
        except ValueError as exc:  # not JSON, too long, out of order: a worker out of protocol
            return self._fail(index, eid, "crash", f"the worker broke the protocol ({exc})")
        worker.busy = None
        if msg.get("ok") is True:
            msg.pop("ok")
            msg.pop("id")
            return Outcome(True, values=msg, seconds=seconds)
        status = msg.get("status") if msg.get("status") in FAILURES else "error"
        outcome = Outcome(False, status, str(msg.get("detail", ""))[:500], seconds=seconds)
        self._warn_once(outcome)
        if status == "memory":  # the worker exits after a MemoryError
            self._replace(index, "MemoryError")
        return outcome

    def _fail(self, index: int, eid: int, status: str, detail: str) -> Outcome:
        self._workers[index].busy = None
        outcome = Outcome(False, status, detail)
        self._warn_once(outcome)
        self._replace(index, status)
        return outcome

    def _warn_once(self, outcome: Outcome) -> None:
        if outcome.status in self._warned:
            return
        self._warned.add(outcome.status)
        log.warning(
            "environment %r failed (%s): %s; the episode scores 0 and every such failure is "
            "counted in env_%s_sum (logged once per kind)",
            self.spec, outcome.status, outcome.detail, outcome.status,
        )  # fmt: skip

    # -- shutdown -----------------------------------------------------------------------
    def close(self) -> None:
        """Stop every worker and everything its environments started. Idempotent."""
        for worker in self._workers:
            with contextlib.suppress(BrokenPipeError, OSError):
                worker.conn.send_bytes(b"null")
        for worker in self._workers:
            with contextlib.suppress(subprocess.TimeoutExpired):
                worker.proc.wait(timeout=2)
            stop_worker(worker.proc, worker.conn)
        self._workers = []

    def __enter__(self) -> EnvPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_workers", None):
            self.close()
