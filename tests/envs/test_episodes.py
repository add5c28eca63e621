"""The episode runner on a scripted engine: observations verbatim and masked, stop ids,
max turns, the token budget, per-turn rewards, and failing environments (bounded, counted)."""

from __future__ import annotations

import itertools

import pytest

from reco_megatron.envs import EnvPool, run_episodes
from reco_megatron.rollout import SamplingParams
from tests.envs._envs import OBS
from tests.envs._fake_engine import ScriptedEngine

EOS = 2


def _rows(*firsts: int) -> list[dict]:
    return [{"prompt": "p", "answer": "0", "prompt_ids": [f, 30, 31]} for f in firsts]


def _params(rows, budget: int = 64) -> list[SamplingParams]:
    return [
        SamplingParams(max_new_tokens=budget, seed=100 + i, stop_token_ids=(EOS,))
        for i in range(len(rows))
    ]


def _run(
    spec: str, rows, *, n=2, budget=64, max_turns=8, discount=1.0, workers=2, timeout=30.0,
    overlap=None,
):  # fmt: skip
    engine = ScriptedEngine()
    with EnvPool(spec, num_workers=workers, step_timeout_s=timeout) as pool:
        result = run_episodes(
            engine.generate, pool, rows, n, _params(rows, budget),
            max_turns=max_turns, turn_discount=discount, overlap=overlap,
        )  # fmt: skip
    return engine, result


@pytest.mark.parametrize("overlap", [False, True], ids=["turn_by_turn", "overlapped"])
def test_observations_are_appended_verbatim_and_masked(overlap: bool) -> None:
    engine, result = _run("tests.envs._envs:Echo", _rows(11, 12), overlap=overlap)
    for g, group in enumerate(result.completions):
        assert result.prompts[g] == [11 + g, 30, 31]
        for c in group:
            assert c.loss_mask is not None and len(c.loss_mask) == len(c.token_ids)
            # actions (mask 1) and the observations OBS + [10 + turn] (mask 0), in order
            obs_runs, run = [], []
            for tok, m, lp in zip(c.token_ids, c.loss_mask, c.logprobs, strict=True):
                if m == 0:
                    run.append(tok)
                    assert lp == 0.0
                elif run:
                    obs_runs.append(run)
                    run = []
            assert obs_runs == [[*OBS, 11], [*OBS, 12]]
            assert c.loss_mask[-1] == 1  # an episode ends on an action
    assert result.turn_rewards == [[3.0, 3.0], [3.0, 3.0]]
    assert result.metrics["env_turns_sum"] == 12
    assert result.metrics["env_tool_calls_sum"] == 8
    assert result.metrics["env_observation_tokens_sum"] == 4 * 8
    # the first turn is the single-turn call: both prompts, n=2, the env's stop id added
    prompts, n, params = engine.calls[0]
    assert prompts == result.prompts and n == 2
    assert [p.stop_token_ids for p in params] == [(EOS, 5), (EOS, 5)]
    # later turns: one row per episode, its whole context, the step's stop ids, fresh seeds
    later = [
        (p, s)
        for prompts, n, params in engine.calls[1:]
        for p, s in zip(prompts, params, strict=False)
    ]
    assert all(n == 1 for _, n, _ in engine.calls[1:]) and len(later) == 8
    assert all(s.stop_token_ids == (EOS, 6) for _, s in later)
    assert len({s.seed for _, s in later}) == 8
    if not overlap:  # turn by turn: one call per turn with every running episode
        assert [len(prompts) for prompts, _, _ in engine.calls] == [2, 4, 4]


def test_overlapped_and_turn_by_turn_give_the_same_episodes() -> None:
    """An action's seed is (prompt seed, sample, turn): which episodes share a call does not
    matter. A slow environment (Sleepy) on some prompts makes the overlapped calls differ."""
    rows = _rows(11, 12, 13)
    for row, delay in zip(rows, ("0.3", "0", "0"), strict=True):
        row["answer"] = delay
    runs = [
        _run("tests.envs._envs:Sleepy", rows, max_turns=3, workers=3, overlap=o)
        for o in (False, True)
    ]
    (sync_engine, a), (over_engine, b) = runs
    assert [[c.token_ids for c in g] for g in a.completions] == [
        [c.token_ids for c in g] for g in b.completions
    ]
    assert [[c.loss_mask for c in g] for g in a.completions] == [
        [c.loss_mask for c in g] for g in b.completions
    ]
    assert len(over_engine.calls) > len(sync_engine.calls)  # the fast ones went ahead


def test_turn_discount_weighs_turn_k_by_gamma_to_the_k() -> None:
    _, result = _run("tests.envs._envs:Echo", _rows(11), discount=0.5)
    assert result.turn_rewards == [[1.75, 1.75]]


def test_max_turns_ends_the_episode_after_its_last_action() -> None:
    _, result = _run("tests.envs._envs:Endless", _rows(11), max_turns=2)
    for c in result.completions[0]:
        mask = c.loss_mask
        assert sum(1 for a, b in itertools.pairwise(mask) if (a, b) == (0, 1)) == 1
        assert c.loss_mask[-1] == 1
    assert result.metrics["env_max_turns_sum"] == 2
    assert result.metrics["env_turns_sum"] == 4


@pytest.mark.parametrize("budget", [5, 9, 12])
def test_the_token_budget_counts_the_whole_episode(budget: int) -> None:
    _, result = _run("tests.envs._envs:Endless", _rows(11), budget=budget, max_turns=50)
    for c in result.completions[0]:
        assert len(c.token_ids) <= budget
        assert c.finish_reason == "length"
        assert c.loss_mask[-1] == 1
    assert result.metrics["env_budget_sum"] == 2


def test_failing_environments_are_bounded_counted_and_scored_zero() -> None:
    # one episode per worker: a killed worker takes no other episode with it
    _, result = _run("tests.envs._envs:Faulty", _rows(1, 2, 3, 4, 9), n=1, workers=5, timeout=2.0)
    failed = [f[0] for f in result.failed]
    assert failed == [True, True, True, True, False]
    m = result.metrics
    assert (m["env_error_sum"], m["env_timeout_sum"], m["env_invalid_sum"]) == (1, 1, 1)
    assert m["env_crash_sum"] == 1 and m["env_failed_sum"] == 4
    assert [r[0] for r in result.turn_rewards] == [0.0, 0.0, 0.0, 0.0, 3.0]
    first = result.completions[0][0]  # raised on its second step: two actions, one observation
    assert first.loss_mask[-1] == 1 and first.loss_mask.count(0) == len(OBS)


def test_a_killed_worker_loses_the_episodes_it_held() -> None:
    _, result = _run("tests.envs._envs:Faulty", _rows(4, 9), n=1, workers=1)
    assert [f[0] for f in result.failed] == [True, True]
    assert result.metrics["env_crash_sum"] == 1 and result.metrics["env_lost_sum"] == 1
