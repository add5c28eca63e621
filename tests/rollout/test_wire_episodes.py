"""Multi-turn episodes on the control channel: ``setup.env``, ``generate.rows`` and
``result.episodes`` round-trip exactly (token ids, loss masks, per-turn rewards, counters),
single-turn frames carry None, and a hostile or oversized field is a :class:`WireError`
naming it, at the receiver (a forged frame) and at the sender (a bug)."""

from __future__ import annotations

import dataclasses

import msgpack
import pytest

from reco_megatron.envs import EnvSettings
from reco_megatron.rollout import Completion, SamplingParams
from reco_megatron.rollout.wire import (
    ENV_FIELDS,
    MAX_IDS,
    MAX_ROWS,
    MAX_TEXT_CHARS,
    WireError,
    decode,
    encode,
)

ENV = EnvSettings(env="calculator", max_turns=6, env_workers=2, step_timeout_s=10.0,
                  turn_discount=0.9, memory_limit_mb=4096, tokenizer="tok.model",
                  vocab_size=128)  # fmt: skip
SETUP = {
    "kind": "setup", "engine": {"kind": "embedded"}, "plan": {}, "expected": {},
    "store_path": "/tmp/s", "group_prefix": "g", "backend": "gloo", "transport_device": "cpu",
    "timeout_s": 60.0, "receive_timeout_s": 120.0, "heartbeat_s": 5.0,
    "generate_timeout_s": 3600.0, "worker_token": b"w" * 16, "trainer_token": b"t" * 16,
    "plan_digest": "d", "env": ENV.to_wire(),
}  # fmt: skip
ROWS = [{"prompt": "2 3 4 -> 9", "answer": "9", "prompt_ids": [4, 5, 6]},
        {"prompt": "ü 1", "answer": "", "prompt_ids": [7]}]  # fmt: skip
GENERATE = {
    "kind": "generate", "id": 3, "prompts": [[4, 5, 6], [7]], "n": 2, "min_version": 1,
    "sampling": [SamplingParams(seed=1), SamplingParams(seed=2)], "rows": ROWS,
}  # fmt: skip


def _episode(g: int, j: int) -> Completion:
    return Completion(prompt_index=g, sample_index=j, token_ids=[20, 21, 7, 8, 9, 22],
                      logprobs=[-0.5, -1 / 3, 0.0, 0.0, 0.0, -0.25], finish_reason="stop",
                      loss_mask=[1, 1, 0, 0, 0, 1])  # fmt: skip


COUNTERS = {"env_episodes": 2.0, "env_turns_sum": 5.0, "env_tool_calls_sum": 3.0,
            "env_error_sum": 1.0, "env_timeout_sum": 0.0}  # fmt: skip
RESULT = {
    "kind": "result", "request": 3, "version": 1, "generate_s": 0.5, "idle_s": 0.0,
    "completions": [[_episode(g, j) for j in range(2)] for g in range(2)],
    "episodes": [
        {"prompt": [4, 5, 6], "turn_rewards": [1.5, 0.1 / 3], "failed": [False, True],
         "metrics": COUNTERS},
        {"prompt": [7], "turn_rewards": [0.0, 0.0], "failed": [False, False],
         "metrics": {**COUNTERS, "env_episodes": 2.0}},
    ],
}  # fmt: skip


def test_the_wire_knows_every_env_setting() -> None:
    assert set(ENV_FIELDS) == {f.name for f in dataclasses.fields(EnvSettings)}


def test_episode_frames_round_trip_exactly() -> None:
    setup = decode(encode(SETUP))
    assert EnvSettings.from_wire(setup["env"]) == ENV
    assert decode(encode(GENERATE)) == GENERATE
    back = decode(encode(RESULT))
    assert back["episodes"] == RESULT["episodes"]  # rewards bit for bit (float64)
    for got, want in zip(back["completions"], RESULT["completions"], strict=True):
        for a, b in zip(got, want, strict=True):
            assert (a.token_ids, a.loss_mask, a.logprobs) == (b.token_ids, b.loss_mask, b.logprobs)


def test_single_turn_frames_carry_none() -> None:
    for msg, field in ((SETUP, "env"), (GENERATE, "rows"), (RESULT, "episodes")):
        assert decode(encode({**msg, field: None}))[field] is None


