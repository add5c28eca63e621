"""Weights from the trainer to separate rollout workers: flat byte buckets over a process
group made for the purpose (gloo on CPU, NCCL on GPUs), outside the trainer's own world.

A push is one version of the policy as the Hugging Face ``(name, tensor)`` stream of the
colocated refit, cut into buckets: consecutive tensors viewed as bytes and concatenated until
a bucket holds about ``bucket_bytes`` (a larger tensor travels alone). Each sender owns a
contiguous part of the stream (a pipeline stage's tensors, exported by that stage) and sends
it point to point to every worker; the worker knows the whole :class:`PushPlan` from the
handshake, so it receives each bucket from its sender in order and cuts it back into tensors
of the planned names, shapes and dtypes. Both sides agree on the plan before a byte is used:
the setup and every ``weights`` message carry :meth:`PushPlan.digest` (names, shapes, dtypes,
senders and the bucket sizes) over the authenticated control channel, the worker echoes it
in ``ready`` and ``received``, and before the buckets every sender sends a header
``[version, buckets, digest of its part]`` that the worker checks: a push of another version
or another plan raises :class:`PushMismatch` before any bucket is received (a bucket of the
wrong size is never read into memory the plan did not size).

The group's members meet in a ``FileStore`` in the run's private directory, and then prove
they are the run's (:func:`check_members`: tokens the trainer handed out over the control
channel) before a push.

Every operation waits at most the group's timeout; a dead peer fails the wait at once (gloo
reports the reset connection), so a push never hangs on a worker that died.
"""

from __future__ import annotations

import datetime
import hashlib
import json
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property

import torch
import torch.distributed as dist

HEADER_DTYPE = torch.int64
HEADER_LEN = 6
"""``[version, buckets, 4 x 64-bit words of the sender's part's digest]``."""
TOKEN_BYTES = 32
ALIGN = 16
"""Each tensor starts at a multiple of this many bytes in its bucket (any dtype views it)."""


