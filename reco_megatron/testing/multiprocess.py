"""Run a function on N local ranks over gloo, with a hard timeout.

Starting a Python process that imports megatron-core costs 6-8 s on a small CPU box, a fresh
spawned 2-rank group ~10 s. Forking from a parent that already imported megatron costs <1 s,
but forking the pytest process itself is unsafe once it has run torch ops (OpenMP thread
pools do not survive ``fork``). So ranks are forked from multiprocessing's *forkserver*, a
process that imports torch and megatron once (``preload``) and never computes anything.

Usage::

    def body(rank, world_size, x):           # module-level, so it pickles
        import torch.distributed as dist      # the default group is gloo, already initialised
        ...
        return something_picklable

    results = run_distributed(body, world_size=2, args=(3,), timeout=120)   # one per rank

Any rank's exception fails the whole run with that rank's traceback, and the other ranks are
killed (they would otherwise wait forever in a collective). A run past ``timeout`` seconds
is killed too and names the ranks that had not finished.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

_PRELOAD = ["torch", "torch.distributed", "megatron.core"]
_CONTEXT: Any = None


class DistributedRunError(RuntimeError):
    """A rank raised, died, or the run exceeded its timeout."""


def _context() -> Any:
    global _CONTEXT
    if _CONTEXT is None:
        ctx = mp.get_context("forkserver")
        preload = [m for m in _PRELOAD if _importable(m)]
        ctx.set_forkserver_preload(preload)
        _CONTEXT = ctx
    return _CONTEXT


def _importable(module: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _worker(
    rank: int,
    world_size: int,
    init_file: str,
    fn: Callable[..., Any],
    args: Sequence[Any],
    kwargs: dict[str, Any],
    results: Any,
    env: dict[str, str],
) -> None:
    os.environ.update(env)
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank)})
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size
        )
        out = fn(rank, world_size, *args, **kwargs)
        # Plain pickle, not the queue's ForkingPickler: torch registers reductions there that
        # move tensors through shared memory owned by this process, which is gone (and the
        # parent fails with FileNotFoundError) by the time the parent unpickles.
        results.put((rank, "ok", pickle.dumps(out)))
    except BaseException:  # report everything, including SystemExit from a test body
        results.put((rank, "error", traceback.format_exc()))
    finally:
        try:
            if "megatron.core" in sys.modules:
                from reco_megatron.megatron import shutdown_async_writer

                shutdown_async_writer()
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:
            pass


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    args: Sequence[Any] = (),
    kwargs: dict[str, Any] | None = None,
    timeout: float = 120.0,
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` local gloo ranks.

    Returns the per-rank return values, ordered by rank. ``fn`` must be importable
    (a module-level function) and its return value picklable. ``env`` is added to each
    rank's environment before ``fn`` runs.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ctx = _context()
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="reco_dist_") as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [
            ctx.Process(
                target=_worker,
                args=(
                    r,
                    world_size,
                    init_file,
                    fn,
                    tuple(args),
                    dict(kwargs or {}),
                    results,
                    dict(env or {}),
                ),
                # Not daemonic: megatron's dist_checkpointing save starts a multiprocessing
                # Manager inside the rank, which daemonic processes may not do. Ranks are
                # still killed in the ``finally`` below if they outlive the run.
                daemon=False,
            )
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        outputs: dict[int, Any] = {}
        deadline = time.monotonic() + timeout
        try:
            while len(outputs) < world_size:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    missing = sorted(set(range(world_size)) - set(outputs))
                    raise DistributedRunError(
                        f"{fn.__qualname__} on {world_size} ranks exceeded its {timeout:.0f} s "
                        f"timeout; ranks {missing} had not finished"
                    )
                try:
                    rank, status, payload = results.get(timeout=min(remaining, 1.0))
                except queue.Empty:
                    dead = [
                        r
                        for r, p in enumerate(procs)
                        if r not in outputs and p.exitcode is not None
                    ]
                    if dead:
                        # Give a rank that just reported its error a moment to be read.
                        try:
                            rank, status, payload = results.get(timeout=2.0)
                        except queue.Empty:
                            raise DistributedRunError(
                                f"ranks {dead} of {fn.__qualname__} died without reporting "
                                f"(exit codes {[procs[r].exitcode for r in dead]})"
                            ) from None
                    else:
                        continue
                if status == "error":
                    raise DistributedRunError(
                        f"rank {rank} of {world_size} failed in {fn.__qualname__}:\n{payload}"
                    )
                outputs[rank] = pickle.loads(payload)
        finally:
            for p in procs:
                if p.is_alive():
                    p.join(timeout=5.0 if len(outputs) == world_size else 0.0)
                if p.is_alive():
                    p.kill()
                    p.join()
    return [outputs[r] for r in range(world_size)]
