"""The control channel between the trainer and a rollout worker.

One authenticated TCP connection per worker (:mod:`multiprocessing.connection`, HMAC
challenge with a key only the run's processes know) carries small pickled dicts, each with
a ``kind``: the worker's ``hello``, ``ready``, ``heartbeat``, ``result``, ``error`` and
``hung`` (its generation overran ``rollout.generate_timeout_s``; it exits next); the
trainer's ``setup``, ``generate``, ``weights`` (a push follows on the weight group), ``ping``
and ``stop``. Tensors never travel here (the weights go over the weight group,
:mod:`.weight_transport`). Each side reads in a thread of its own, so a side busy computing
still answers and notices a peer that is gone: a closed connection at once, a silent one
after the timeout.

The trainer publishes where to connect in ``<output_dir>/rollout/address.json`` (mode 0600:
it holds the key), which is how workers on other nodes of a job find it.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import secrets
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Connection
from pathlib import Path
from typing import Any

ADDRESS_FILE = "address.json"
WORKER_MODULE = "reco_megatron.rollout.worker"


@dataclass(frozen=True)
class Address:
    """Where a worker finds the trainer."""

    host: str
    port: int
    authkey: str
    """Hex key of the HMAC challenge."""
    run_id: str

    def write(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(self.__dict__, f)
        tmp.replace(path)

    @classmethod
    def read(cls, path: Path) -> Address:
        data = json.loads(path.read_text())
        if not isinstance(data, dict) or set(data) != {"host", "port", "authkey", "run_id"}:
            raise ValueError(f"{path}: not a rollout address file (keys {sorted(data)!r})")
        return cls(str(data["host"]), int(data["port"]), str(data["authkey"]), str(data["run_id"]))


def new_authkey() -> str:
    return secrets.token_hex(32)


def this_host() -> str:
    """An address of this node that the job's other nodes can reach (its hostname's
    address; 127.0.0.1 when the name does not resolve)."""
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


class PeerGone(ConnectionError):
    """The other side closed the connection or stayed silent past the timeout."""


class Link:
    """One end of a control connection: thread-safe ``send``, messages read by a background
    thread into a queue (``receive`` with a timeout), and the time the peer was last heard."""

    def __init__(
        self,
        conn: Connection,
        name: str,
        inbox: queue.Queue[dict[str, Any]] | None = None,
        tag: int | None = None,
        on_beat: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        """``inbox``: a queue shared with other links (messages then carry ``"_from": tag``);
        None: a queue of its own. ``on_beat`` is called from the reader thread with each
        ping / heartbeat (they are not queued)."""
        self.conn = conn
        self.name = name
        self.tag = tag
        self.on_beat = on_beat or (lambda msg: None)
        self.inbox: queue.Queue[dict[str, Any]] = inbox if inbox is not None else queue.Queue()
        self.last_heard = time.monotonic()
        self.closed: str | None = None  # why the peer is gone, once it is
        self._send_lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, name=f"link-{name}", daemon=True)

    def start(self) -> Link:
        self._reader.start()
        return self

    def _read(self) -> None:
        while True:
            try:
                msg = self.conn.recv()
            except (EOFError, OSError) as exc:
                self.closed = f"connection closed ({type(exc).__name__})"
                self.inbox.put({"kind": "gone", "why": self.closed, "_from": self.tag})
                return
            self.last_heard = time.monotonic()
            if not isinstance(msg, dict):
                continue  # only the run's processes hold the key; ignore what is not ours
            if msg.get("kind") in ("ping", "heartbeat"):
                self.on_beat(msg)
                continue
            msg["_from"] = self.tag
            self.inbox.put(msg)

    def send(self, msg: dict[str, Any]) -> None:
        if self.closed:
            raise PeerGone(f"{self.name}: {self.closed}")
        try:
            with self._send_lock:
                self.conn.send(msg)
        except (OSError, ValueError) as exc:
            self.closed = f"send failed ({type(exc).__name__}: {exc})"
            raise PeerGone(f"{self.name}: {self.closed}") from exc

    def receive(self, timeout: float, waiting_for: str) -> dict[str, Any]:
        """The next message, or :class:`PeerGone` naming ``waiting_for`` after ``timeout`` s
        of silence (heartbeats count as life but are not returned)."""
        deadline = time.monotonic() + timeout
        while True:
            left = min(deadline, self.last_heard + timeout) - time.monotonic()
            if left <= 0:
                raise PeerGone(
                    f"{self.name}: nothing heard for {timeout:.0f} s while waiting for "
                    f"{waiting_for}"
                )
            try:
                msg = self.inbox.get(timeout=min(left, 1.0))
            except queue.Empty:
                continue
            if msg.get("kind") == "gone":
                self.inbox.put(msg)  # every later receive sees it too
                raise PeerGone(f"{self.name}: {msg['why']} while waiting for {waiting_for}")
            return msg

    def close(self) -> None:
        self.closed = self.closed or "closed here"
        with contextlib.suppress(OSError):
            self.conn.close()


def connect(address_file: Path, timeout: float) -> tuple[Address, Connection]:
    """Connect to the trainer named in ``address_file``, retrying (the file may not exist
    yet, or still be a previous run's) until ``timeout`` s have passed."""
    deadline = time.monotonic() + timeout
    last = "the address file does not exist yet"
    while time.monotonic() < deadline:
        try:
            address = Address.read(address_file)
            conn = Client((address.host, address.port), authkey=bytes.fromhex(address.authkey))
            return address, conn
        except FileNotFoundError:
            last = f"{address_file} does not exist yet"
        except (OSError, ValueError, EOFError, AuthenticationError) as exc:  # refused, old key
            last = f"{type(exc).__name__}: {exc}"
        time.sleep(0.5)
    raise PeerGone(
        f"no trainer to connect to within {timeout:.0f} s through {address_file}: {last}"
    )
