"""The first rank's book of worker requests (:class:`GroupDispatcher`), against a scripted
pool: lost workers (before and while their step is collected), stale results, and faults
that must raise instead of waiting."""

from __future__ import annotations

from collections import deque
from typing import Any

import pytest

from reco_megatron.rollout.requests import SamplingParams
from reco_megatron.trainer.orchestration import StepPrompts, WorkerLost, prompt_seed
from reco_megatron.trainer.orchestration.dispatch import GroupDispatcher


class ScriptedPool:
    """Workers that answer each request at once, with the weights they hold or the version
    the request asks for if newer (a worker loads the newest push before it generates), except
    frozen ones, which answer nothing and are reported silent once nothing else is left."""

    def __init__(self, n: int) -> None:
        self.live = set(range(n))
        self.frozen: set[int] = set()
        self.version = {w: 0 for w in range(n)}
        self.events: deque[tuple[int, dict[str, Any]]] = deque()
        self.sent: list[tuple[int, dict[str, Any]]] = []

    @property
    def alive(self) -> list[int]:
        return sorted(self.live)

    def send(self, wid: int, msg: dict[str, Any]) -> None:
        if wid not in self.live:
            raise WorkerLost(wid, "is gone")
        self.sent.append((wid, msg))
        if wid in self.frozen:
            return
        pairs = zip(msg["prompts"], msg["sampling"], strict=True)
        completions = [[f"p{p[0]}-seed{s.seed}"] for p, s in pairs]
        self.version[wid] = max(self.version[wid], msg["min_version"])
        result = {"kind": "result", "request": msg["id"], "version": self.version[wid]}
        result.update(completions=completions, idle_s=0.5, generate_s=1.0, episodes=None)
        self.events.append((wid, result))

    def next_event(self, waiting_for: str) -> tuple[int, dict[str, Any]]:
        while self.events:
            wid, msg = self.events.popleft()
            if wid in self.live:
                return wid, msg
        silent = sorted(self.frozen & self.live)
        if not silent:
            raise AssertionError(f"the book waits for {waiting_for} with nothing in flight")
        self.mark_dead(silent[0])
        raise WorkerLost(silent[0], f"has been silent for 8 s while waiting for {waiting_for}")

    def mark_dead(self, wid: int) -> None:
        self.live.discard(wid)


def _book(pool: ScriptedPool, k: int = 1, stop: bool = False) -> GroupDispatcher:
    def encode(indices: list[int], groups: list[int]) -> tuple[list[list[int]], list[str]]:
        return [[indices[g]] for g in groups], [str(indices[g]) for g in groups]

    sampling = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=4, seed=0)
    return GroupDispatcher(
        pool, encode, sampling, seed=7, group_size=2, max_staleness=k, stop_on_failure=stop
    )


def _drawn(step: int) -> StepPrompts:
    return StepPrompts([100 * step + g for g in range(4)], {"at": step})


def _want(step: int) -> list[list[str]]:
    return [[f"p{100 * step + g}-seed{prompt_seed(7, step - 1, g)}"] for g in range(4)]


def test_groups_come_back_in_the_samplers_order_with_their_seeds() -> None:
    pool = ScriptedPool(2)
    book = _book(pool)
    book.send_step(1, _drawn(1))
    assert [len(m["prompts"]) for _, m in pool.sent] == [2, 2]
    groups, _, metrics = book.collect(1)
    assert groups == _want(1)
    assert metrics["staleness_max"] == 0.0 and metrics["groups_dropped_stale"] == 0
    assert metrics["rollout_workers_alive"] == 2 and metrics["worker_idle_s"] == 1.0
    assert not book.steps and not book.chunks and not book.results and not book.requests


def test_a_worker_lost_while_its_step_is_collected_hands_that_step_on() -> None:
    """The worker falls silent after step 3 was sent to it: the chunks of the step being
    collected (and of the next, already sent) go to the live worker."""
    pool = ScriptedPool(2)
    book = _book(pool)
    pool.frozen.add(0)
    book.version = 1
    book.send_step(3, _drawn(3))
    book.version = 2  # step 2's weights pushed; the requests of step 4 and the replacements
    book.send_step(4, _drawn(4))
    groups, _, metrics = book.collect(3)
    assert groups == _want(3)
    assert metrics["rollout_workers_alive"] == 1
    assert book.collect(4)[0] == _want(4)
    again = [m for w, m in pool.sent if w == 1 and m["min_version"] == 2]
    assert len(again) == 3, "step 4's request to worker 1, one replacement per lost chunk"
    assert not book.requests, "the lost worker's requests are forgotten"


@pytest.mark.parametrize(
    ("workers", "stop"),
    [(2, True), (1, False)],  # worker_failure=stop; continue, with no worker left
)
def test_a_lost_worker_stops_the_run(workers: int, stop: bool) -> None:
    pool = ScriptedPool(workers)
    book = _book(pool, stop=stop)
    pool.frozen.add(workers - 1)
    book.send_step(1, _drawn(1))
    with pytest.raises(WorkerLost, match=f"rollout worker {workers - 1} has been silent"):
        book.collect(1)


def test_stale_results_are_dropped_counted_and_asked_again() -> None:
    """K = 0: step 3 needs version 2. Sent while version 1 was the newest, worker 0 answers
    with it; the chunk is dropped, asked again of it with version 2, and that answer kept."""
    pool = ScriptedPool(2)
    book = _book(pool, k=0)
    pool.version = {0: 1, 1: 2}
    book.version = 1
    book.send_step(3, _drawn(3))
    book.version = 2
    sent = len(pool.sent)
    groups, _, metrics = book.collect(3)
    assert groups == _want(3)
    assert metrics["groups_dropped_stale"] == 2.0 and metrics["staleness_max"] == 0.0
    assert [(w, m["min_version"]) for w, m in pool.sent[sent:]] == [(0, 2)]


def test_an_answer_below_the_asked_version_raises_instead_of_looping() -> None:
    pool = ScriptedPool(1)
    book = _book(pool, k=0)
    book.version = 2
    book.send_step(3, _drawn(3))
    wid, result = pool.events.pop()
    pool.events.append((wid, {**result, "version": 1}))  # a worker that ignored min_version
    with pytest.raises(RuntimeError, match="with weights version 1, below the version 2"):
        book.collect(3)


def test_a_chunk_no_live_worker_holds_raises_instead_of_waiting() -> None:
    pool = ScriptedPool(2)
    book = _book(pool)
    pool.frozen.add(0)
    book.send_step(1, _drawn(1))
    pool.mark_dead(0)  # gone without the book being told: a bookkeeping fault
    with pytest.raises(RuntimeError, match="rollout worker 0, which is gone"):
        book.collect(1)


def test_a_step_never_sent_is_an_error() -> None:
    with pytest.raises(RuntimeError, match="step 5 was never sent"):
        _book(ScriptedPool(1)).collect(5)
