"""The trainer's end of the control channel: one CURVE ROUTER socket for every worker.

:class:`Hub` makes the run's keys (a server key pair and the workers' key pair, fresh for each
run), binds a ROUTER socket to ``rollout.bind_address`` (never all interfaces unless asked)
and publishes both keys and the port in the address file (:mod:`.address`). libzmq checks every
connection's CURVE handshake within :data:`~.channel.HANDSHAKE_S` and asks the ZAP handler
here whether the client proves the workers' key; a connection without it never delivers a
frame (it is logged in one rate-limited line), and every frame after the handshake is
authenticated and encrypted. Frames over :data:`~.wire.MAX_FRAME_BYTES` are dropped by
libzmq before allocation; frames that fail the schema (:mod:`.wire`) are logged and dropped.
Nothing a peer sends stops the I/O thread. A worker whose connection closes is reported
``gone`` at once (the monitor's disconnect event names the connection's descriptor).

Admission: an authenticated peer's first frame must be a ``hello`` of this run with a worker
id the run expects that no other connection holds, while the hub still admits; anything else
is answered with ``refused`` and the reason (a duplicate id, a late worker, another run's)
and logged in one line. An admitted worker is a :class:`HubLink`; its messages go to the
pool's event queue with ``"_from": worker id``.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq
from zmq.auth.thread import ThreadAuthenticator

from reco_megatron.rollout.address import Address
from reco_megatron.rollout.channel import Pump, RateLimitedLog, secure
from reco_megatron.rollout.wire import MAX_FRAME_BYTES, WireError, decode, encode
from reco_megatron.utils.logging import get_logger

logger = get_logger(__name__)
_EVENTS = (
    zmq.EVENT_DISCONNECTED
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)


class PeerGone(ConnectionError):
    """The other side is gone, stayed silent past the timeout, or cannot be sent to."""


class HubLink:
    """An admitted worker as the trainer's side sees it."""

    def __init__(self, hub: Hub, ident: bytes, wid: int, on_beat: Callable[[dict], None]):
        self.hub = hub
        self.ident = ident
        self.tag = wid
        self.name = f"rollout worker {wid}"
        self.on_beat = on_beat
        self.last_heard = time.monotonic()
        self.closed: str | None = None

    def send(self, msg: dict[str, Any]) -> None:
        if self.closed:
            raise PeerGone(f"{self.name}: {self.closed}")
        self.hub.pump.send([self.ident, encode(msg)])

    def close(self) -> None:
        self.closed = self.closed or "closed here"


class _Keys:
    """The ZAP handler's answer: only the run's worker key passes."""

    def __init__(self, allowed: bytes) -> None:
        self.allowed = allowed

    def callback(self, domain: str, key: bytes) -> bool:
        return key == self.allowed


