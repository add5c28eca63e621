"""Count what a piece of torch code launches, on any device (a CPU run tells a GPU's count).

:class:`LaunchCounter` is a ``TorchDispatchMode``: every aten operator that reaches the
dispatcher inside it is recorded. Operators that launch no device kernel (views, ``empty*``
allocations, ``detach``) are listed apart, collectives (``c10d``) too, and Triton kernels,
which bypass the dispatcher, are added from
:data:`reco_megatron.parallel.vocab_stats_triton.LAUNCHES`. So ``counter.launches`` is the
number of kernels the same code launches on a GPU: each aten op that computes is one launch
there (or a few for some composite ops: this is a lower bound for those, exact for the
elementwise and reduction ops the statistics use).

    with LaunchCounter() as fwd:
        stats = vocab_parallel_stats(logits, target, vocab_size, implementation="triton")
    print(fwd.launches, fwd.ops)
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

NO_KERNEL = {
    "aten.empty.memory_format",
    "aten.empty_like.default",
    "aten.empty_strided.default",
    "aten.new_empty.default",
    "aten.new_empty_strided.default",
    "aten.detach.default",
    "aten.alias.default",
    "aten.lift_fresh.default",
    "aten._local_scalar_dense.default",  # a host read (a synchronisation), not a kernel
    "aten.promote_types.default",
}
"""aten operators that allocate or alias without launching a device kernel."""


def _triton_launches() -> int:
    try:
        from reco_megatron.parallel.vocab_stats_triton import LAUNCHES
    except ImportError:  # pragma: no cover - the module imports without Triton
        return 0
    return LAUNCHES["count"]


class LaunchCounter(TorchDispatchMode):
    """Record the aten operators dispatched inside the ``with`` block (see module doc)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        """Every dispatched operator by name (``aten.exp.default``: count)."""
        self.syncs = 0
        """Host reads of device values (``.item()``, ``int(t)``): synchronisations on a GPU."""
        self._triton_start = 0
        self.triton = 0
        """Triton kernel launches (they bypass the dispatcher)."""

    def __enter__(self) -> LaunchCounter:
        self._triton_start = _triton_launches()
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        self.triton = _triton_launches() - self._triton_start
        super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        self.ops[name] += 1
        if name == "aten._local_scalar_dense.default":
            self.syncs += 1
        return func(*args, **(kwargs or {}))

    @property
    def collectives(self) -> int:
        """Collective operations (``c10d`` operators, e.g. all-reduce)."""
        return sum(n for name, n in self.ops.items() if name.startswith("c10d."))

    @property
    def torch_kernels(self) -> int:
        """aten operators that launch a device kernel (not views, allocations, collectives)."""
        total = 0
        for name, n in self.ops.items():
            if name.startswith("c10d.") or name in NO_KERNEL or _is_view(name):
                continue
            total += n
        return total

    @property
    def launches(self) -> int:
        """Device kernels: :attr:`torch_kernels` plus Triton launches (collectives apart)."""
        return self.torch_kernels + self.triton


def _is_view(name: str) -> bool:
    namespace, op, overload = name.split(".", 2)
    packet = getattr(getattr(torch.ops, namespace), op, None)
    func = getattr(packet, overload, None) if packet is not None else None
    return bool(getattr(func, "is_view", False))


def count_stats_op(rank: int, world_size: int, implementation: str) -> dict[str, Any]:
    """One forward + backward of ``vocab_parallel_stats`` on this rank, counted: launches,
    Triton kernels, collectives and host synchronisations (tiny shapes: the counts do not
    depend on them; run it under ``TRITON_INTERPRET=1`` for ``triton`` on a CPU). Run by
    ``benchmarks/kernel_sass.py`` and the interpreted Triton tests, in processes of their own
    (it sets ``RECO_CHECK_TARGETS=0``)."""
    import os

    import torch.distributed as dist

    from reco_megatron.parallel import vocab_parallel_stats

    # No host check of the (CPU) targets: count what runs on a GPU by default.
    os.environ["RECO_CHECK_TARGETS"] = "0"
    gen = torch.Generator().manual_seed(rank)
    logits = torch.randn(4, 64, generator=gen).requires_grad_()
    target = torch.tensor([0, 5, 70, -1]) % (64 * world_size)
    group = dist.group.WORLD if world_size > 1 else None
    grads = [torch.randn(4, generator=gen) for _ in range(3)]
    with LaunchCounter() as forward:
        stats = vocab_parallel_stats(
            logits, target, 64 * world_size, group, None, implementation, inplace_backward=True
        )
    with LaunchCounter() as backward:
        torch.autograd.backward(list(stats), grads)
    return {
        "forward_launches": forward.launches,
        "backward_launches": backward.launches,
        "launches": forward.launches + backward.launches,
        "triton_kernels": forward.triton + backward.triton,
        "collectives": forward.collectives + backward.collectives,
        "host_syncs": forward.syncs + backward.syncs,
        "forward_ops": dict(forward.ops),
        "backward_ops": dict(backward.ops),
    }
