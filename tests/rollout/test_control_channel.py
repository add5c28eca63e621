"""The control channel as an attacker on the same machine sees it (loopback, bounded).

The trainer's side (:class:`Hub`) runs in this process; legitimate workers connect from
processes of their own; attackers are raw sockets or zmq clients holding (or not) the run's
keys. Every case checks the hub survives and still admits the run's worker, and that nothing
an attacker sends runs code (a marker file a pickle payload would create never appears).
"""

from __future__ import annotations

import os
import pickle
import queue
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import msgpack
import pytest
import torch
import zmq

from reco_megatron.rollout.address import ADDRESS_FILE, private_dir
from reco_megatron.rollout.hub import Hub
from reco_megatron.rollout.requests import Completion, SamplingParams
from reco_megatron.rollout.wire import WireError, decode, encode

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}
RUN = "run-under-attack"


class _Touch:
    """A pickle that creates ``path`` when unpickled (what an attacker would send)."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


@pytest.fixture
def hub(tmp_path: Path):
    events: queue.Queue = queue.Queue()
    h = Hub("127.0.0.1", "127.0.0.1", RUN, {0, 1}, events, lambda w, m: None, max_frame=2**20)
    h.dir = private_dir(tmp_path / "rollout")
    h.address.write(h.dir / ADDRESS_FILE)
    yield h
    h.close()


def _worker(hub: Hub, wid: int, timeout: float = 20) -> subprocess.CompletedProcess:
    """A real worker process that connects and says whether it was welcomed or refused."""
    code = (
        "import sys; from pathlib import Path\n"
        "from reco_megatron.rollout.worker_link import connect, Refused\n"
        f"hello = {{'kind': 'hello', 'worker': {wid}, 'pid': 1, 'cuda': False}}\n"
        "try:\n"
        f"    link = connect(Path({str(hub.dir / ADDRESS_FILE)!r}), 15, hello)\n"
        "    print('welcome'); link.close()\n"
        "except Refused as exc:\n"
        "    print('refused:', exc)\n"
    )
    return subprocess.run(
        [sys.executable, "-c", code], env=ENV, capture_output=True, text=True, timeout=timeout
    )


def _admitted(hub: Hub, wid: int) -> None:
    done = _worker(hub, wid)
    assert done.stdout.strip() == "welcome", done.stdout + done.stderr[-2000:]
    link, _ = hub.hellos.get(timeout=5)
    assert link.tag == wid


def _keyed_dealer(hub: Hub) -> tuple[zmq.Context, zmq.Socket]:
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    a = hub.address
    s.curve_serverkey = a.server_key.encode()
    s.curve_publickey = a.client_public.encode()
    s.curve_secretkey = a.client_secret.encode()
    s.connect(f"tcp://127.0.0.1:{a.port}")
    return ctx, s


@pytest.mark.dist
def test_keyless_connect_and_close_and_idle_connections_leave_the_hub_admitting(
    hub: Hub, caplog
) -> None:
    port = hub.address.port
    for _ in range(20):  # a port scan
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass
    idle = socket.create_connection(("127.0.0.1", port), timeout=5)  # held open, silent
    try:
        _admitted(hub, 0)
    finally:
        idle.close()


@pytest.mark.dist
@pytest.mark.parametrize("keyed", [False, True], ids=["without_key", "with_key"])
def test_a_code_execution_payload_runs_nothing(hub: Hub, tmp_path: Path, keyed: bool) -> None:
    marker = tmp_path / "pwned"
    payload = pickle.dumps(_Touch(marker))
    if keyed:  # an authenticated peer: the frame is decoded as msgpack, never unpickled
        ctx, s = _keyed_dealer(hub)
        s.send(payload)
        s.send(msgpack.packb({"kind": "hello", "worker": 0, "pid": 1, "cuda": False,
                              "run_id": RUN, "evil": payload}))  # fmt: skip
        answers = []
        for _ in range(2):  # each malformed frame is answered with the reason
            assert s.poll(10_000), answers
            answers.append(decode(s.recv()))
        assert [a["kind"] for a in answers] == ["refused", "refused"]
        assert "not a msgpack frame" in answers[0]["why"]
        assert "unexpected fields ['evil']" in answers[1]["why"]
        ctx.destroy(linger=0)
    else:  # multiprocessing.connection's framing: a 4-byte length, then the pickle
        with socket.create_connection(("127.0.0.1", hub.address.port), timeout=5) as s:
            s.sendall(struct.pack("!i", len(payload)) + payload)
            time.sleep(0.5)
    _admitted(hub, 1)
    assert not marker.exists()


@pytest.mark.dist
def test_a_2_62_byte_header_and_an_oversized_frame_are_dropped_before_allocation(
    hub: Hub,
) -> None:
    # keyless: a ZMTP greeting announcing a 2^62-byte frame
    with socket.create_connection(("127.0.0.1", hub.address.port), timeout=5) as s:
        greeting = b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x00" + b"CURVE".ljust(20, b"\x00")
        s.sendall(greeting + b"\x00" * 32 + b"\x02" + struct.pack("!Q", 2**62))
        time.sleep(0.5)
    # with the key: a frame over the hub's limit (1 MiB here) is refused by libzmq
    ctx, d = _keyed_dealer(hub)
    d.send(b"x" * (2**20 + 1))
    time.sleep(0.5)
    ctx.destroy(linger=0)
    _admitted(hub, 0)


@pytest.mark.dist
def test_duplicate_and_late_worker_ids_are_refused_with_the_reason(hub: Hub, caplog) -> None:
    _admitted(hub, 0)
    dup = _worker(hub, 0)
    assert "refused" in dup.stdout and "duplicate worker id 0" in dup.stdout, dup.stdout
    other = _worker(hub, 7)
    assert "worker id 7 is not one of this run's [0, 1]" in other.stdout, other.stdout
    hub.close_admission()
    late = _worker(hub, 1)
    assert "late worker id 1" in late.stdout, late.stdout
    lines = [r.getMessage() for r in caplog.records if "refused a worker" in r.getMessage()]
    assert len(lines) == 3, lines  # one line each


@pytest.mark.dist
def test_the_hub_binds_loopback_only(hub: Hub) -> None:
    assert hub.endpoint.startswith("tcp://127.0.0.1:")
    psutil = pytest.importorskip("psutil")
    mine = [
        c for c in psutil.Process().net_connections("inet")
        if c.status == psutil.CONN_LISTEN and c.laddr.port == hub.address.port
    ]  # fmt: skip
    assert [c.laddr.ip for c in mine] == ["127.0.0.1"]


def test_every_frame_kind_round_trips_and_anything_else_is_refused() -> None:
    ok = {"kind": "error", "request": None, "message": "boom"}
    assert decode(encode(ok)) == ok
    sampling = SamplingParams(temperature=0.7, top_p=0.9, seed=3, stop_token_ids=(5, 6))
    gen = {"kind": "generate", "id": 1, "prompts": [[1, 2]], "n": 2, "min_version": 0,
           "sampling": [sampling], "rows": None}  # fmt: skip
    assert decode(encode(gen)) == gen
    routed = torch.tensor([[[1, -1]], [[0, 3]]], dtype=torch.int16)  # [P + T, layers, top-k]
    done = Completion(prompt_index=0, sample_index=1, token_ids=[7], logprobs=[-0.1 / 3],
                      finish_reason="stop", routed_experts=routed)  # fmt: skip
    result = {"kind": "result", "request": 1, "version": 2, "generate_s": 0.5, "idle_s": 0.0,
              "completions": [[done]], "episodes": None}  # fmt: skip
    back = decode(encode(result))["completions"][0][0]
    assert back.logprobs == done.logprobs and back.token_ids == done.token_ids  # bit for bit
    assert torch.equal(back.routed_experts, routed) and back.routed_experts.dtype == torch.int16
    # An episode's completion carries its loss mask (0 on an environment's tokens).
    episode = Completion(prompt_index=0, sample_index=0, token_ids=[7, 8, 9],
                         logprobs=[-0.5, 0.0, -0.25], finish_reason="stop",
                         loss_mask=[1, 0, 1])  # fmt: skip
    result["completions"] = [[episode]]
    assert decode(encode(result))["completions"][0][0].loss_mask == [1, 0, 1]
    bad = [
        pickle.dumps({"kind": "ping"}),
        msgpack.packb([1, 2]),
        msgpack.packb({"kind": "ping", "extra": 1}),
        msgpack.packb({"kind": "received", "version": "1", "s": 0.1, "plan_digest": "x"}),
        msgpack.packb({"kind": "heartbeat", "version": True}),
        msgpack.packb({"kind": "nope"}),
        msgpack.packb({"kind": "ping", 1: 2}, strict_types=False),
    ]
    for frame in bad:
        with pytest.raises(WireError):
            decode(frame)


@pytest.mark.dist
def test_a_worker_whose_connection_closes_is_reported_gone(hub: Hub) -> None:
    _admitted(hub, 0)  # the worker process exits after its welcome
    gone = hub.events.get(timeout=30)
    assert gone["kind"] == "gone" and gone["_from"] == 0, gone