def _aligned(nbytes: int) -> int:
    return (nbytes + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of the stream: its HF name, full shape, dtype name and sender."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    """``str(torch.dtype)`` without the ``torch.`` prefix (``float32``, ``bfloat16``)."""
    sender: int
    """Rank of the sender in the weight group (0 .. senders-1)."""

    @property
    def torch_dtype(self) -> torch.dtype:
        dtype = getattr(torch, self.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"tensor {self.name}: unknown dtype {self.dtype!r}")
        return dtype

    @property
    def nbytes(self) -> int:
        numel = 1
        for d in self.shape:
            numel *= int(d)
        return numel * torch.empty((), dtype=self.torch_dtype).element_size()

    @property
    def padded_bytes(self) -> int:
        """Its room in a bucket (``nbytes`` rounded up to :data:`ALIGN`)."""
        return _aligned(self.nbytes)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class PushPlan:
    """The stream every push carries: tensors in order, each sender's part contiguous, and
    the buckets they are cut into (``buckets[i]`` = indices into ``tensors``)."""

    tensors: tuple[TensorSpec, ...]
    senders: int
    bucket_bytes: int

    @property
    def buckets(self) -> list[list[int]]:
        out: list[list[int]] = []
        size, sender = 0, -1
        for i, spec in enumerate(self.tensors):
            room = spec.padded_bytes
            if out and spec.sender == sender and size + room <= self.bucket_bytes:
                out[-1].append(i)
                size += room
            else:
                out.append([i])
                size, sender = room, spec.sender
        return out

    def buckets_of(self, sender: int) -> list[list[int]]:
        return [b for b in self.buckets if self.tensors[b[0]].sender == sender]

    @cached_property
    def _digests(self) -> dict[int | None, str]:
        """:meth:`digest` by sender, filled on first use: a plan never changes, and both ends
        of every push ask for it (about 3 ms for an 8B model's 291 tensors, 2026-12-07)."""
        return {}

    def digest(self, sender: int | None = None) -> str:
        """SHA-256 (hex) of the plan, or of ``sender``'s part: each tensor's name, shape,
        dtype and sender, and the byte size of each bucket."""
        if sender not in self._digests:
            self._digests[sender] = self._digest_of(sender)
        return self._digests[sender]

    def _digest_of(self, sender: int | None) -> str:
        buckets = self.buckets if sender is None else self.buckets_of(sender)
        data = {
            "senders": self.senders,
            "tensors": [[self.tensors[i].name, list(self.tensors[i].shape),
                         self.tensors[i].dtype, self.tensors[i].sender]
                        for b in buckets for i in b],
            "bucket_sizes": [sum(self.tensors[i].padded_bytes for i in b) for b in buckets],
        }  # fmt: skip
        return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()

    @property
    def total_bytes(self) -> int:
        return sum(spec.nbytes for spec in self.tensors)

    def to_json(self) -> dict[str, object]:
        return {
            "senders": self.senders,
            "bucket_bytes": self.bucket_bytes,
            "tensors": [[s.name, list(s.shape), s.dtype, s.sender] for s in self.tensors],
        }

    @classmethod
    def from_json(cls, data: dict[str, object]) -> PushPlan:
        """The plan of :meth:`to_json`; :class:`PushMismatch` for anything else."""
        try:
            senders, bucket_bytes, rows = data["senders"], data["bucket_bytes"], data["tensors"]
            ok = type(senders) is int and type(bucket_bytes) is int and senders >= 1
            ok = ok and bucket_bytes >= 1 and isinstance(rows, list)
            tensors = []
            for n, shape, dt, snd in rows:  # type: ignore[union-attr]
                ok = ok and isinstance(n, str) and isinstance(dt, str) and type(snd) is int
                ok = (
                    ok and isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)
                )
                ok = ok and 0 <= snd < senders
                if not ok:
                    break
                spec = TensorSpec(n, tuple(shape), dt, snd)
                spec.torch_dtype  # noqa: B018 - raises for an unknown dtype
                tensors.append(spec)
        except (KeyError, TypeError, ValueError) as exc:
            raise PushMismatch(f"not a push plan ({type(exc).__name__}: {exc})") from None
        if not ok:
            raise PushMismatch("not a push plan (a field of the wrong type or range)")
        return cls(tuple(tensors), senders, bucket_bytes)


class PushMismatch(RuntimeError):
    """The two sides of a push disagree on what it carries (version, tensors, bucket sizes);
    raised before any of it is used."""


def _digest_words(digest: str) -> list[int]:
    raw = bytes.fromhex(digest)[:32]
    return [int.from_bytes(raw[i : i + 8], "little", signed=True) for i in range(0, 32, 8)]


def weight_group(
    store: dist.Store,
    prefix: str,
    rank: int,
    size: int,
    *,
    backend: str,
    timeout_s: float,
    device: torch.device | None = None,
) -> dist.ProcessGroup:
    """A process group of ``size`` members on ``store`` under ``prefix`` (independent of the
    default group, so trainer ranks and workers can share it): ``gloo`` or ``nccl``."""
    timeout = datetime.timedelta(seconds=timeout_s)
    scoped = dist.PrefixStore(prefix, store)
    if backend == "gloo":
        return dist.ProcessGroupGloo(scoped, rank, size, timeout)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        if device is not None:
            torch.cuda.set_device(device)
        return dist.ProcessGroupNCCL(scoped, rank, size, options)
    raise ValueError(f"weight push backend must be 'gloo' or 'nccl', got {backend!r}")


def send_push(
    targets: Sequence[tuple[dist.ProcessGroup, int]],
    plan: PushPlan,
    sender: int,
    version: int,
    named: Iterable[tuple[str, torch.Tensor]],
    device: torch.device,
) -> tuple[int, set[int]]:
    """Send this sender's part of version ``version`` to every ``(group, receiver rank)`` of
    ``targets``; ``named`` yields exactly the planned tensors of ``sender`` in order. Returns
    the bytes sent per target and the indices of the targets that failed (a dead or hung
    receiver fails its own target only: the others still get every bucket)."""
    mine = plan.buckets_of(sender)
    failed: set[int] = set()
    words = [version, len(mine), *_digest_words(plan.digest(sender))]
    header = torch.tensor(words, dtype=HEADER_DTYPE, device=device)
    _send_all(targets, header, 0, failed)
    stream = iter(named)
    sent = 0
    for bucket in mine:
        parts = []
        for i in bucket:
            spec = plan.tensors[i]
            name, tensor = next(stream)
            if name != spec.name or tuple(tensor.shape) != spec.shape:
                raise PushMismatch(
                    f"weight push: the stream gave {name} {list(tensor.shape)} where the plan "
                    f"has {spec.name} {list(spec.shape)} (the model changed after the handshake)"
                )
            flat = tensor.detach().to(device=device, dtype=spec.torch_dtype).contiguous()
            parts.append(flat.reshape(-1).view(torch.uint8))
            if spec.padded_bytes > spec.nbytes:
                pad = spec.padded_bytes - spec.nbytes
                parts.append(torch.zeros(pad, dtype=torch.uint8, device=device))
        buf = torch.cat(parts) if len(parts) > 1 else parts[0]
        _send_all(targets, buf, 1, failed)
        sent += buf.numel()
    left = sum(1 for _ in stream)
    if left:
        raise PushMismatch(f"weight push: the stream carried {left} tensor(s) beyond the plan")
    return sent, failed


def _send_all(
    targets: Sequence[tuple[dist.ProcessGroup, int]],
    tensor: torch.Tensor,
    tag: int,
    failed: set[int],
) -> None:
    works = {}
    for i, (group, dst) in enumerate(targets):
        if i not in failed:
            try:
                works[i] = group.send([tensor], dst, tag)
            except RuntimeError:
                failed.add(i)
    for i, work in works.items():
        try:
            work.wait()
        except RuntimeError:
            failed.add(i)


def receive_push(
    group: dist.ProcessGroup, plan: PushPlan, me: int, version: int, device: torch.device
) -> Iterator[tuple[str, torch.Tensor]]:
    """Receive version ``version`` (group rank ``me``) from every sender; yields the planned
    ``(name, tensor)`` pairs in plan order. Raises :class:`PushMismatch` on a header of
    another version, bucket count or plan, before any bucket is received."""
    for sender in range(plan.senders):
        header = torch.zeros(HEADER_LEN, dtype=HEADER_DTYPE, device=device)
        group.recv([header], sender, 0).wait()
        got_version, count, *words = (int(x) for x in header.tolist())
        want = len(plan.buckets_of(sender))
        if got_version != version:
            raise PushMismatch(
                f"weight push from sender {sender}: header says version {got_version}, the "
                f"control message announced version {version}"
            )
        if count != want or words != _digest_words(plan.digest(sender)):
            raise PushMismatch(
                f"weight push from sender {sender}: its {count} bucket(s) (sizes, tensor "
                f"names, shapes or dtypes) differ from the plan agreed at setup ({want} "
                "bucket(s)); nothing of it was loaded"
            )
        for bucket in plan.buckets_of(sender):
            specs = [plan.tensors[i] for i in bucket]
            size = sum(s.padded_bytes for s in specs)
            buf = torch.empty(size, dtype=torch.uint8, device=device)
            group.recv([buf], sender, 1).wait()
            offset = 0
            for spec in specs:
                raw = buf[offset : offset + spec.nbytes]
                offset += spec.padded_bytes
                yield spec.name, raw.view(spec.torch_dtype).reshape(spec.shape)


def check_members(
    group: dist.ProcessGroup,
    me: int,
    peers: Sequence[int],
    mine: bytes,
    theirs: bytes,
    device: torch.device,
    receive_first: bool,
) -> None:
    """After the rendezvous: prove this member is the run's (send ``mine``) and check each
    of ``peers`` is (it must send ``theirs``), in order; tokens came over the authenticated
    control channel. ``receive_first``: the trainer's side (it answers), else the worker's.
    Raises :class:`PushMismatch` naming the group rank that failed."""
    out = torch.frombuffer(bytearray(mine), dtype=torch.uint8).to(device)
    want = torch.frombuffer(bytearray(theirs), dtype=torch.uint8).to(device)
    for peer in peers:
        got = torch.zeros(TOKEN_BYTES, dtype=torch.uint8, device=device)
        if receive_first:
            group.recv([got], peer, 2).wait()
            group.send([out], peer, 3).wait()
        else:
            group.send([out], peer, 2).wait()
            group.recv([got], peer, 3).wait()
        if not torch.equal(got, want):
            raise PushMismatch(
                f"weight group member {peer} (of group rank {me}'s peers) did not prove it is "
                "this run's: a process that is not the run's joined the group"
            )
