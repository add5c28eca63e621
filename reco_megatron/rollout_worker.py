"""A rollout worker: one engine in its own process, generating groups for the trainer.

Started by the trainer (``rollout.worker_launch=spawn``) or by the job script
(``external``, the rollout nodes of ``slurm/reco.sbatch``)::

    python -m reco_megatron.rollout_worker --address RUN_DIR/rollout/address.json --worker-id 0

It connects to the trainer (:mod:`reco_megatron.rollout.worker_link`), receives the
engine's settings and the push plan, joins its weight group
(:mod:`reco_megatron.rollout.weight_transport`), builds the engine and then serves:

- ``weights`` messages: the control thread receives the version's buckets at once (the
  trainer never waits for a generation to finish) and stages them;
- ``generate`` requests, one at a time in the order they came: before each, the newest staged
  version is loaded into the engine (weights change only between generation calls), and the
  result carries the version that generated it. With ``rollout.env`` (the setup's ``env``)
  the worker starts the run's environment workers and a request that carries its prompts'
  records is answered with whole episodes (:class:`reco_megatron.envs.EpisodeService`, the
  code the colocated trainer runs them with).

It exits on ``stop`` (closing its environment workers, which also die with it however it
ends: :mod:`reco_megatron.rewards.containment`), and within seconds of the trainer's death
(the connection closes) or silence (no ping for ``timeout`` s). A generation call that runs
longer than ``rollout.generate_timeout_s`` is reported as hung and the worker exits (its engine
may hold a GPU; the trainer treats it as lost). A generation error is reported to the
trainer, which stops the run with it; it is never swallowed.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import queue
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

from reco_megatron.envs import EnvSettings, EpisodeService, group_records
from reco_megatron.rollout.address import AddressError
from reco_megatron.rollout.weight_transport import (
    PushPlan,
    check_members,
    receive_push,
    weight_group,
)
from reco_megatron.rollout.worker_link import Link, PeerGone, Refused, connect
from reco_megatron.utils.logging import get_logger

logger = get_logger(__name__)

EXIT_TRAINER_GONE = 3
EXIT_GENERATION_HUNG = 4


class GenerationWatch:
    """How long the current generation call has run: the main thread marks its start and end,
    the heartbeat thread asks whether it overran ``limit_s`` (a stuck engine keeps the
    heartbeats coming, so silence alone would never show it)."""

    def __init__(self, limit_s: float) -> None:
        self.limit_s = limit_s
        self._busy: tuple[int, float] | None = None  # (request id, start), one tuple: atomic

    def begin(self, request: int) -> None:
        self._busy = (request, time.monotonic())

    def end(self) -> None:
        self._busy = None

    def overdue(self, now: float | None = None) -> str | None:
        """Why the current call counts as hung, or None."""
        busy = self._busy
        if busy is None:
            return None
        request, start = busy
        took = (time.monotonic() if now is None else now) - start
        if took <= self.limit_s:
            return None
        return (
            f"has been generating request {request} for {took:.0f} s, over "
            f"rollout.generate_timeout_s={self.limit_s:g} (a stuck engine, or raise the bound "
            "for generations this long)"
        )


class _Staged:
    """The newest pushed version not yet loaded (written by the control thread)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.version: int | None = None
        self.tensors: list[tuple[str, torch.Tensor]] = []
        self.received = threading.Condition(self.lock)

    def put(self, version: int, tensors: list[tuple[str, torch.Tensor]]) -> None:
        with self.lock:
            self.version, self.tensors = version, tensors  # an unloaded older one is dropped
            self.received.notify_all()

    def take(self) -> tuple[int | None, list[tuple[str, torch.Tensor]]]:
        with self.lock:
            version, tensors = self.version, self.tensors
            self.version, self.tensors = None, []
            return version, tensors


