"""The trainer's first rank's side of separate placement: the workers' processes and links.

:class:`WorkerPool` publishes the run's address (``<output_dir>/rollout/address.json``), starts
the workers (``rollout.worker_launch=spawn``: ``python -m reco_megatron.rollout.worker`` with
one GPU each, or the CPU; their output in ``<output_dir>/rollout/worker-N.log``) or waits for
the job's (``external``), hands each its setup, sends requests, and turns what comes back into
events. A worker is dead when its connection closes, its process exits, nothing came from it
for ``rollout.worker_timeout_s``, or it reports its generation hung
(``rollout.generate_timeout_s``); every wait here gives up after that time, naming what it
waited for. Pings keep the workers alive while the trainer trains; a trainer that dies
closes the connections, and its workers exit within seconds.
"""

from __future__ import annotations

import contextlib
import os
import queue
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection, Listener
from pathlib import Path
from typing import Any

import torch

from reco_megatron.rollout.worker_link import (
    ADDRESS_FILE,
    WORKER_MODULE,
    Address,
    Link,
    PeerGone,
    new_authkey,
    this_host,
)
from reco_megatron.trainer.rollout_config import RolloutConfig
from reco_megatron.utils.logging import get_logger

logger = get_logger(__name__)

# torchrun's variables: a worker is not a trainer rank and must not join the trainer's world
_TRAINER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "ROLE_RANK")  # fmt: skip


class WorkerLost(RuntimeError):
    """A worker died, hung or failed; the message names it and says why."""

    def __init__(self, worker: int, why: str) -> None:
        super().__init__(f"rollout worker {worker} {why}")
        self.worker = worker
        self.why = why


@dataclass
class WorkerHandle:
    """One worker as the trainer sees it."""

    id: int
    link: Link
    pid: int
    cuda: bool
    process: subprocess.Popen[bytes] | None = None
    log: Path | None = None
    alive: bool = True
    version: int | None = None
    """The version its last heartbeat or push acknowledgement reported."""
    received: dict[int, float] = field(default_factory=dict)
    """Push acknowledgements: version -> seconds the worker took to receive it."""


