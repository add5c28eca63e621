"""Score (response, gold) pairs in isolated worker processes: timeout, memory cap, no crash.

Each worker is a fresh interpreter (``python -m reco_megatron.rewards._worker``: not forked
from the trainer, whose torch threads and GPU state must not be copied, and not
multiprocessing's ``spawn``, which re-imports the caller's ``__main__``) that caps its
address space with ``RLIMIT_AS`` and imports the reward function once; no process the reward
starts outlives the worker, the pool or the trainer (``containment``). The parent hands one
item at a time to each worker and watches the clock: an item past ``timeout_s`` gets its
worker SIGKILLed and replaced, and scores 0.0; a worker that dies scores 0.0 and is
replaced; a MemoryError, an exception, or a return value that is not a finite number (NaN,
None, a string) scores 0.0. Each kind of failure (``types.FAILURE_KINDS``) is counted and
logged once per pool with an example. Responses are cut to their last
``max_response_chars`` characters before they are sent. The caller always gets one finite
score per item and counts of what went wrong::

    with RewardPool(RewardPoolConfig(reward="math", num_workers=4)) as pool:
        batch = pool.score(responses, golds)      # batch.scores: list[float], len == B
        log_metrics(batch.metrics)                # {"reward/timeouts/sum": 0.0, ...}
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

import reco_megatron
from reco_megatron.rewards import types as st
from reco_megatron.rewards.containment import start_worker, stop_worker
from reco_megatron.rewards.pool_config import RewardBatch, RewardPoolConfig
from reco_megatron.rewards.registry import RewardSpecError, resolve_reward
from reco_megatron.utils.logging import get_logger

log = get_logger(__name__)


@dataclass
class _Worker:
    proc: subprocess.Popen
    conn: Connection
    ready: bool = False
    started: float = 0.0
    item: int | None = None
    item_started: float = 0.0


class RewardPool:
    """A pool of reward worker processes; use as a context manager or call :meth:`close`."""

    def __init__(self, config: RewardPoolConfig | None = None) -> None:
        self.config = config or RewardPoolConfig()
        resolve_reward(self.config.reward)  # fail fast, in the caller, with a clear message
        if self.config.reward == "math" and self.config.grader_timeout_s >= self.config.timeout_s:
            log.warning(
                "reward.grader_timeout_s=%d is not below reward.timeout_s=%g: a slow grading is "
                "killed by the pool (a timeout) before math_verify's own limit reports it",
                self.config.grader_timeout_s,
                self.config.timeout_s,
            )
        self._workers: list[_Worker] = []
        self._checking = False
        self._warned: set[str] = set()
        self.restarts = 0
        try:
            self._workers = [self._start_worker() for _ in range(self.config.num_workers)]
            self._wait_ready()
            if self.config.self_check:
                self._self_check()
        except BaseException:
            self.close()
            raise

    # -- worker lifecycle ---------------------------------------------------------------
    def _start_worker(self) -> _Worker:
        env = dict(os.environ)
        package_root = os.path.dirname(os.path.dirname(os.path.abspath(reco_megatron.__file__)))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
        env[st.GRADER_TIMEOUT_ENV] = str(self.config.grader_timeout_s)
        first = (list(sys.path), self.config.reward, self.config.memory_limit_mb)
        proc, conn = start_worker(env, first)
        return _Worker(proc=proc, conn=conn, started=time.monotonic())

    @staticmethod
    def _kill(worker: _Worker) -> None:
        stop_worker(worker.proc, worker.conn)  # and every process its reward started

    def _replace(self, index: int) -> None:
        self._kill(self._workers[index])
        self._workers[index] = self._start_worker()
        self.restarts += 1

    def _on_ready_message(self, worker: _Worker) -> None:
        try:
            kind, detail = worker.conn.recv()
        except (EOFError, OSError) as exc:
            raise RuntimeError(
                f"reward worker for {self.config.reward!r} died while starting (exit code "
                f"{worker.proc.poll()}); is memory_limit_mb={self.config.memory_limit_mb} "
                "too small to import it?"
            ) from exc
        if kind != "ready":
            raise RewardSpecError(f"reward {self.config.reward!r} failed in a worker: {detail}")
        worker.ready = True

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.config.start_timeout_s
        while not all(w.ready for w in self._workers):
            waiting = [w for w in self._workers if not w.ready]
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(
                    f"{len(waiting)} reward worker(s) for {self.config.reward!r} not ready after "
                    f"start_timeout_s={self.config.start_timeout_s}; raise it on a slow machine"
                )
            for conn in wait([w.conn for w in waiting], timeout=left):
                self._on_ready_message(next(w for w in waiting if w.conn is conn))

    def _self_check(self) -> None:
        # ('', '') is not real data: a reward that rejects it (an error) is fine, one that
        # returns a non-number is not. Its error is reported once below, at INFO.
        self._checking = True
        try:
            batch = self.score([""], [""])
        finally:
            self._checking = False
        if batch.statuses[0] in (st.INVALID, st.NAN, st.NONE):
            raise RewardSpecError(
                f"reward {self.config.reward!r} returned a non-number (or an unknown status) for "
                "('', ''): it must return a finite float or a RewardResult"
            )
        if batch.statuses[0] == st.ERROR:
            log.info(
                "reward %r rejects ('', '') with an error: fine, it validates its input",
                self.config.reward,
            )
        elif batch.statuses[0] in (st.TIMEOUT, st.CRASH):
            log.warning(
                "reward %r self-check on ('', '') gave %s; continuing (items like it score 0.0)",
                self.config.reward,
                batch.statuses[0],
            )

    def trial(self, response: str, gold: str) -> tuple[str, str]:
        """Score one item quietly (no failure warning): its status and what went wrong."""
        self._checking = True
        try:
            batch = self.score([response], [gold])
        finally:
            self._checking = False
        return batch.statuses[0], batch.details[0]

    # -- scoring ------------------------------------------------------------------------
    def score(self, responses: Sequence[str], golds: Sequence[str]) -> RewardBatch:
        """Score ``responses[i]`` against ``golds[i]``; never raises for bad responses.

        Args:
            responses: ``[B]`` model outputs (non-strings score 0.0 as parse failures).
            golds: ``[B]`` reference answers.
        Returns:
            :class:`RewardBatch` with ``[B]`` scores and statuses and the batch metrics.
        """
        if len(responses) != len(golds):
            raise ValueError(
                f"score() got {len(responses)} responses but {len(golds)} golds: pass one gold "
                "per response (repeat a prompt's gold for each of its G samples)"
            )
        if not self._workers:
            raise RuntimeError("RewardPool is closed; create a new one")
        cfg = self.config
        n = len(responses)
        scores = [0.0] * n
        statuses = [st.OK] * n
        details = [""] * n
        latency = [0.0] * n
        truncated = 0
        items: list[tuple[str, str] | None] = []
        for response, gold in zip(responses, golds, strict=True):
            if not isinstance(response, str) or not isinstance(gold, str):
                items.append(None)
                continue
            if len(response) > cfg.max_response_chars:
                response = response[-cfg.max_response_chars :]
                truncated += 1
            if len(gold) > cfg.max_gold_chars:
                log.warning("gold answer of %d chars cut to %d", len(gold), cfg.max_gold_chars)
                gold = gold[: cfg.max_gold_chars]
            items.append((response, gold))
        pending = deque(i for i, item in enumerate(items) if item is not None)
        for i, item in enumerate(items):
            if item is None:
                statuses[i] = st.PARSE_FAILURE
        restarts_before = self.restarts
        in_flight = 0

        def finish(
            index: int, worker_index: int, score: float, status: str, detail: str = ""
        ) -> None:
            nonlocal in_flight
            worker = self._workers[worker_index]
            if status not in st.FAILURE_KINDS and not abs(score) <= cfg.max_abs_score:
                detail = f"returned {score!r}, beyond reward.max_abs_score={cfg.max_abs_score:g}"
                score, status = 0.0, st.OUT_OF_RANGE
            scores[index], statuses[index], details[index] = score, status, detail
            if status in st.FAILURE_KINDS and not self._checking:
                self._warn_once(status, items[index], detail)
            latency[index] = time.monotonic() - worker.item_started
            worker.item = None
            in_flight -= 1

        while pending or in_flight:
            now = time.monotonic()
            for w_index, worker in enumerate(self._workers):
                if worker.ready and worker.item is None and pending:
                    index = pending.popleft()
                    try:
                        worker.conn.send((index, *items[index]))  # type: ignore[misc]
                    except (BrokenPipeError, OSError):
                        pending.appendleft(index)  # never started: retry on a new worker
                        self._replace(w_index)
                        continue
                    worker.item, worker.item_started = index, now
                    in_flight += 1
            busy = [w for w in self._workers if w.item is not None or not w.ready]
            deadlines = [w.item_started + cfg.timeout_s for w in busy if w.item is not None]
            deadlines += [w.started + cfg.start_timeout_s for w in busy if not w.ready]
            timeout = max(0.0, min(deadlines) - time.monotonic()) if deadlines else 0.0
            ready_conns = wait([w.conn for w in busy], timeout=timeout)
            for w_index, worker in enumerate(self._workers):
                if worker in busy and worker.conn in ready_conns:
                    self._handle_event(w_index, finish)
            now = time.monotonic()
            for w_index, worker in enumerate(self._workers):
                if worker.item is not None and now - worker.item_started > cfg.timeout_s:
                    finish(worker.item, w_index, 0.0, st.TIMEOUT, f"over {cfg.timeout_s} s")
                    self._replace(w_index)
                elif not worker.ready and now - worker.started > cfg.start_timeout_s:
                    raise RuntimeError(
                        f"replacement reward worker not ready after {cfg.start_timeout_s} s"
                    )
        return RewardBatch(
            scores,
            statuses,
            self._metrics(scores, statuses, latency, truncated, self.restarts - restarts_before),
            details,
        )

    def _handle_event(self, w_index: int, finish: Any) -> None:
        worker = self._workers[w_index]
        if not worker.ready:
            self._on_ready_message(worker)
            return
        try:
            index, score, status, detail = worker.conn.recv()
        except (EOFError, OSError):
            with contextlib.suppress(subprocess.TimeoutExpired):
                worker.proc.wait(timeout=1)
            item, code = worker.item, worker.proc.returncode
            finish(item, w_index, 0.0, st.CRASH, f"the worker died with exit code {code}")
            self._replace(w_index)
            return
        finish(index, w_index, score, status, detail)
        if status == st.MEMORY:
            self._replace(w_index)

    def _warn_once(self, status: str, item: tuple[str, str] | None, detail: str) -> None:
        """Log the first failure of each kind with its example; later ones are only counted."""
        if status in self._warned:
            return
        self._warned.add(status)
        response, gold = item if item is not None else ("", "")
        log.warning(
            "reward %r failed (%s) on response %r (gold %r): %s; the item scores 0.0 and "
            "every such failure is counted in reward_fail_%s (logged once per kind)",
            self.config.reward,
            st.FAILURE_KINDS[status],
            response[-120:],
            gold[:60],
            detail or status,
            st.FAILURE_KINDS[status],
        )

    @staticmethod
    def _metrics(
        scores: list[float],
        statuses: list[str],
        latency: list[float],
        truncated: int,
        restarts: int,
    ) -> dict[str, float]:
        counts = Counter(statuses)
        n = max(len(scores), 1)
        metrics = {
            "reward/score/mean": sum(scores) / n,
            "reward/items/sum": float(len(scores)),
            "reward/truncated/sum": float(truncated),
            "reward/latency_s/max": max(latency, default=0.0),
            "reward/worker_restarts/sum": float(restarts),
        }
        names = {st.PARSE_FAILURE: "parse_failures", st.TIMEOUT: "timeouts", st.CRASH: "crashes"}
        names |= {st.MEMORY: "memory_errors", st.ERROR: "errors", st.INVALID: "invalid"}
        names |= {st.NO_ANSWER: "no_answer", st.NAN: "nan_scores", st.NONE: "none_scores"}
        names |= {st.GRADER_TIMEOUT: "grader_timeouts", st.OUT_OF_RANGE: "out_of_range"}
        for status, name in names.items():
            metrics[f"reward/{name}/sum"] = float(counts.get(status, 0))
        return metrics

    # -- shutdown -----------------------------------------------------------------------
    def close(self) -> None:
        """Stop every worker and every process its reward started (politely, then by the
        keeper after 2 s: ``containment``). Idempotent."""
        for worker in self._workers:
            with contextlib.suppress(BrokenPipeError, OSError):
                worker.conn.send(None)
        for worker in self._workers:
            with contextlib.suppress(subprocess.TimeoutExpired):
                worker.proc.wait(timeout=2)
            self._kill(worker)
        self._workers = []

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_workers", None):
            self.close()