class Worker:
    """The worker's state: its link, engine, weight group and the version it generates with."""

    def __init__(self, worker_id: int, link: Link, setup: dict[str, Any]) -> None:
        from reco_megatron.rollout.engines import build_engine

        self.id = worker_id
        self.link = link
        self.timeout = float(setup["timeout_s"])
        self.plan = PushPlan.from_json(setup["plan"])
        self.digest = setup["plan_digest"]
        if self.plan.digest() != self.digest:
            raise ValueError("the setup's push plan does not match its digest")
        self.expected = {k: tuple(v) for k, v in setup["expected"].items()}
        self.device = torch.device(setup["transport_device"])
        self.requests: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self.staged = _Staged()
        self.version: int | None = None  # loaded into the engine
        self.idle_since = time.monotonic()
        self.fatal: str | None = None
        self.watch = GenerationWatch(float(setup["generate_timeout_s"]))
        # the run's private directory (mode 0700): no one else can reach this rendezvous
        store = torch.distributed.FileStore(setup["store_path"], -1)
        self.group = weight_group(
            store,
            setup["group_prefix"],
            self.plan.senders,
            self.plan.senders + 1,
            backend=setup["backend"],
            timeout_s=float(setup["receive_timeout_s"]),
            device=self.device if self.device.type == "cuda" else None,
        )
        check_members(
            self.group, self.plan.senders, range(self.plan.senders), setup["worker_token"],
            setup["trainer_token"], self.device, receive_first=False,
        )  # fmt: skip
        spec = dict(setup["engine"])
        if spec.get("device") == "auto":
            spec["device"] = "cuda" if torch.cuda.is_available() else "cpu"
        if spec["kind"] == "vllm":
            _own_world()
        self.engine = build_engine(**spec)
        env = setup["env"]  # multi-turn: the run's environments, for the whole run
        self.episodes = EpisodeService(EnvSettings.from_wire(env)) if env is not None else None

    def close(self) -> None:
        if self.episodes is not None:
            self.episodes.close()
        self.engine.close()

    def generate(self, request: dict[str, Any]) -> tuple[list[Any], list[Any] | None]:
        """The request's groups, and their episodes' records when it asks for episodes."""
        n, sampling = int(request["n"]), request["sampling"]
        if request["rows"] is None:
            return self.engine.generate(request["prompts"], n, sampling), None
        if self.episodes is None:
            raise RuntimeError("asked for episodes, but the setup named no environment")
        got = self.episodes.run(self.engine.generate, request["rows"], n, sampling)
        return got.completions, group_records(got)

    # ------------------------------------------------------------ control thread
    def serve_control(self) -> None:
        """Read the trainer's messages until ``stop`` (runs in its own thread)."""
        while True:
            msg = self.link.inbox.get()
            kind = msg.get("kind")
            if kind == "gone":
                logger.error("rollout worker %d: the trainer is gone (%s); exiting", self.id, msg)
                os._exit(EXIT_TRAINER_GONE)
            if kind == "generate":
                self.requests.put(msg)
            elif kind == "weights":
                if msg["plan_digest"] != self.digest:
                    self.fatal = (
                        f"weight push of version {msg['version']} announced push plan "
                        f"{msg['plan_digest'][:12]}, this worker holds {self.digest[:12]}: "
                        "nothing was received"
                    )
                    self.requests.put(None)
                    return
                self._receive(msg["version"])
            elif kind == "stop":
                self.requests.put(None)
                return

    def _receive(self, version: int) -> None:
        start = time.perf_counter()
        try:
            tensors = [
                (name, tensor)
                for name, tensor in receive_push(
                    self.group, self.plan, self.plan.senders, version, self.device
                )
            ]
        except Exception as exc:  # a sender died mid-push, or a version mismatch
            self.fatal = f"weight push of version {version} failed: {exc}"
            self.requests.put(None)
            return
        self.staged.put(version, tensors)
        took = time.perf_counter() - start
        msg = {"kind": "received", "version": version, "s": took, "plan_digest": self.digest}
        self.link.send(msg)

    # ------------------------------------------------------------ generation (main thread)
    def serve_requests(self) -> None:
        while True:
            request = self.requests.get()
            if request is None:
                if self.fatal:
                    logger.error("rollout worker %d: %s; exiting", self.id, self.fatal)
                    self.link.send({"kind": "error", "request": None, "message": self.fatal})
                    time.sleep(0.5)  # let the message leave before the process does
                return
            idle = time.monotonic() - self.idle_since
            try:
                self._load_newest(int(request["min_version"]))
                start = time.perf_counter()
                self.watch.begin(int(request["id"]))
                out, episodes = self.generate(request)
                self.watch.end()
            except Exception as exc:
                self.link.send(
                    {
                        "kind": "error",
                        "request": request["id"],
                        "message": f"{type(exc).__name__}: {exc}",
                    }
                )
                return
            self.idle_since = time.monotonic()
            self.link.send(
                {
                    "kind": "result",
                    "request": request["id"],
                    "version": self.version,
                    "completions": out,
                    "episodes": episodes,
                    "generate_s": time.perf_counter() - start,
                    "idle_s": idle,
                }
            )

    def _load_newest(self, min_version: int) -> None:
        """Load the newest staged version; wait for one when the engine's is below
        ``min_version`` (the request was sent after that version's push)."""
        deadline = time.monotonic() + self.timeout
        while True:
            version, tensors = self.staged.take()
            if version is not None:
                self.engine.update_weights(iter(tensors), expected=self.expected)
                self.version = version
                del tensors
            if self.version is not None and self.version >= min_version:
                return
            with self.staged.lock:
                if self.staged.version is None:
                    self.staged.received.wait(timeout=1.0)
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"rollout worker {self.id}: no weights of version >= {min_version} within "
                    f"{self.timeout:.0f} s (the request came before its push)"
                )


