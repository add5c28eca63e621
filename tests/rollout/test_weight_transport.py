"""The weight push's transport: buckets, alignment, versions and dead receivers.

Two or three local processes form a gloo group on a TCP store, as the trainer's senders and a
worker do; tensors must arrive bit for bit (any dtype, any offset in a bucket), a header of
another version must fail the receiver loudly, and a receiver that died must fail only its
own target while the live one still gets every bucket.
"""

from __future__ import annotations

import multiprocessing as mp
import socket

import pytest
import torch
import torch.distributed as dist

from reco_megatron.rollout.weight_transport import (
    ALIGN,
    PushPlan,
    TensorSpec,
    receive_push,
    send_push,
    weight_group,
)

TIMEOUT = 30


def _plan(bucket_bytes: int = 80, senders: int = 1) -> PushPlan:
    specs = [
        TensorSpec("a", (3,), "float32", 0),  # 12 bytes: padded to 16
        TensorSpec("b", (5,), "bfloat16", 0),  # 10 bytes: the next tensor must still align
        TensorSpec("c", (2, 3), "float64", 0),
        TensorSpec("big", (40,), "float32", 0),  # 160 bytes > bucket: travels alone
        TensorSpec("d", (1,), "int64", senders - 1),
    ]
    return PushPlan(tuple(specs), senders=senders, bucket_bytes=bucket_bytes)


def _tensors(plan: PushPlan, sender: int, seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for spec in plan.tensors:
        if spec.sender == sender:
            t = torch.randn(spec.shape, generator=g, dtype=torch.float64) * 100
            out.append((spec.name, t.to(spec.torch_dtype)))
    return out


def test_buckets_group_consecutive_tensors_of_one_sender_and_keep_alignment() -> None:
    plan = _plan()
    assert plan.buckets == [[0, 1, 2], [3], [4]]
    for bucket in plan.buckets:
        assert sum(plan.tensors[i].padded_bytes for i in bucket) % ALIGN == 0
    two = _plan(senders=2)
    assert two.buckets_of(1) == [[4]]  # another sender's tensor starts a bucket of its own
    assert PushPlan.from_json(plan.to_json()) == plan


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _member(rank: int, size: int, port: int, mode: str, out: mp.Queue) -> None:
    try:
        store = dist.TCPStore("127.0.0.1", port, size, rank == 0, timeout=_td(TIMEOUT))
        senders = 2 if mode == "two_senders" else 1
        plan = _plan(senders=senders)
        receivers = list(range(senders, size))
        if mode == "dead_receiver" and rank == size - 1:
            group = weight_group(store, "w/b", 1, 2, backend="gloo", timeout_s=5)
            out.put((rank, "dead"))
            return  # dies after joining: its sender must not hang on it
        if rank < senders:
            if mode == "dead_receiver":
                targets = [
                    (weight_group(store, f"w/{x}", 0, 2, backend="gloo", timeout_s=5), 1)
                    for x in ("a", "b")
                ]
            else:
                group = weight_group(store, "w", rank, size, backend="gloo", timeout_s=TIMEOUT)
                targets = [(group, r) for r in receivers]
            version = 7
            sent, failed = send_push(
                targets, plan, rank, version, _tensors(plan, rank, 0), torch.device("cpu")
            )
            out.put((rank, (sent, sorted(failed))))
            return
        if mode == "dead_receiver":
            group, me = weight_group(store, "w/a", 1, 2, backend="gloo", timeout_s=5), 1
        else:
            group, me = (
                weight_group(store, "w", rank, size, backend="gloo", timeout_s=TIMEOUT),
                rank,
            )
        version = 8 if mode == "wrong_version" else 7
        try:
            got = list(receive_push(group, plan, me, version, torch.device("cpu")))
        except RuntimeError as exc:
            out.put((rank, f"error: {exc}"))
            return
        sent = {}
        for s in range(plan.senders):
            sent.update(dict(_tensors(plan, s, 0)))
        same = [
            name for name, t in got if t.dtype == sent[name].dtype and torch.equal(t, sent[name])
        ]
        out.put((rank, same))
    except Exception as exc:  # reported to the test
        out.put((rank, f"crash: {type(exc).__name__}: {exc}"))


def _td(s: float):
    import datetime

    return datetime.timedelta(seconds=s)


def _run(size: int, mode: str) -> dict[int, object]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_member, args=(r, size, port, mode, out)) for r in range(size)]
    for p in procs:
        p.start()
    results = {}
    try:
        for _ in range(size):
            rank, value = out.get(timeout=TIMEOUT * 2)
            results[rank] = value
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return results


@pytest.mark.dist
@pytest.mark.parametrize("mode", ["one_sender", "two_senders"])
def test_every_tensor_arrives_bit_for_bit(mode: str) -> None:
    results = _run(3, mode)  # 1 sender + 2 workers, or 2 senders + 1 worker
    plan = _plan(senders=2 if mode == "two_senders" else 1)
    names = [s.name for s in plan.tensors]
    receivers = [r for r in results if r >= plan.senders]
    for r in receivers:
        assert results[r] == names, results
    for s in range(plan.senders):
        sent, failed = results[s]
        assert failed == []
        assert sent == sum(sum(plan.tensors[i].padded_bytes for i in b) for b in plan.buckets_of(s))


@pytest.mark.dist
def test_a_push_of_another_version_fails_the_receiver_loudly() -> None:
    results = _run(2, "wrong_version")
    assert isinstance(results[1], str) and "version 7" in results[1] and "version 8" in results[1]


@pytest.mark.dist
def test_a_dead_receiver_fails_only_its_own_target() -> None:
    results = _run(3, "dead_receiver")
    assert results[2] == "dead"
    _, failed = results[0]
    assert failed == [1]  # target 1 (group "w/b") died; target 0 got everything
    assert results[1] == [s.name for s in _plan().tensors]
