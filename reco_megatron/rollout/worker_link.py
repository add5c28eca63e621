"""The worker's end of the control channel to the trainer.

:func:`connect` reads the run's address file (:mod:`.address`: it refuses one that is not the
user's own, is open to others, or is malformed, in one line), opens a CURVE DEALER socket with
the run's keys (the trainer must prove the server key; the worker proves the workers' key),
sends its ``hello`` and waits a bounded time for ``welcome`` or ``refused`` (the reason is
raised as :class:`Refused`). It retries, re-reading the file, while the file does not exist
or names a trainer that does not answer (a previous run's) until its timeout, and then names
what it waited for.

:class:`Link` then carries the frames (:mod:`.wire`: msgpack, schema-checked, bounded): the
worker's ``ready``, ``heartbeat``, ``result``, ``error``, ``hung``, ``received``; the trainer's
``setup``, ``generate``, ``weights`` (a push follows on the weight group), ``ping``, ``stop``.
Tensors never travel here (the weights go over the weight group, :mod:`.weight_transport`).
An I/O thread reads, so a worker busy computing still answers, and notices a trainer that is
gone: a closed connection at once (a monitor event), a silent one after the timeout.
"""

from __future__ import annotations

import contextlib
import queue
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import zmq

from reco_megatron.rollout.address import ADDRESS_FILE, Address, check_private_dir
from reco_megatron.rollout.channel import HANDSHAKE_S, Pump, secure
from reco_megatron.rollout.hub import PeerGone
from reco_megatron.rollout.wire import WireError, decode, encode
from reco_megatron.utils.logging import get_logger

__all__ = ["ADDRESS_FILE", "WORKER_MODULE", "Link", "PeerGone", "Refused", "connect"]

logger = get_logger(__name__)
WORKER_MODULE = "reco_megatron.rollout_worker"
_ANSWER_S = HANDSHAKE_S + 5.0
"""How long one attempt waits for the trainer's answer to its hello."""


class Refused(ConnectionError):
    """The trainer answered the hello with ``refused``; the message is its reason."""


class Link:
    """The worker's connection: thread-safe ``send``, messages into ``inbox`` (``receive``
    with a timeout), and the time the trainer was last heard."""

    def __init__(self, address: Address, on_beat: Callable[[dict[str, Any]], None] | None = None):
        self.name = "trainer"
        self.address = address
        self.on_beat = on_beat or (lambda msg: None)
        self.inbox: queue.Queue[dict[str, Any]] = queue.Queue()
        self.last_heard = time.monotonic()
        self.closed: str | None = None
        self._welcomed = False
        self.ctx = zmq.Context()
        sock = secure(self.ctx.socket(zmq.DEALER))
        sock.curve_serverkey = address.server_key.encode()
        sock.curve_publickey = address.client_public.encode()
        sock.curve_secretkey = address.client_secret.encode()
        sock.setsockopt(zmq.RECONNECT_IVL, 500)
        host = f"[{address.host}]" if ":" in address.host else address.host
        if ":" in address.host:
            sock.setsockopt(zmq.IPV6, 1)
        monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        sock.connect(f"tcp://{host}:{address.port}")
        self.pump = Pump(
            self.ctx, sock, "worker", self._on_frames, self._on_send_error, monitor, self._gone
        )

    def _on_frames(self, frames: list[bytes]) -> None:
        if len(frames) != 1:
            return
        try:
            msg = decode(frames[0])
        except WireError as exc:
            logger.error("rollout worker: dropped a malformed frame from the trainer: %s", exc)
            return
        self.last_heard = time.monotonic()
        if msg["kind"] == "welcome":
            self._welcomed = True
        if msg["kind"] == "ping":
            self.on_beat(msg)
            return
        self.inbox.put(msg)

    def _on_send_error(self, frames: list[bytes], exc: Exception) -> None:
        self._gone({"why": f"send failed ({exc})"})

    def _gone(self, event: dict[str, Any]) -> None:
        if not self._welcomed or self.closed:
            return  # before the welcome, connect() retries
        self.closed = str(event.get("why", "connection closed"))
        self.inbox.put({"kind": "gone", "why": self.closed})

    def send(self, msg: dict[str, Any]) -> None:
        if self.closed:
            raise PeerGone(f"{self.name}: {self.closed}")
        self.pump.send([encode(msg)])

    def receive(self, timeout: float, waiting_for: str) -> dict[str, Any]:
        """The next message, or :class:`PeerGone` naming ``waiting_for`` after ``timeout`` s
        of silence (pings count as life but are not returned)."""
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
        with contextlib.suppress(Exception):
            self.pump.close()
        with contextlib.suppress(Exception):
            self.ctx.destroy(linger=0)


def connect(address_file: Path, timeout: float, hello: dict[str, Any]) -> Link:
    """A link to the trainer named in ``address_file`` that answered ``hello`` with
    ``welcome``, retrying until ``timeout`` s have passed. Raises :class:`AddressError` for a
    file it must not trust, :class:`Refused` when the trainer refused this worker, and
    :class:`PeerGone` naming what it waited for at the timeout."""
    deadline = time.monotonic() + timeout
    last = f"{address_file} does not exist yet"
    while time.monotonic() < deadline:
        try:
            check_private_dir(address_file.parent)
            address = Address.read(address_file)
        except FileNotFoundError:
            last = f"{address_file} does not exist yet"
            time.sleep(0.5)
            continue
        link = Link(address)
        link.send({**hello, "run_id": address.run_id})
        wait = max(0.1, min(_ANSWER_S, deadline - time.monotonic()))
        try:
            answer = link.inbox.get(timeout=wait)
        except queue.Empty:
            answer = None
        if answer is not None and answer["kind"] == "welcome":
            return link
        link.close()
        if answer is not None and answer["kind"] == "refused":
            raise Refused(f"the trainer at {address.host}:{address.port} refused this worker: "
                          f"{answer['why']}")  # fmt: skip
        last = (
            f"the trainer at {address.host}:{address.port} (run {address.run_id}) did not "
            f"answer within {wait:.0f} s (a stale address file, or a port that is not the "
            "trainer's)"
        )
    raise PeerGone(
        f"no trainer to connect to within {timeout:.0f} s through {address_file}: {last}"
    )