def _own_world() -> None:
    """A one-process default group: vLLM's external launcher (how the engine runs vLLM in
    its own process, colocated or not) builds its groups inside an initialised world."""
    import tempfile

    import torch.distributed as dist

    if dist.is_initialized():
        return
    if torch.cuda.is_available():
        torch.cuda.set_device(0)
    store = Path(tempfile.mkdtemp(prefix="reco-world-")) / "store"  # mode 0700: private
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)


def _die_with_parent() -> None:
    """Linux: SIGTERM this process when the process that spawned it dies."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError):  # PR_SET_PDEATHSIG = 1
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)


def _beat(link: Link, worker: list[Worker | None], interval: float, timeout: float) -> None:
    while True:
        time.sleep(interval)
        if time.monotonic() - link.last_heard > timeout:
            logger.error("rollout worker: the trainer has been silent for %.0f s; exiting", timeout)
            os._exit(EXIT_TRAINER_GONE)
        w = worker[0]
        hung = None if w is None else w.watch.overdue()
        if hung is not None:
            logger.error("rollout worker %d %s; exiting", w.id, hung)
            with contextlib.suppress(ConnectionError):
                link.send({"kind": "hung", "why": hung})
            time.sleep(0.5)  # let the message leave before the process does
            os._exit(EXIT_GENERATION_HUNG)
        try:
            link.send({"kind": "heartbeat", "version": None if w is None else w.version})
        except ConnectionError:
            os._exit(EXIT_TRAINER_GONE)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m reco_megatron.rollout_worker", description=__doc__)
    p.add_argument("--address", type=Path, required=True, help="the run's rollout/address.json")
    p.add_argument("--worker-id", type=int, required=True)
    p.add_argument("--connect-timeout", type=float, default=600.0)
    p.add_argument("--spawned", action="store_true", help="die with the parent process")
    p.add_argument(
        "--torch-threads",
        type=int,
        default=0,
        help="torch intra-op threads (the trainer passes its own: CPU results depend on them); "
        "0: torch's default",
    )
    args = p.parse_args(argv)
    if args.torch_threads < 0:
        p.error(f"--torch-threads must be >= 0, got {args.torch_threads}")
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    if args.spawned:
        _die_with_parent()
    signal.signal(signal.SIGTERM, lambda *_: os._exit(128 + signal.SIGTERM))
    hello = {"kind": "hello", "worker": args.worker_id, "pid": os.getpid()}
    try:
        link = connect(
            args.address, args.connect_timeout, {**hello, "cuda": torch.cuda.is_available()}
        )
    except (AddressError, Refused) as exc:  # one line: a file not to trust, or the reason
        logger.error("rollout worker %d: %s", args.worker_id, exc)
        return 2
    except PeerGone as exc:
        logger.error("rollout worker %d: %s", args.worker_id, exc)
        return EXIT_TRAINER_GONE
    setup = link.receive(args.connect_timeout, "the trainer's setup")
    if setup.get("kind") != "setup":
        logger.error("rollout worker %d: expected setup, got %r", args.worker_id, setup["kind"])
        return EXIT_TRAINER_GONE
    holder: list[Worker | None] = [None]
    timeout = setup["timeout_s"]
    beat = threading.Thread(
        target=_beat, args=(link, holder, float(setup["heartbeat_s"]), timeout), daemon=True
    )
    beat.start()
    try:
        worker = Worker(args.worker_id, link, setup)
    except Exception as exc:
        link.send({"kind": "error", "request": None, "message": f"start-up: {exc}"})
        raise
    holder[0] = worker
    link.send({"kind": "ready", "worker": args.worker_id, "plan_digest": worker.digest})
    control = threading.Thread(target=worker.serve_control, name="control", daemon=True)
    control.start()
    try:
        worker.serve_requests()
    finally:
        worker.close()
    link.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
