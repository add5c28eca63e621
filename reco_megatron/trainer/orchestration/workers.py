"""The trainer's first rank's side of separate placement: the workers' processes and links.

:class:`WorkerPool` publishes the run's address (``<output_dir>/rollout/address.json``), starts
the workers (``rollout.worker_launch=spawn``: ``python -m reco_megatron.rollout_worker`` with
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
import ipaddress
import os
import queue
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from reco_megatron.rollout.address import ADDRESS_FILE, private_dir
from reco_megatron.rollout.hub import Hub, HubLink, PeerGone
from reco_megatron.rollout.worker_link import WORKER_MODULE
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
    link: HubLink
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
        self.dir = private_dir(run_dir / "rollout")
        self.events: queue.Queue[dict[str, Any]] = queue.Queue()
        self.workers: dict[int, WorkerHandle] = {}
        self._closing = False
        self.plan_digest = ""
        """The push plan's digest every worker must echo (set by :meth:`wait_ready`)."""
        bind, advertise = bind_address(cfg)
        if bind in ("0.0.0.0", "::"):
            logger.warning(
                "rollout.bind_address=%s: the control port listens on every interface (only "
                "this run's key gets in, but any host can reach it); name an interface instead",
                bind,
            )
        self.hub = Hub(
            bind, advertise, run_id, set(range(cfg.num_workers)), self.events, self._record_beat
        )
        self.address = self.hub.address
        self.address.write(self.dir / ADDRESS_FILE)
        logger.info("rollout: control channel on %s (CURVE, this run's keys)", self.hub.endpoint)
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
        if not gpus:
            # a CPU worker shares the cores with the trainer: OpenMP threads that spin while
            # waiting (the default) take them from it (measured: episodes 4x slower on 2 cores)
            env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
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

    def _collect_hellos(self) -> None:
        deadline = time.monotonic() + self.timeout
        want = set(range(self.cfg.num_workers))
        while want - set(self.workers):
            self._check_spawned_alive(starting=True)
            try:
                link, hello = self.hub.hellos.get(timeout=min(1.0, deadline - time.monotonic()))
            except (queue.Empty, ValueError):
                if time.monotonic() >= deadline:
                    missing = sorted(want - set(self.workers))
                    raise WorkerLost(
                        missing[0],
                        f"did not connect within rollout.worker_timeout_s={self.timeout:.0f} s "
                        f"(missing workers {missing}; {self._where_to_look()})",
                    ) from None
                continue
            wid = link.tag  # the hub admits each expected id once
            self.workers[wid] = WorkerHandle(
                wid,
                link,
                hello["pid"],
                hello["cuda"],
                self._processes.get(wid),
                self.dir / f"worker-{wid}.log" if wid in self._processes else None,
            )
        self.hub.close_admission()
        logger.info("rollout: %d worker(s) connected", len(self.workers))

    def _record_beat(self, wid: int, msg: dict[str, Any]) -> None:
        handle = self.workers.get(wid)
        if handle is not None and msg.get("version") is not None:
            handle.version = msg["version"]

    def setup(self, messages: dict[int, dict[str, Any]]) -> None:
        for wid, msg in messages.items():
            self.send(wid, {"kind": "setup", **msg})

    def wait_ready(self, plan_digest: str) -> None:
        """Wait for every worker's ``ready`` (its engine is built, its weight group checked)
        and check it holds the push plan ``plan_digest`` names."""
        self.plan_digest = plan_digest
        pending = {w for w, h in self.workers.items() if h.alive}
        while pending:
            wid, msg = self.next_event("the workers to build their engines")
            if msg["kind"] == "ready":
                if msg["plan_digest"] != plan_digest:
                    self.mark_dead(wid)
                    raise WorkerLost(wid, _plan_mismatch(msg["plan_digest"], plan_digest))
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
                if msg["plan_digest"] != self.plan_digest:
                    self.mark_dead(wid)
                    raise WorkerLost(wid, _plan_mismatch(msg["plan_digest"], self.plan_digest))
                self.workers[wid].received[msg["version"]] = msg["s"]
                self.workers[wid].version = msg["version"]
            return wid, msg

    def last_word(self, wid: int, within: float = 2.0) -> str | None:
        """The error worker ``wid`` sent as it left, when it comes within ``within`` s (a
        worker that refuses a push says why just after the push failed); other events keep
        their order."""
        deadline = time.monotonic() + within
        kept: list[dict[str, Any]] = []
        found = None
        while found is None and time.monotonic() < deadline:
            try:
                msg = self.events.get(timeout=0.1)
            except queue.Empty:
                continue
            if msg.get("_from") == wid and msg["kind"] in ("error", "hung"):
                found = msg.get("message") or msg.get("why")
            else:
                kept.append(msg)
        with self.events.mutex:
            self.events.queue.extendleft(reversed(kept))
        return found

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
        self.hub.close()
        with contextlib.suppress(FileNotFoundError):
            (self.dir / ADDRESS_FILE).unlink()


def _plan_mismatch(got: str, want: str) -> str:
    return (
        f"holds push plan {got[:12]}, the trainer's is {want[:12]} (tensor names, shapes, dtypes "
        "or bucket sizes differ): no weights were loaded"
    )


def bind_address(cfg: RolloutConfig) -> tuple[str, str]:
    """``(bind, advertise)``: where the control socket listens and the host the address file
    names. ``rollout.bind_address=auto``: loopback when the trainer spawns every worker on
    this node, else this node's address (its hostname's); never every interface."""
    if cfg.bind_address != "auto":
        bind = cfg.bind_address
        wildcard = ipaddress.ip_address(bind).is_unspecified
        return bind, this_host() if wildcard else bind
    if cfg.worker_launch == "spawn":
        return "127.0.0.1", "127.0.0.1"
    host = this_host()
    return host, host


def this_host() -> str:
    """An address of this node that the job's other nodes can reach (its hostname's
    address; 127.0.0.1 when the name does not resolve)."""
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"
