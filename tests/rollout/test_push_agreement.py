"""A push the two sides do not agree on is refused before a byte of it is used.

Two local processes form a gloo group on a ``FileStore`` in a private directory, as a sender
and a worker do. Buckets larger or smaller than the receiver's plan (the same count, other
sizes: what once loaded uninitialised memory as weights, or aborted the receiver) fail the
receiver with :class:`PushMismatch` from the header alone; a member that cannot show the
token the trainer handed out over the control channel fails the trainer's check.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from reco_megatron.rollout.weight_transport import (
    PushMismatch,
    PushPlan,
    TensorSpec,
    check_members,
    receive_push,
    send_push,
    weight_group,
)

TIMEOUT = 30


def _plan(n: int) -> PushPlan:
    return PushPlan((TensorSpec("a", (n,), "float32", 0),), senders=1, bucket_bytes=1 << 20)


def _member(rank: int, store_path: str, mode: str, out) -> None:
    try:
        store = dist.FileStore(store_path, -1)
        group = weight_group(store, "w", rank, 2, backend="gloo", timeout_s=TIMEOUT)
        cpu = torch.device("cpu")
        if mode == "impostor":
            mine, theirs = (b"t" * 32, b"w" * 32) if rank == 0 else (b"x" * 32, b"y" * 32)
            check_members(group, rank, [1 - rank], mine, theirs, cpu, receive_first=rank == 0)
            out.put((rank, "passed"))
            return
        sent_n, want_n = (3, 9) if mode == "larger" else (9, 3)
        if rank == 0:
            tensor = torch.arange(sent_n, dtype=torch.float32)
            with contextlib.suppress(RuntimeError):  # the receiver refused and left
                send_push([(group, 1)], _plan(sent_n), 0, 1, [("a", tensor)], cpu)
            out.put((0, "sent"))
            return
        got = list(receive_push(group, _plan(want_n), 1, 1, cpu))
        out.put((1, f"loaded {[t.tolist() for _, t in got]}"))
    except PushMismatch as exc:
        out.put((rank, f"refused: {exc}"))
    except Exception as exc:  # reported to the test
        out.put((rank, f"crash: {type(exc).__name__}: {exc}"))


def _run(tmp_path: Path, mode: str) -> dict[int, str]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    store = str(tmp_path / "store")
    procs = [ctx.Process(target=_member, args=(r, store, mode, out)) for r in range(2)]
    for p in procs:
        p.start()
    results: dict[int, str] = {}
    try:
        while len(results) < 2:
            rank, value = out.get(timeout=TIMEOUT * 2)
            results[rank] = value
    except Exception:
        codes = [p.exitcode for p in procs]
        raise AssertionError(f"a member never answered (exit codes {codes}): {results}") from None
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return results


@pytest.mark.dist
@pytest.mark.parametrize("mode", ["larger", "smaller"])
def test_buckets_of_another_size_are_refused_before_they_are_read(
    tmp_path: Path, mode: str
) -> None:
    results = _run(tmp_path, mode)
    assert results[1].startswith("refused:"), results
    assert "differ from the plan agreed at setup" in results[1]


@pytest.mark.dist
def test_a_member_without_the_runs_token_fails_the_check(tmp_path: Path) -> None:
    results = _run(tmp_path, "impostor")
    assert results[0].startswith("refused:") and "did not prove" in results[0], results


def test_the_digest_covers_names_shapes_dtypes_and_bucket_sizes() -> None:
    base = PushPlan((TensorSpec("a", (3,), "float32", 0),), senders=1, bucket_bytes=64)
    variants = [
        PushPlan((TensorSpec("b", (3,), "float32", 0),), senders=1, bucket_bytes=64),
        PushPlan((TensorSpec("a", (4,), "float32", 0),), senders=1, bucket_bytes=64),
        PushPlan((TensorSpec("a", (3,), "int32", 0),), senders=1, bucket_bytes=64),
        PushPlan((TensorSpec("a", (3,), "float32", 0),) * 2, senders=1, bucket_bytes=16),
    ]
    assert len({base.digest(), *(v.digest() for v in variants)}) == 5
    assert PushPlan.from_json(base.to_json()).digest() == base.digest()
    for bad in ({"senders": "1"}, {**base.to_json(), "tensors": [["a", [-1], "float32", 0]]},
                {**base.to_json(), "tensors": [["a", [3], "os.system", 0]]}):  # fmt: skip
        with pytest.raises(PushMismatch):
            PushPlan.from_json(bad)


def test_the_digest_is_computed_once_per_plan_and_sender() -> None:
    """Both ends of every push ask for the digest: it is kept per plan and per sender, and a
    kept one is what a fresh plan of the same tensors computes."""
    specs = (TensorSpec("a", (3,), "float32", 0), TensorSpec("b", (5,), "float32", 1))
    plan = PushPlan(specs, senders=2, bucket_bytes=64)
    first = {s: plan.digest(s) for s in (None, 0, 1)}
    assert len(set(first.values())) == 3
    for sender, digest in first.items():
        assert plan.digest(sender) is digest
        assert PushPlan(specs, senders=2, bucket_bytes=64).digest(sender) == digest
    assert plan == PushPlan(specs, senders=2, bucket_bytes=64)  # the cache is not a field
