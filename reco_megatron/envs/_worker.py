"""One environment worker, started by :class:`~reco_megatron.envs.pool.EnvPool` as
``python -m reco_megatron.envs._worker FD PARENT_PID``: the reward workers' keeper and
containment (:mod:`reco_megatron.rewards.containment`: nothing the environment starts
outlives the worker, the pool or the trainer; a fresh interpreter, an address-space cap),
with environments instead of a reward function inside.

Protocol over the inherited socket ``FD``: the pool first sends ``(sys_path, spec,
memory_limit_mb, tokenizer, vocab_size, max_ids)``; afterwards every message either way is
one JSON object (``send_bytes``; the pool reads at most :data:`MAX_MESSAGE_BYTES`), so nothing
the environment's code returns is unpickled by the trainer. The worker answers
``{"ready": true}`` or ``{"init_error": msg}`` once, then one answer per request:

- ``{"op": "reset", "id": k, "row": {...}}`` -> ``{"id": k, "ok": true, "prompt": [...],
  "stop_ids": [...]}`` (builds episode ``k``'s environment first);
- ``{"op": "step", "id": k, "action": [...], "finish": "stop"}`` -> ``{"id": k, "ok": true,
  "obs": [...], "done": bool, "reward": float | null, "stop_ids": [...]}``;
- ``{"op": "close", "id": k}`` drops episode ``k`` (no answer); ``null`` ends the worker.

A failure answers ``{"id": k, "ok": false, "status": "error" | "invalid" | "memory",
"detail": msg}``; after a MemoryError the worker exits (the pool starts a new one).
"""

from __future__ import annotations

import json
import sys
import traceback
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from reco_megatron.envs.contract import (
    MAX_MESSAGE_BYTES,
    StepError,
    check_ids,
    check_prompt,
    check_step,
)
from reco_megatron.rewards._worker import limit_memory
from reco_megatron.rewards.containment import keeper_main


def load_tokenizer(spec: str) -> Any:
    """The run's tokenizer for the environments: a SentencePiece ``.model`` file or a Hugging
    Face tokenizer directory; ``""``: None."""
    if not spec:
        return None
    from reco_megatron.data.tokenizer import HFTokenizer, SentencePieceTokenizer

    path = Path(spec)
    return SentencePieceTokenizer(path) if path.suffix == ".model" else HFTokenizer(path)


def _send(conn: Connection, message: dict[str, Any]) -> None:
    conn.send_bytes(json.dumps(message).encode())


def _answer(envs: dict[int, Any], cls: type, tokenizer: Any, msg: dict, limits: tuple) -> dict:
    vocab, max_ids = limits
    eid = int(msg["id"])
    if msg["op"] == "reset":
        env = cls(tokenizer)
        envs[eid] = env
        prompt = check_prompt(env.reset(msg["row"]), vocab, max_ids)
        stops = check_ids(getattr(env, "stop_ids", ()), "Env.stop_ids", vocab, max_ids)
        return {"id": eid, "ok": True, "prompt": prompt, "stop_ids": stops}
    step = check_step(envs[eid].step(list(msg["action"]), msg["finish"]), vocab, max_ids)
    return {
        "id": eid,
        "ok": True,
        "obs": list(step.observation_ids),
        "done": step.done,
        "reward": step.reward,
        "stop_ids": list(step.stop_ids),
    }


def worker_main(conn: Connection, spec: str, memory_limit_mb: int | None, setup: tuple) -> None:
    """Resolve ``spec`` and load the tokenizer, then serve requests until told to stop."""
    tokenizer_spec, vocab, max_ids = setup
    try:
        limit_memory(memory_limit_mb)
        from reco_megatron.envs.registry import resolve_env

        cls = resolve_env(spec)
        tokenizer = load_tokenizer(tokenizer_spec)
    except BaseException as exc:
        _send(conn, {"init_error": f"{type(exc).__name__}: {exc}"})
        return
    _send(conn, {"ready": True})
    envs: dict[int, Any] = {}
    while True:
        try:
            msg = json.loads(conn.recv_bytes(MAX_MESSAGE_BYTES))
        except (EOFError, OSError):
            return  # the pool went away
        if msg is None:
            return
        if msg["op"] == "close":
            envs.pop(int(msg["id"]), None)
            continue
        try:
            _send(conn, _answer(envs, cls, tokenizer, msg, (vocab, max_ids)))
        except MemoryError:
            _send(conn, {"id": msg["id"], "ok": False, "status": "memory", "detail": "MemoryError"})
            return
        except StepError as exc:
            _send(conn, {"id": msg["id"], "ok": False, "status": "invalid", "detail": str(exc)})
        except Exception as exc:
            detail = "".join(traceback.format_exception_only(type(exc), exc)).strip()
            _send(conn, {"id": msg["id"], "ok": False, "status": "error", "detail": detail[:500]})


def main(argv: list[str] | None = None) -> None:
    """Entry point: ``python -m reco_megatron.envs._worker FD PARENT_PID`` (the keeper)."""
    args = argv if argv is not None else sys.argv[1:]
    keeper_main(int(args[1]), int(args[0]), _serve)


def _serve(fd: int) -> None:
    conn = Connection(fd)
    try:
        sys_path, spec, memory_limit_mb, *setup = conn.recv()
    except (EOFError, OSError):
        return
    sys.path[:] = [*sys_path, *(p for p in sys.path if p not in sys_path)]
    worker_main(conn, spec, memory_limit_mb, tuple(setup))


if __name__ == "__main__":
    main()
