"""The episode service a separate rollout worker runs: its settings travel as a plain map and
come back equal (bad ones refused naming the field), its groups are those of
:func:`run_episodes` on the same pool settings, its per-group counters add up to the step's,
and closing it stops the environment workers."""

from __future__ import annotations

import dataclasses

import psutil
import pytest

from reco_megatron.envs import EnvPool, EnvSettings, EpisodeService, run_episodes
from reco_megatron.rollout import SamplingParams
from tests.envs._fake_engine import ScriptedEngine

SETTINGS = EnvSettings(
    env="tests.envs._envs:Echo", max_turns=4, env_workers=2, step_timeout_s=10.0,
    turn_discount=0.5, memory_limit_mb=None,
)  # fmt: skip
ROWS = [{"prompt": "p", "answer": "0", "prompt_ids": [f, 30, 31]} for f in (11, 12, 13)]
PARAMS = [SamplingParams(max_new_tokens=40, seed=7 + i, stop_token_ids=(2,)) for i in range(3)]


def test_settings_round_trip_as_a_plain_map() -> None:
    wire = SETTINGS.to_wire()
    assert all(isinstance(v, (str, int, float, type(None))) for v in wire.values())
    assert EnvSettings.from_wire(wire) == SETTINGS


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"max_turns": 0}, "max_turns must be an integer >= 1, got 0"),
        ({"env_workers": True}, "env_workers must be an integer >= 1, got True"),
        ({"step_timeout_s": -1.0}, "step_timeout_s must be seconds > 0, got -1.0"),
        ({"step_timeout_s": float("inf")}, "step_timeout_s must be seconds > 0"),
        ({"turn_discount": 1.5}, "turn_discount must be in (0, 1], got 1.5"),
        ({"env": ""}, "env must name an environment"),
        ({"vocab_size": 0}, "vocab_size must be an integer >= 1"),
    ],
)
def test_bad_settings_are_refused_naming_the_field(change: dict, needle: str) -> None:
    with pytest.raises(ValueError) as info:
        EnvSettings.from_wire({**SETTINGS.to_wire(), **change})
    assert needle in str(info.value)


def test_unknown_or_missing_fields_are_refused() -> None:
    with pytest.raises(ValueError, match="not the expected"):
        EnvSettings.from_wire({**SETTINGS.to_wire(), "python_path": "/tmp"})
    wire = SETTINGS.to_wire()
    del wire["tokenizer"]
    with pytest.raises(ValueError, match="not the expected"):
        EnvSettings.from_wire(wire)


def _key(result) -> list:
    return [
        [(c.token_ids, c.loss_mask, c.logprobs, c.finish_reason) for c in g]
        for g in result.completions
    ]


def test_the_service_runs_the_groups_run_episodes_runs() -> None:
    with EnvPool(SETTINGS.env, num_workers=2, step_timeout_s=10.0, memory_limit_mb=None) as pool:
        want = run_episodes(
            ScriptedEngine().generate, pool, ROWS, 2, PARAMS, max_turns=4, turn_discount=0.5
        )
    service = EpisodeService(dataclasses.replace(SETTINGS))
    try:
        keepers = [psutil.Process(w.proc.pid) for w in service.pool._workers]  # type: ignore[attr-defined]
        first = service.run(ScriptedEngine().generate, ROWS, 2, PARAMS)
        again = service.run(ScriptedEngine().generate, ROWS[:1], 2, PARAMS[:1])
        assert service.next_id == 8  # episode ids never repeat while the pool lives
    finally:
        service.close()
    assert _key(first) == _key(want)
    assert first.prompts == want.prompts and first.turn_rewards == want.turn_rewards
    assert first.turn_rewards == [[1.75] * 2] * 3  # three turns, rewards 1 + 0.5 + 0.25
    assert first.failed == want.failed and first.metrics == want.metrics
    assert _key(again) == _key(want)[:1]
    assert len(first.group_metrics) == 3
    for name, total in first.metrics.items():
        assert sum(g[name] for g in first.group_metrics) == total, name
    assert first.group_metrics[0]["env_episodes"] == 2.0
    _, alive = psutil.wait_procs(keepers, timeout=10)
    assert not alive, f"environment workers outlived close(): {alive}"
