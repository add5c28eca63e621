"""The socket plumbing under the control channel: CURVE sockets and one I/O thread each.

A zmq socket belongs to one thread. :class:`Pump` owns a socket in a thread of its own: what
arrives goes to a callback, and any thread sends through :meth:`Pump.send` (an in-process
queue the I/O thread drains). Both ends use CURVE (every frame encrypted and authenticated
with the run's keys, :mod:`.address`), a bound on the frame size that libzmq enforces before
it allocates (``MAXMSGSIZE``), and a bound on the handshake (``HANDSHAKE_IVL``).
"""

from __future__ import annotations

import contextlib
import secrets
import threading
import time
from collections.abc import Callable

import zmq

from reco_megatron.rollout.wire import MAX_FRAME_BYTES
from reco_megatron.utils.logging import get_logger

logger = get_logger(__name__)

HANDSHAKE_S = 10.0
_POLL_MS = 200
_STOP = b"\x00stop"


def secure(sock: zmq.Socket, max_frame: int = MAX_FRAME_BYTES) -> zmq.Socket:
    """The options both ends set: bounded frames and handshake, no lingering on close."""
    sock.setsockopt(zmq.MAXMSGSIZE, max_frame)
    sock.setsockopt(zmq.HANDSHAKE_IVL, int(HANDSHAKE_S * 1000))
    sock.setsockopt(zmq.LINGER, 0)
    return sock


class RateLimitedLog:
    """At most ``per_window`` lines per ``window_s`` seconds; the rest counted and said once."""

    def __init__(self, log: Callable[[str], None], per_window: int = 5, window_s: float = 10.0):
        self.log = log
        self.per_window = per_window
        self.window_s = window_s
        self._start = time.monotonic()
        self._count = 0
        self._dropped = 0
        self._lock = threading.Lock()

    def __call__(self, line: str) -> None:
        with self._lock:
            now = time.monotonic()
            if now - self._start > self.window_s:
                if self._dropped:
                    self.log(f"(and {self._dropped} more such line(s) in {self.window_s:.0f} s)")
                self._start, self._count, self._dropped = now, 0, 0
            self._count += 1
            if self._count > self.per_window:
                self._dropped += 1
                return
        self.log(line)


class Pump:
    """One socket served by one thread: ``on_frames(frames)`` for each message that arrives,
    ``on_event(event)`` for each monitor event (when ``monitor`` is given), :meth:`send` from
    any thread; ``on_send_error(frames, exc)`` when the socket refuses a message."""

    def __init__(
        self,
        ctx: zmq.Context,
        sock: zmq.Socket,
        name: str,
        on_frames: Callable[[list[bytes]], None],
        on_send_error: Callable[[list[bytes], Exception], None],
        monitor: zmq.Socket | None = None,
        on_event: Callable[[dict], None] | None = None,
    ) -> None:
        self.sock = sock
        self.on_frames = on_frames
        self.on_send_error = on_send_error
        self.monitor = monitor
        self.on_event = on_event or (lambda event: None)
        wake = f"inproc://pump-{name}-{secrets.token_hex(6)}"
        self._pull = ctx.socket(zmq.PULL)
        self._pull.bind(wake)
        self._push = ctx.socket(zmq.PUSH)
        self._push.setsockopt(zmq.LINGER, 0)
        self._push.connect(wake)
        self._lock = threading.Lock()
        self._closed = False
        self.last_fd = -1
        """The file descriptor of the connection the frames being handled came by."""
        self._thread = threading.Thread(target=self._run, name=f"zmq-{name}", daemon=True)
        self._thread.start()

    def send(self, frames: list[bytes]) -> None:
        with self._lock:
            if self._closed:
                return
            self._push.send_multipart(frames)

    def close(self, timeout: float = 5.0) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._push.send_multipart([_STOP])
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self._push.close(0)

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self._pull, zmq.POLLIN)
        if self.monitor is not None:
            poller.register(self.monitor, zmq.POLLIN)
        try:
            while True:
                ready = dict(poller.poll(_POLL_MS))
                if self._pull in ready and self._drain_outbox():
                    return
                if self.sock in ready:
                    self._drain(self.sock, self.on_frames)
                if self.monitor is not None and self.monitor in ready:
                    self._drain(self.monitor, self._event)
        finally:
            for s in (self.monitor, self.sock, self._pull):
                if s is not None:
                    with contextlib.suppress(zmq.ZMQError):
                        s.close(0)

    def _drain_outbox(self) -> bool:
        while True:
            try:
                frames = self._pull.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return False
            if frames == [_STOP]:
                return True
            try:
                self.sock.send_multipart(frames, zmq.NOBLOCK)
            except zmq.ZMQError as exc:  # an unknown peer (ROUTER_MANDATORY) or a full queue
                self.on_send_error(frames, exc)

    def _drain(self, sock: zmq.Socket, handle: Callable[[list[bytes]], None]) -> None:
        for _ in range(1000):  # then poll again: the outbox must not starve
            try:
                parts = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            frames = [p.bytes for p in parts]
            if sock is self.sock:
                # the connection it came by (monitor events name connections the same way)
                self.last_fd = parts[-1].get(zmq.SRCFD)
            try:
                handle(frames)
            except Exception as exc:  # the I/O thread survives whatever a peer sends
                logger.error("control channel: dropped a message (%s: %s)", type(exc).__name__, exc)

    def _event(self, frames: list[bytes]) -> None:
        from zmq.utils.monitor import parse_monitor_message

        with contextlib.suppress(Exception):
            self.on_event(parse_monitor_message(frames))