class WorkerPool:
    """The rollout workers of a run (global rank 0 only)."""

    def __init__(self, cfg: RolloutConfig, run_dir: Path, run_id: str) -> None:
        self.cfg = cfg
        self.timeout = float(cfg.worker_timeout_s)
        self.heartbeat_s = max(0.2, min(5.0, self.timeout / 6))
        self.dir = run_dir / "rollout"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.events: queue.Queue[dict[str, Any]] = queue.Queue()
        self.workers: dict[int, WorkerHandle] = {}
        self._closing = False
        authkey = new_authkey()
        self._listener = Listener(("0.0.0.0", 0), authkey=bytes.fromhex(authkey))
        self.address = Address(this_host(), self._listener.address[1], authkey, run_id)
        self._hellos: queue.Queue[tuple[Connection, dict[str, Any]]] = queue.Queue()
        threading.Thread(target=self._accept, name="rollout-accept", daemon=True).start()
        self.address.write(self.dir / ADDRESS_FILE)
        self._processes: dict[int, subprocess.Popen[bytes]] = {}
        if cfg.worker_launch == "spawn":
            for i in range(cfg.num_workers):
                self._processes[i] = self._spawn(i)
        self._collect_hellos()
        threading.Thread(target=self._ping, name="rollout-ping", daemon=True).start()

    # ------------------------------------------------------------------ start-up
    def _spawn(self, i: int) -> subprocess.Popen[bytes]:
        env = {k: v for k, v in os.environ.items() if k not in _TRAINER_ENV}
        gpus = self.cfg.worker_gpus
        env["CUDA_VISIBLE_DEVICES"] = str(gpus[i]) if gpus else ""
        env["RECO_ROLLOUT_WORKER"] = str(i)
        cmd = [sys.executable, "-m", WORKER_MODULE, "--address", str(self.dir / ADDRESS_FILE)]
        cmd += ["--worker-id", str(i), "--spawned", "--connect-timeout", str(self.timeout)]
        # the trainer's intra-op threads: a CPU matmul's summation order depends on them, so
        # with them a K = 0 run samples from the bits a colocated engine would compute
        cmd += ["--torch-threads", str(torch.get_num_threads())]
        log = open(self.dir / f"worker-{i}.log", "ab")  # noqa: SIM115 - the child keeps it
        try:
            return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        finally:
            log.close()

    def _accept(self) -> None:
        while not self._closing:
            try:
                conn = self._listener.accept()
            except AuthenticationError:
                logger.warning("rollout: refused a connection without this run's key")
                continue
            except OSError:
                return  # the listener was closed
            try:
                if conn.poll(self.timeout):
                    hello = conn.recv()
                    if isinstance(hello, dict) and hello.get("kind") == "hello":
                        self._hellos.put((conn, hello))
                        continue
            except (EOFError, OSError):
                pass
            conn.close()

    def _collect_hellos(self) -> None:
        deadline = time.monotonic() + self.timeout
        want = set(range(self.cfg.num_workers))
        while want - set(self.workers):
            self._check_spawned_alive(starting=True)
            try:
                conn, hello = self._hellos.get(timeout=min(1.0, deadline - time.monotonic()))
            except (queue.Empty, ValueError):
                if time.monotonic() >= deadline:
                    missing = sorted(want - set(self.workers))
                    raise WorkerLost(
                        missing[0],
                        f"did not connect within rollout.worker_timeout_s={self.timeout:.0f} s "
                        f"(missing workers {missing}; {self._where_to_look()})",
                    ) from None
                continue
            wid = hello.get("worker")
            if wid not in want or wid in self.workers:
                logger.warning("rollout: refused worker id %r (expected one of %s)", wid, want)
                conn.close()
                continue
            link = Link(conn, f"rollout worker {wid}", self.events, wid, self._beat_recorder(wid))
            self.workers[wid] = WorkerHandle(
                wid,
                link.start(),
                int(hello.get("pid", -1)),
                bool(hello.get("cuda", False)),
                self._processes.get(wid),
                self.dir / f"worker-{wid}.log" if wid in self._processes else None,
            )
        logger.info("rollout: %d worker(s) connected", len(self.workers))

    def _beat_recorder(self, wid: int):
        def record(msg: dict[str, Any]) -> None:
            handle = self.workers.get(wid)
            if handle is not None and msg.get("version") is not None:
                handle.version = int(msg["version"])

        return record

    def setup(self, messages: dict[int, dict[str, Any]]) -> None:
        for wid, msg in messages.items():
            self.send(wid, {"kind": "setup", **msg})

    def wait_ready(self) -> None:
        """Wait for every worker's ``ready`` (its engine is built)."""
        pending = {w for w, h in self.workers.items() if h.alive}
        while pending:
            wid, msg = self.next_event("the workers to build their engines")
            if msg["kind"] == "ready":
                pending.discard(wid)
            elif msg["kind"] == "error":
                raise WorkerLost(wid, f"failed to start: {msg['message']}")

    # ------------------------------------------------------------------ running
    @property
    def alive(self) -> list[int]:
        return sorted(w for w, h in self.workers.items() if h.alive)

    def send(self, wid: int, msg: dict[str, Any]) -> None:
        try:
            self.workers[wid].link.send(msg)
        except PeerGone as exc:
            self.mark_dead(wid)
            raise WorkerLost(wid, f"is gone: {exc}") from None

    def next_event(self, waiting_for: str) -> tuple[int, dict[str, Any]]:
        """The next message from any live worker (``result``, ``error``, ``received``,
        ``ready``); raises :class:`WorkerLost` for a worker that died or went silent."""
        while True:
            self._check_spawned_alive()
            now = time.monotonic()
            for wid in self.alive:
                silent = now - self.workers[wid].link.last_heard
                if silent > self.timeout:
                    self.mark_dead(wid)
                    raise WorkerLost(
                        wid, f"has been silent for {silent:.0f} s while waiting for {waiting_for}"
                    )
            try:
                msg = self.events.get(timeout=1.0)
            except queue.Empty:
                continue
            wid = msg.get("_from")
            if wid not in self.workers or not self.workers[wid].alive:
                continue
            if msg["kind"] == "gone":
                self.mark_dead(wid)
                raise WorkerLost(wid, f"is gone ({msg['why']}) while waiting for {waiting_for}")
            if msg["kind"] == "hung":  # its generation overran; it exits after saying so
                self.mark_dead(wid)
                raise WorkerLost(wid, f"{msg['why']} while waiting for {waiting_for}")
            if msg["kind"] == "received":
                self.workers[wid].received[int(msg["version"])] = float(msg["s"])
                self.workers[wid].version = int(msg["version"])
            return wid, msg

    def _check_spawned_alive(self, starting: bool = False) -> None:
        for wid, proc in self._processes.items():
            code = proc.poll()
            handle = self.workers.get(wid)
            if code is not None and (handle is None or handle.alive):
                if handle is not None:
                    self.mark_dead(wid)
                what = "exited during start-up" if starting or handle is None else "exited"
                raise WorkerLost(wid, f"{what} with status {code} ({self._where_to_look(wid)})")

    def _where_to_look(self, wid: int | None = None) -> str:
        if wid is not None and (self.dir / f"worker-{wid}.log").exists():
            tail = (self.dir / f"worker-{wid}.log").read_text(errors="replace").splitlines()[-3:]
            return f"{self.dir / f'worker-{wid}.log'} ends: {' | '.join(tail)}"
        if self.cfg.worker_launch == "external":
            return f"external workers connect through {self.dir / ADDRESS_FILE}"
        return f"see {self.dir}/worker-N.log"

    def mark_dead(self, wid: int) -> None:
        handle = self.workers[wid]
        handle.alive = False
        handle.link.close()
        if handle.process is not None and handle.process.poll() is None:
            handle.process.kill()

    def _ping(self) -> None:
        while not self._closing:
            time.sleep(self.heartbeat_s)
            for wid in self.alive:
                with contextlib.suppress(PeerGone):  # next_event reports it
                    self.workers[wid].link.send({"kind": "ping"})

    # ------------------------------------------------------------------ shutdown
    def close(self, grace_s: float = 10.0) -> None:
        """Stop every worker: ``stop``, then SIGKILL what is left after ``grace_s``."""
        if self._closing:
            return
        self._closing = True
        for handle in self.workers.values():
            if handle.alive:
                with contextlib.suppress(PeerGone):
                    handle.link.send({"kind": "stop"})
        deadline = time.monotonic() + grace_s
        for proc in self._processes.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for handle in self.workers.values():
            handle.link.close()
        self._listener.close()
        with contextlib.suppress(FileNotFoundError):
            (self.dir / ADDRESS_FILE).unlink()
