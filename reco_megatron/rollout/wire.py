"""The frames of the control channel between the trainer and its rollout workers.

Every frame is one msgpack map (data only: msgpack builds no objects, so a frame cannot run
code the way a pickle can) with a ``kind`` and exactly the fields :data:`SCHEMA` lists for
it, each type-checked on decode; anything else is a :class:`WireError` naming the field. The
sockets refuse a frame over :data:`MAX_FRAME_BYTES` before allocating it (``zmq.MAXMSGSIZE``,
:mod:`.hub`). :class:`~reco_megatron.rollout.requests.SamplingParams` and
:class:`~reco_megatron.rollout.requests.Completion` travel as maps of their fields and are
rebuilt (and validated) on the other side; floats travel as float64, so log-probs arrive bit
for bit.

Kinds: the worker's ``hello`` (its id, pid, CUDA, the run id), ``ready``, ``heartbeat``,
``result``, ``error``, ``hung``, ``received``; the trainer's ``welcome`` / ``refused`` (the
answer to a hello, with the reason), ``setup``, ``generate``, ``weights``, ``ping``, ``stop``.

Multi-turn episodes (``rollout.env``) add three optional fields, each bounded in size (strings,
lists, numbers) besides its type: ``setup.env`` the environment settings
(:class:`reco_megatron.envs.EnvSettings`' fields), ``generate.rows`` the dataset record of each
prompt when its responses are episodes (None: single-turn), and ``result.episodes`` per group
the prompt the environment chose, the per-turn rewards and failures of each episode and the
group's ``env_*`` counters (turns, tool calls, errors, timeouts, ...); the episodes' token ids,
log-probs and loss masks travel in ``completions`` (a loss mask is then required).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable
from typing import Any

import msgpack
import torch

from reco_megatron.rollout.requests import Completion, SamplingParams

MAX_FRAME_BYTES = 256 * 2**20
"""The largest control frame (a step's results: token ids and log-probs of every response)."""
_MAX_DEPTH = 16


class WireError(ValueError):
    """A frame that is not one of :data:`SCHEMA`'s; says which field and why."""


Check = Callable[[Any, str], Any]


def _int(v: Any, f: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise WireError(f"{f} must be an integer, got {type(v).__name__}")
    return v


def _num(v: Any, f: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise WireError(f"{f} must be a number, got {type(v).__name__}")
    return float(v)


def _str(v: Any, f: str) -> str:
    if not isinstance(v, str):
        raise WireError(f"{f} must be a string, got {type(v).__name__}")
    return v


def _bool(v: Any, f: str) -> bool:
    if not isinstance(v, bool):
        raise WireError(f"{f} must be a boolean, got {type(v).__name__}")
    return v


def _bytes(v: Any, f: str) -> bytes:
    if not isinstance(v, bytes):
        raise WireError(f"{f} must be bytes, got {type(v).__name__}")
    return v


def _opt(check: Check) -> Check:
    return lambda v, f: None if v is None else check(v, f)


def _list(check: Check) -> Check:
    def run(v: Any, f: str) -> list[Any]:
        if not isinstance(v, list):
            raise WireError(f"{f} must be a list, got {type(v).__name__}")
        return [check(x, f"{f}[{i}]") for i, x in enumerate(v)]

    return run


def _ints(v: Any, f: str) -> list[int]:
    if not isinstance(v, list) or not all(type(x) is int for x in v):
        raise WireError(f"{f} must be a list of integers")
    return v


def _floats(v: Any, f: str) -> list[float]:
    if not isinstance(v, list) or not all(type(x) is float for x in v):
        raise WireError(f"{f} must be a list of floats")
    return v


def _plain(v: Any, f: str, depth: int = 0) -> Any:
    """Plain data (None, bool, int, float, str, lists, maps with string keys)."""
    if depth > _MAX_DEPTH:
        raise WireError(f"{f} is nested deeper than {_MAX_DEPTH}")
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, list):
        return [_plain(x, f, depth + 1) for x in v]
    if isinstance(v, dict):
        for k in v:
            _str(k, f"{f} key")
        return {k: _plain(x, f"{f}.{k}", depth + 1) for k, x in v.items()}
    raise WireError(f"{f} holds a {type(v).__name__}, not plain data")


def _text(limit: int) -> Check:
    def run(v: Any, f: str) -> str:
        if len(_str(v, f)) > limit:
            raise WireError(f"{f} holds {len(v)} characters, over the bound of {limit}")
        return v

    return run


def _bounded(check: Check, limit: int) -> Check:
    def run(v: Any, f: str) -> list[Any]:
        if isinstance(v, list) and len(v) > limit:
            raise WireError(f"{f} holds {len(v)} items, over the bound of {limit}")
        return check(v, f)

    return run


def _whole(low: int, high: int) -> Check:
    def run(v: Any, f: str) -> int:
        if not low <= _int(v, f) <= high:
            raise WireError(f"{f} must be in [{low}, {high}], got {v}")
        return v

    return run


def _real(low: float, high: float) -> Check:
    """A finite number in ``(low, high]``."""

    def run(v: Any, f: str) -> float:
        x = _num(v, f)
        if not low < x <= high:
            raise WireError(f"{f} must be in ({low:g}, {high:g}], got {v!r}")
        return x

    return run


def _token_ids(limit: int) -> Check:
    def run(v: Any, f: str) -> list[int]:
        ids = _bounded(_ints, limit)(v, f)
        if any(not 0 <= x < 2**31 for x in ids):
            raise WireError(f"{f} holds a token id outside [0, 2**31)")
        return ids

    return run


def _finite(v: Any, f: str) -> float:
    x = _num(v, f)
    if not math.isfinite(x):
        raise WireError(f"{f} must be finite, got {x!r}")
    return x


def _map(v: Any, f: str) -> dict[str, Any]:
    if not isinstance(v, dict):
        raise WireError(f"{f} must be a map, got {type(v).__name__}")
    return _plain(v, f)


_SAMPLING_FIELDS = {
    "temperature": _num, "top_p": _num, "top_k": _int, "max_new_tokens": _int,
    "seed": _opt(_int), "stop_token_ids": _ints,
}  # fmt: skip
_TENSOR_DTYPES = {"int16": torch.int16, "int32": torch.int32, "int64": torch.int64}


def _sampling(v: Any, f: str) -> SamplingParams:
    kw = _fields(v, f, _SAMPLING_FIELDS)
    kw["stop_token_ids"] = tuple(kw["stop_token_ids"])
    try:
        return SamplingParams(**kw)
    except ValueError as exc:
        raise WireError(f"{f}: {exc}") from None


def _tensor(v: Any, f: str) -> torch.Tensor:
    kw = _fields(v, f, {"dtype": _str, "shape": _ints, "data": _bytes})
    dtype = _TENSOR_DTYPES.get(kw["dtype"])
    if dtype is None or any(d < 0 for d in kw["shape"]):
        raise WireError(f"{f}: dtype {kw['dtype']!r} / shape {kw['shape']} not allowed")
    numel = 1
    for d in kw["shape"]:
        numel *= d
    if numel * dtype.itemsize != len(kw["data"]):
        raise WireError(f"{f}: {len(kw['data'])} bytes for shape {kw['shape']} {kw['dtype']}")
    return torch.frombuffer(bytearray(kw["data"]), dtype=dtype).reshape(kw["shape"])


_COMPLETION_FIELDS = {
    "prompt_index": _int, "sample_index": _int, "token_ids": _ints, "logprobs": _floats,
    "finish_reason": _str, "routed_experts": _opt(_tensor), "loss_mask": _opt(_ints),
}  # fmt: skip


def _completion(v: Any, f: str) -> Completion:
    try:
        return Completion(**_fields(v, f, _COMPLETION_FIELDS))
    except ValueError as exc:
        raise WireError(f"{f}: {exc}") from None


MAX_TEXT_CHARS = 1 << 20
"""The longest prompt or answer text in a ``generate.rows`` record."""
MAX_IDS = 1 << 20
"""The most token ids in one list (a prompt, an episode)."""
MAX_ROWS = 1 << 16
"""The most prompts (groups) in one request or result, and responses in one group."""
MAX_COUNTERS = 64
_COUNTER = re.compile(r"env_[a-z0-9_]{1,60}")

_ROW_FIELDS = {
    "prompt": _text(MAX_TEXT_CHARS), "answer": _text(MAX_TEXT_CHARS),
    "prompt_ids": _token_ids(MAX_IDS),
}  # fmt: skip
ENV_FIELDS: dict[str, Check] = {
    "env": _text(4096), "max_turns": _whole(1, 1 << 16), "env_workers": _whole(1, 4096),
    "step_timeout_s": _real(0, 1e7), "turn_discount": _real(0, 1),
    "memory_limit_mb": _opt(_whole(1, 1 << 30)), "tokenizer": _text(4096),
    "vocab_size": _opt(_whole(1, 2**31 - 1)),
}  # fmt: skip
"""``setup.env``: :class:`reco_megatron.envs.EnvSettings`' fields (its ``__post_init__``
checks them again on the worker)."""


def _counters(v: Any, f: str) -> dict[str, float]:
    if not isinstance(v, dict) or len(v) > MAX_COUNTERS:
        raise WireError(f"{f} must be a map of at most {MAX_COUNTERS} env_* counters")
    for k, x in v.items():
        if not isinstance(k, str) or not _COUNTER.fullmatch(k):
            raise WireError(f"{f}: {str(k)[:80]!r} is not an env_* counter name")
        if _finite(x, f"{f}.{k}") < 0:
            raise WireError(f"{f}.{k} must be >= 0, got {x!r}")
    return {k: float(x) for k, x in v.items()}


_EPISODE_FIELDS = {
    "prompt": _token_ids(MAX_IDS),
    "turn_rewards": _bounded(_list(_finite), MAX_ROWS),
    "failed": _bounded(_list(_bool), MAX_ROWS),
    "metrics": _counters,
}  # fmt: skip


def _record(spec: dict[str, Check]) -> Check:
    return lambda v, f: _fields(v, f, spec)


SCHEMA: dict[str, dict[str, Check]] = {
    # worker -> trainer
    "hello": {"worker": _int, "pid": _int, "cuda": _bool, "run_id": _str},
    "ready": {"worker": _int, "plan_digest": _str},
    "heartbeat": {"version": _opt(_int)},
    "result": {
        "request": _int,
        "version": _opt(_int),
        "generate_s": _num,
        "idle_s": _num,
        "completions": _bounded(_list(_bounded(_list(_completion), MAX_ROWS)), MAX_ROWS),
        "episodes": _opt(_bounded(_list(_record(_EPISODE_FIELDS)), MAX_ROWS)),
    },
    "error": {"request": _opt(_int), "message": _str},
    "hung": {"why": _str},
    "received": {"version": _int, "s": _num, "plan_digest": _str},
    # trainer -> worker
    "welcome": {},
    "refused": {"why": _str},
    "setup": {
        "engine": _map,
        "plan": _map,
        "expected": _map,
        "store_path": _str,
        "group_prefix": _str,
        "backend": _str,
        "transport_device": _str,
        "timeout_s": _num,
        "receive_timeout_s": _num,
        "heartbeat_s": _num,
        "generate_timeout_s": _num,
        "worker_token": _bytes,
        "trainer_token": _bytes,
        "plan_digest": _str,
        "env": _opt(_record(ENV_FIELDS)),
    },
    "generate": {
        "id": _int,
        "prompts": _list(_ints),
        "n": _int,
        "min_version": _int,
        "sampling": _list(_sampling),
        "rows": _opt(_bounded(_list(_record(_ROW_FIELDS)), MAX_ROWS)),
    },
    "weights": {"version": _int, "plan_digest": _str},
    "ping": {},
    "stop": {},
}


def _fields(v: Any, f: str, spec: dict[str, Check]) -> dict[str, Any]:
    if not isinstance(v, dict):
        raise WireError(f"{f} must be a map, got {type(v).__name__}")
    if set(v) != set(spec):
        missing, extra = sorted(set(spec) - set(v)), sorted(set(v) - set(spec), key=str)
        parts = [f"missing fields {missing}"] * bool(missing)
        parts += [f"unexpected fields {extra}"] * bool(extra)
        raise WireError(f"{f}: {', '.join(parts)}")
    return {name: check(v[name], f"{f}.{name}") for name, check in spec.items()}


def _encode_value(v: Any) -> Any:
    if isinstance(v, SamplingParams):
        return {k.name: _encode_value(getattr(v, k.name)) for k in dataclasses.fields(v)}
    if isinstance(v, Completion):
        return {k.name: _encode_value(getattr(v, k.name)) for k in dataclasses.fields(v)}
    if isinstance(v, torch.Tensor):
        t = v.detach().cpu().contiguous()
        name = str(t.dtype).removeprefix("torch.")
        return {"dtype": name, "shape": list(t.shape), "data": t.numpy().tobytes()}
    if isinstance(v, tuple):
        return [_encode_value(x) for x in v]
    return v


def encode(msg: dict[str, Any]) -> bytes:
    """One frame: ``msg`` checked against :data:`SCHEMA` (so a bug fails here, at the sender)
    and packed."""
    kind = msg.get("kind")
    body = {k: v for k, v in msg.items() if k != "kind" and not k.startswith("_")}
    if not isinstance(kind, str) or kind not in SCHEMA:
        raise WireError(f"cannot send a frame of kind {kind!r}")
    body = {k: _encode_value(v) for k, v in body.items()}
    if kind in ("generate", "result"):
        key = "sampling" if kind == "generate" else "completions"
        body[key] = [
            [_encode_value(c) for c in x] if isinstance(x, list) else _encode_value(x)
            for x in body[key]
        ]
    frame = msgpack.packb({"kind": kind, **body}, use_bin_type=True)
    decode(frame)  # the schema holds for what leaves, not only for what arrives
    return frame


def decode(frame: bytes) -> dict[str, Any]:
    """The message in ``frame``, type-checked; :class:`WireError` for anything else."""
    if len(frame) > MAX_FRAME_BYTES:
        raise WireError(f"frame of {len(frame)} bytes is over {MAX_FRAME_BYTES}")
    try:
        data = msgpack.unpackb(frame, raw=False, strict_map_key=True, use_list=True)
    except Exception as exc:  # msgpack raises several kinds for bad input
        raise WireError(f"not a msgpack frame ({type(exc).__name__}: {exc})") from None
    if not isinstance(data, dict):
        raise WireError(f"a frame must be a map, got {type(data).__name__}")
    kind = data.pop("kind", None)
    if not isinstance(kind, str) or kind not in SCHEMA:
        raise WireError(f"unknown frame kind {kind!r}")
    msg = {"kind": kind, **_fields(data, kind, SCHEMA[kind])}
    if kind == "generate" and msg["rows"] is not None:
        _check_rows(msg)
    if kind == "result" and msg["episodes"] is not None:
        _check_episodes(msg)
    return msg


def _check_rows(msg: dict[str, Any]) -> None:
    """Episodes: one record per prompt, holding that prompt."""
    if len(msg["rows"]) != len(msg["prompts"]):
        raise WireError(
            f"generate.rows: {len(msg['rows'])} records for {len(msg['prompts'])} prompts"
        )
    for i, (row, ids) in enumerate(zip(msg["rows"], msg["prompts"], strict=True)):
        if row["prompt_ids"] != ids:
            raise WireError(f"generate.rows[{i}].prompt_ids is not generate.prompts[{i}]")


def _check_episodes(msg: dict[str, Any]) -> None:
    """Episodes: one record per group, one reward and failure per episode, loss masks."""
    groups, episodes = msg["completions"], msg["episodes"]
    if len(episodes) != len(groups):
        raise WireError(f"result.episodes: {len(episodes)} records for {len(groups)} groups")
    for g, (group, ep) in enumerate(zip(groups, episodes, strict=True)):
        for name in ("turn_rewards", "failed"):
            if len(ep[name]) != len(group):
                raise WireError(
                    f"result.episodes[{g}].{name}: {len(ep[name])} values for {len(group)} episodes"
                )
        if any(c.loss_mask is None for c in group):
            raise WireError(f"result.completions[{g}]: an episode without its loss mask")
