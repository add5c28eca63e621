"""One reward worker, started by :class:`~reco_megatron.rewards.pool.RewardPool` as
``python -m reco_megatron.rewards._worker FD PARENT_PID`` (a fresh interpreter: nothing is
forked from the trainer, and the caller's ``__main__`` is never re-imported). That process is
the worker's *keeper*; it forks the *scorer*, which runs :func:`worker_main`, and ends every
process the reward starts when the scorer, the pool or the trainer ends
(``reco_megatron.rewards.containment``). Neither dies from the job's stop signals
(SIGTERM, SIGINT, SIGUSR1: the trainer decides when it ends).

Protocol over a duplex ``Connection`` on the inherited socket ``FD``: the pool first sends
``(sys_path, spec, memory_limit_mb)``; the worker sends ``("ready", None)`` or
``("init_error", message)`` once, then for every ``(item_id, response, gold)`` it receives it
answers ``(item_id, score, status, detail)``; ``None`` asks it to exit. After a MemoryError it
answers and exits (its heap may be fragmented near the limit); the pool starts a new one.
The worker never logs through the package logger (that would import torch).
"""

from __future__ import annotations

import logging
import resource
import sys
import traceback
from multiprocessing.connection import Connection

from reco_megatron.rewards.containment import keeper_main
from reco_megatron.rewards.types import ERROR, INVALID, MEMORY, NAN, NONE


def limit_memory(memory_limit_mb: int | None) -> None:
    """Cap this process's address space (RLIMIT_AS) and disable core dumps."""
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if memory_limit_mb is not None:
        limit = int(memory_limit_mb) * 1024 * 1024
        _, hard = resource.getrlimit(resource.RLIMIT_AS)
        if hard != resource.RLIM_INFINITY:
            limit = min(limit, hard)
        resource.setrlimit(resource.RLIMIT_AS, (limit, hard))


def worker_main(conn: Connection, spec: str, memory_limit_mb: int | None) -> None:
    """Resolve ``spec``, then score items from ``conn`` until told to stop."""
    from reco_megatron.rewards.registry import coerce_result, resolve_reward

    try:
        limit_memory(memory_limit_mb)
        for noisy in ("math_verify", "latex2sympy2_extended"):
            logging.getLogger(noisy).setLevel(logging.CRITICAL)
        fn = resolve_reward(spec)
    except BaseException as exc:
        conn.send(("init_error", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", None))
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return  # the pool went away
        if message is None:
            return
        item_id, response, gold = message
        try:
            value = fn(response, gold)
            score, status = coerce_result(value)
            detail = f"returned {value!r}"[:300] if status in (INVALID, NAN, NONE) else ""
            conn.send((item_id, score, status, detail))
        except MemoryError:
            conn.send((item_id, 0.0, MEMORY, "MemoryError"))
            return
        except Exception as exc:
            detail = "".join(traceback.format_exception_only(type(exc), exc)).strip()
            conn.send((item_id, 0.0, ERROR, detail[:500]))


def main(argv: list[str] | None = None) -> None:
    """Entry point: ``python -m reco_megatron.rewards._worker FD PARENT_PID`` (the keeper)."""
    args = argv if argv is not None else sys.argv[1:]
    keeper_main(int(args[1]), int(args[0]), _scorer)


def _scorer(fd: int) -> None:
    """The scorer process: read the set-up message, then :func:`worker_main`."""
    conn = Connection(fd)
    try:
        sys_path, spec, memory_limit_mb = conn.recv()
    except (EOFError, OSError):
        return
    sys.path[:] = [*sys_path, *(p for p in sys.path if p not in sys_path)]
    worker_main(conn, spec, memory_limit_mb)


if __name__ == "__main__":
    main()