class Hub:
    """The run's control socket (the trainer's first rank)."""

    def __init__(
        self,
        bind_host: str,
        advertise_host: str,
        run_id: str,
        expected: set[int],
        events: queue.Queue[dict[str, Any]],
        on_beat: Callable[[int, dict[str, Any]], None],
        max_frame: int = MAX_FRAME_BYTES,
    ) -> None:
        self.run_id = run_id
        self.expected = set(expected)
        self.events = events
        self.on_beat = on_beat
        self.admitting = True
        self.links: dict[bytes, HubLink] = {}
        self._by_fd: dict[int, HubLink] = {}  # the admitted workers' connections
        self.hellos: queue.Queue[tuple[HubLink, dict[str, Any]]] = queue.Queue()
        self._refusals = RateLimitedLog(logger.warning)
        self._lock = threading.Lock()
        server_public, server_secret = zmq.curve_keypair()
        client_public, client_secret = zmq.curve_keypair()
        self.ctx = zmq.Context()
        self.auth = ThreadAuthenticator(self.ctx)
        self.auth.start()
        self.auth.configure_curve_callback("*", _Keys(client_public))
        sock = secure(self.ctx.socket(zmq.ROUTER), max_frame)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.curve_server = True
        sock.curve_publickey = server_public
        sock.curve_secretkey = server_secret
        if ":" in bind_host:
            sock.setsockopt(zmq.IPV6, 1)
        host = f"[{bind_host}]" if ":" in bind_host else bind_host
        sock.bind(f"tcp://{host}:0")
        self.endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        port = int(self.endpoint.rsplit(":", 1)[1])
        monitor = sock.get_monitor_socket(_EVENTS)
        self.address = Address(
            advertise_host,
            port,
            run_id,
            server_public.decode(),
            client_public.decode(),
            client_secret.decode(),
        )
        self.pump = Pump(
            self.ctx, sock, "hub", self._on_frames, self._on_send_error, monitor, self._on_event
        )

    # ------------------------------------------------------------ the I/O thread
    def _on_frames(self, frames: list[bytes]) -> None:
        if len(frames) != 2:
            self._refusals(f"rollout: dropped a message of {len(frames) - 1} parts (one expected)")
            return
        ident, frame = frames
        link = self.links.get(ident)
        try:
            msg = decode(frame)
        except WireError as exc:
            who = link.name if link is not None else "an unadmitted peer"
            self._refusals(f"rollout: dropped a malformed frame from {who}: {exc}")
            if link is None:
                self._refuse(ident, f"malformed hello: {exc}", log=False)
            return
        if link is not None:
            link.last_heard = time.monotonic()
            if msg["kind"] in ("heartbeat",):
                link.on_beat(msg)
            elif not link.closed:
                msg["_from"] = link.tag
                self.events.put(msg)
            return
        self._admit(ident, msg)

    def _admit(self, ident: bytes, msg: dict[str, Any]) -> None:
        if msg["kind"] != "hello":
            self._refuse(ident, f"the first message must be a hello, got {msg['kind']!r}")
            return
        wid = msg["worker"]
        held = {link.tag for link in self.links.values()}  # once admitted, never again
        if msg["run_id"] != self.run_id:
            why = f"it belongs to run {msg['run_id']!r}, this trainer runs {self.run_id!r}"
        elif wid in held:
            why = f"duplicate worker id {wid}: a worker {wid} was admitted already"
        elif not self.admitting:
            why = f"late worker id {wid}: the run admitted its workers and started without it"
        elif wid not in self.expected:
            why = f"worker id {wid} is not one of this run's {sorted(self.expected)}"
        else:
            link = HubLink(self, ident, wid, lambda m, w=wid: self.on_beat(w, m))
            self.links[ident] = link
            self._by_fd[self.pump.last_fd] = link
            self.pump.send([ident, encode({"kind": "welcome"})])
            self.hellos.put((link, msg))
            return
        self._refuse(ident, why)

    def _refuse(self, ident: bytes, why: str, log: bool = True) -> None:
        if log:
            self._refusals(f"rollout: refused a worker ({why})")
        with contextlib.suppress(WireError):
            self.pump.send([ident, encode({"kind": "refused", "why": why})])

    def _on_send_error(self, frames: list[bytes], exc: Exception) -> None:
        link = self.links.get(frames[0])
        if link is not None and not link.closed:
            link.closed = f"cannot be sent to ({exc})"
            self.events.put({"kind": "gone", "why": link.closed, "_from": link.tag})

    def _on_event(self, event: dict) -> None:
        if event.get("event") == zmq.EVENT_DISCONNECTED:  # "value" is the connection's fd
            link = self._by_fd.pop(int(event.get("value", -1)), None)
            if link is not None and not link.closed:
                link.closed = "its connection closed"
                self.events.put({"kind": "gone", "why": link.closed, "_from": link.tag})
            return
        what = {
            zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "no CURVE handshake",
            zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "not a CURVE peer",
            zmq.EVENT_HANDSHAKE_FAILED_AUTH: "without this run's key",
        }.get(event.get("event"), str(event.get("event")))
        self._refusals(f"rollout: refused a connection to {self.endpoint} ({what})")

    # ------------------------------------------------------------ the pool's side
    def close_admission(self) -> None:
        """From now on every hello is late (refused with the reason)."""
        self.admitting = False

    def close(self) -> None:
        self.pump.close()
        with contextlib.suppress(Exception):
            self.auth.stop()
        self.ctx.destroy(linger=0)