def _forged(msg: dict, **change) -> bytes:
    """``msg`` with ``change`` packed as a hostile sender would (no schema check)."""
    body = {**msg, **change}
    plain = {
        k: (
            [[{f.name: getattr(c, f.name) for f in dataclasses.fields(c)} for c in g] for g in v]
            if k == "completions"
            else [dataclasses.asdict(s) for s in v]
            if k == "sampling"
            else v
        )
        for k, v in body.items()
    }
    for s in plain.get("sampling", []):
        s["stop_token_ids"] = list(s["stop_token_ids"])
    return msgpack.packb(plain, use_bin_type=True)


def _ep(**change) -> list[dict]:
    return [{**RESULT["episodes"][0], **change}, RESULT["episodes"][1]]


def _rows(**change) -> list[dict]:
    return [{**ROWS[0], **change}, ROWS[1]]


HOSTILE = [
    # setup.env
    (SETUP, {"env": {**ENV.to_wire(), "max_turns": 0}}, "setup.env.max_turns must be in [1,"),
    (SETUP, {"env": {**ENV.to_wire(), "env_workers": 10**6}}, "env_workers must be in [1, 4096]"),
    (SETUP, {"env": {**ENV.to_wire(), "turn_discount": 2.0}}, "turn_discount must be in (0, 1]"),
    (SETUP, {"env": {**ENV.to_wire(), "step_timeout_s": float("nan")}}, "step_timeout_s must"),
    (SETUP, {"env": {**ENV.to_wire(), "env": "x" * 5000}}, "setup.env.env holds 5000 characters"),
    (SETUP, {"env": {**ENV.to_wire(), "python": "os:system"}}, "unexpected fields ['python']"),
    (SETUP, {"env": "calculator"}, "setup.env must be a map"),
    # generate.rows
    (GENERATE, {"rows": _rows(prompt="x" * (MAX_TEXT_CHARS + 1))}, "generate.rows[0].prompt holds"),
    (GENERATE, {"rows": _rows(prompt_ids=[4, 5, -6])}, "token id outside [0, 2**31)"),
    (GENERATE, {"rows": _rows(prompt_ids=[4, 5, 2**40])}, "token id outside [0, 2**31)"),
    (GENERATE, {"rows": _rows(answer=9)}, "generate.rows[0].answer must be a string"),
    (GENERATE, {"rows": _rows(extra=1)}, "unexpected fields ['extra']"),
    (GENERATE, {"rows": ROWS[:1]}, "generate.rows: 1 records for 2 prompts"),
    (GENERATE, {"rows": _rows(prompt_ids=[4, 5])}, "rows[0].prompt_ids is not generate.prompts[0]"),
    (GENERATE, {"rows": [ROWS[0]] * (MAX_ROWS + 1)}, f"over the bound of {MAX_ROWS}"),
    # result.episodes
    (RESULT, {"episodes": _ep(prompt=[0] * (MAX_IDS + 1))}, f"over the bound of {MAX_IDS}"),
    (RESULT, {"episodes": _ep(turn_rewards=[1.0])}, "turn_rewards: 1 values for 2 episodes"),
    (RESULT, {"episodes": _ep(turn_rewards=[1.0, float("inf")])}, "must be finite"),
    (RESULT, {"episodes": _ep(turn_rewards=[1.0, "2"])}, "turn_rewards[1] must be a number"),
    (RESULT, {"episodes": _ep(failed=[0, 1])}, "failed[0] must be a boolean"),
    (RESULT, {"episodes": _ep(metrics={"loss": 1.0})}, "'loss' is not an env_* counter name"),
    (RESULT, {"episodes": _ep(metrics={"env_turns_sum": -1.0})}, "must be >= 0"),
    (RESULT, {"episodes": _ep(metrics={f"env_{i}": 0.0 for i in range(65)})}, "at most 64"),
    (RESULT, {"episodes": RESULT["episodes"][:1]}, "result.episodes: 1 records for 2 groups"),
]  # fmt: skip


@pytest.mark.parametrize(("msg", "change", "needle"), HOSTILE)
def test_a_hostile_or_oversized_field_is_refused_naming_it(msg, change, needle) -> None:
    with pytest.raises(WireError) as info:
        decode(_forged(msg, **change))
    assert needle in str(info.value)
    with pytest.raises(WireError):  # and a sender with that bug fails before it sends
        encode({**msg, **change})


def test_an_episode_without_its_loss_mask_is_refused() -> None:
    bare = dataclasses.replace(_episode(0, 0), loss_mask=None)
    completions = [[bare, _episode(0, 1)], RESULT["completions"][1]]
    with pytest.raises(WireError, match=r"an episode without its loss mask"):
        decode(_forged(RESULT, completions=completions))
