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
import re
from typing import Any

import msgpack
import torch

from reco_megatron.rollout import wire_checks as wc
from reco_megatron.rollout.requests import Completion, SamplingParams
from reco_megatron.rollout.wire_checks import Check, WireError

MAX_FRAME_BYTES = 256 * 2**20
"""The largest control frame (a step's results: token ids and log-probs of every response)."""
_SAMPLING_FIELDS = {
    "temperature": wc.number, "top_p": wc.number, "top_k": wc.integer, "max_new_tokens": wc.integer,
    "seed": wc.optional(wc.integer), "stop_token_ids": wc.ints,
}  # fmt: skip
_TENSOR_DTYPES = {"int16": torch.int16, "int32": torch.int32, "int64": torch.int64}


def _sampling(v: Any, f: str) -> SamplingParams:
    kw = wc.fields(v, f, _SAMPLING_FIELDS)
    kw["stop_token_ids"] = tuple(kw["stop_token_ids"])
    try:
        return SamplingParams(**kw)
    except ValueError as exc:
        raise WireError(f"{f}: {exc}") from None


def _tensor(v: Any, f: str) -> torch.Tensor:
    kw = wc.fields(v, f, {"dtype": wc.string, "shape": wc.ints, "data": wc.raw_bytes})
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
    "prompt_index": wc.integer, "sample_index": wc.integer, "token_ids": wc.ints,
    "logprobs": wc.floats, "finish_reason": wc.string, "routed_experts": wc.optional(_tensor),
    "loss_mask": wc.optional(wc.ints),
}  # fmt: skip


def _completion(v: Any, f: str) -> Completion:
    try:
        return Completion(**wc.fields(v, f, _COMPLETION_FIELDS))
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
    "prompt": wc.text(MAX_TEXT_CHARS), "answer": wc.text(MAX_TEXT_CHARS),
    "prompt_ids": wc.token_ids(MAX_IDS),
}  # fmt: skip
ENV_FIELDS: dict[str, Check] = {
    "env": wc.text(4096), "max_turns": wc.whole(1, 1 << 16), "env_workers": wc.whole(1, 4096),
    "step_timeout_s": wc.real(0, 1e7), "turn_discount": wc.real(0, 1),
    "memory_limit_mb": wc.optional(wc.whole(1, 1 << 30)), "tokenizer": wc.text(4096),
    "vocab_size": wc.optional(wc.whole(1, 2**31 - 1)),
}  # fmt: skip
"""``setup.env``: :class:`reco_megatron.envs.EnvSettings`' fields (its ``__post_init__``
checks them again on the worker)."""


def _counters(v: Any, f: str) -> dict[str, float]:
    if not isinstance(v, dict) or len(v) > MAX_COUNTERS:
        raise WireError(f"{f} must be a map of at most {MAX_COUNTERS} env_* counters")
    for k, x in v.items():
        if not isinstance(k, str) or not _COUNTER.fullmatch(k):
            raise WireError(f"{f}: {str(k)[:80]!r} is not an env_* counter name")
        if wc.finite(x, f"{f}.{k}") < 0:
            raise WireError(f"{f}.{k} must be >= 0, got {x!r}")
    return {k: float(x) for k, x in v.items()}


_EPISODE_FIELDS = {
    "prompt": wc.token_ids(MAX_IDS),
    "turn_rewards": wc.bounded(wc.list_of(wc.finite), MAX_ROWS),
    "failed": wc.bounded(wc.list_of(wc.boolean), MAX_ROWS),
    "metrics": _counters,
}  # fmt: skip


SCHEMA: dict[str, dict[str, Check]] = {
    # worker -> trainer
    "hello": {"worker": wc.integer, "pid": wc.integer, "cuda": wc.boolean, "run_id": wc.string},
    "ready": {"worker": wc.integer, "plan_digest": wc.string},
    "heartbeat": {"version": wc.optional(wc.integer)},
    "result": {
        "request": wc.integer,
        "version": wc.optional(wc.integer),
        "generate_s": wc.number,
        "idle_s": wc.number,
        "completions": wc.bounded(
            wc.list_of(wc.bounded(wc.list_of(_completion), MAX_ROWS)), MAX_ROWS
        ),
        "episodes": wc.optional(wc.bounded(wc.list_of(wc.record(_EPISODE_FIELDS)), MAX_ROWS)),
    },
    "error": {"request": wc.optional(wc.integer), "message": wc.string},
    "hung": {"why": wc.string},
    "received": {"version": wc.integer, "s": wc.number, "plan_digest": wc.string},
    # trainer -> worker
    "welcome": {},
    "refused": {"why": wc.string},
    "setup": {
        "engine": wc.plain_map,
        "plan": wc.plain_map,
        "expected": wc.plain_map,
        "store_path": wc.string,
        "group_prefix": wc.string,
        "backend": wc.string,
        "transport_device": wc.string,
        "timeout_s": wc.number,
        "receive_timeout_s": wc.number,
        "heartbeat_s": wc.number,
        "generate_timeout_s": wc.number,
        "worker_token": wc.raw_bytes,
        "trainer_token": wc.raw_bytes,
        "plan_digest": wc.string,
        "env": wc.optional(wc.record(ENV_FIELDS)),
    },
    "generate": {
        "id": wc.integer,
        "prompts": wc.list_of(wc.ints),
        "n": wc.integer,
        "min_version": wc.integer,
        "sampling": wc.list_of(_sampling),
        "rows": wc.optional(wc.bounded(wc.list_of(wc.record(_ROW_FIELDS)), MAX_ROWS)),
    },
    "weights": {"version": wc.integer, "plan_digest": wc.string},
    "ping": {},
    "stop": {},
}


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
    msg = {"kind": kind, **wc.fields(data, kind, SCHEMA[kind])}
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
