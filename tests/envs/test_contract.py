"""The environment contract around the runner: specs by name, module or file, the calculator
environment, the rollout keys' checks, and rewards of episodes (per-turn, failed -> 0)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from reco_megatron.data.countdown import calculator_response
from reco_megatron.data.tokenizer import SentencePieceTokenizer
from reco_megatron.envs import EnvSpecError, Step, resolve_env
from reco_megatron.envs.calculator import CalculatorEnv
from reco_megatron.envs.contract import StepError, check_step
from reco_megatron.trainer.orchestration import StepRollout
from reco_megatron.trainer.rollout_config import RolloutConfig

TOKENIZER = "examples/tiny/countdown_sp.model"


def test_specs_by_name_module_and_file(tmp_path: Path) -> None:
    assert resolve_env("calculator") is CalculatorEnv
    assert resolve_env("tests.envs._envs:Echo").__name__ == "Echo"
    file = tmp_path / "my_env.py"
    file.write_text("class MyEnv:\n    def reset(self, row): ...\n    def step(self, a, f): ...\n")
    assert resolve_env(f"{file}:MyEnv").__name__ == "MyEnv"


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("", "built-in name"),
        ("nocolon", "neither a built-in"),
        ("no_such_module_xyz:Env", "cannot be imported"),
        ("tests.envs._envs:Missing", "is missing"),
        ("tests.envs._envs:OBS", "a list"),
        ("/nonexistent/env.py:Env", "does not exist"),
    ],
)
def test_bad_specs_fail_in_one_line_naming_the_fix(spec: str, says: str) -> None:
    with pytest.raises(EnvSpecError) as err:
        resolve_env(spec)
    assert says in str(err.value) and "\n" not in str(err.value)


def test_steps_are_checked() -> None:
    assert check_step(Step([1, 2], False, 1, (3,)), 10, 100).reward == 1.0
    for bad in (
        Step([1, 99], False),  # outside the vocabulary
        Step([1], "yes"),  # type: ignore[arg-type]
        Step([1], False, float("nan")),
        Step("text", False),  # type: ignore[arg-type]
        Step(list(range(5)), False),  # over the limit of 4
    ):
        with pytest.raises(StepError):
            check_step(bad, 10, 4)
    with pytest.raises(StepError):
        check_step([1, 2], 10, 4)


def test_the_calculator_returns_values_as_tokens_and_ends_on_the_answer() -> None:
    tok = SentencePieceTokenizer(TOKENIZER)
    env = CalculatorEnv(tok)
    env.reset({"prompt_ids": [1]})
    (equals,) = env.stop_ids
    assert tok.decode([equals]) == "="
    step = env.step(tok.encode(" <9 * 3="), "stop")
    assert not step.done and tok.decode(list(step.observation_ids)) == "27>"
    assert tok.decode(list(env.step(tok.encode("<4 + (="), "stop").observation_ids)) == "error>"
    assert env.step(tok.encode("Answer: 3 + 4"), "stop").done
    assert env.step(tok.encode("<3 * 4="), "length").done
    # the warm-up's text is exactly actions and observations, token for token
    text = calculator_response("3*(4 + 5)")
    assert text == "<4 + 5=9> <3 * 9=27> Answer: 3*(4 + 5)"
    pieces = ["<4 + 5=", "9>", " <3 * 9=", "27>", " Answer: 3*(4 + 5)"]
    assert tok.encode(text) == [t for p in pieces for t in tok.encode(p)]


@pytest.mark.parametrize(
    ("key", "value", "says"),
    [
        ("max_turns", 0, "rollout.max_turns"),
        ("env_workers", 0, "rollout.env_workers"),
        ("env_step_timeout_s", 0, "rollout.env_step_timeout_s"),
        ("turn_discount", 1.5, "rollout.turn_discount"),
        ("turn_discount", 0.0, "rollout.turn_discount"),
    ],
)
def test_rollout_keys_are_checked(key: str, value: object, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        RolloutConfig(**{key: value})


def test_separate_placement_with_an_environment_needs_a_longer_generation_bound() -> None:
    RolloutConfig(env="calculator", placement="separate")  # the workers run the episodes
    with pytest.raises(ValueError) as err:
        RolloutConfig(
            env="calculator", placement="separate", generate_timeout_s=10, env_step_timeout_s=10
        )
    assert "raise rollout.generate_timeout_s" in str(err.value) and "\n" not in str(err.value)


def test_episode_rewards_add_turn_rewards_and_zero_failed_episodes() -> None:
    got = StepRollout([0], [[1]], [[]], ["g"], turn_rewards=[[0.5, 0.0, 2.0]])
    got.failed = [[False, False, True]]
    out = got.episode_rewards(torch.tensor([1.0, 0.0, 1.0]))
    assert out.tolist() == [1.5, 0.0, 0.0]
    single = StepRollout([0], [[1]], [[]], ["g"])
    rewards = torch.tensor([1.0, 0.0])
    assert single.episode_rewards(rewards) is rewards


def test_the_evaluation_engine_runs_whole_episodes() -> None:
    """``eval.interval`` with an environment: the held-out pass@k samples episodes too."""
    from reco_megatron.config import load_config
    from reco_megatron.rollout import SamplingParams
    from reco_megatron.trainer.config import TrainConfig
    from reco_megatron.trainer.orchestration import RolloutClient
    from reco_megatron.trainer.orchestration.episodes import EpisodeDriver, EpisodeEngine
    from tests.envs._fake_engine import ScriptedEngine

    cfg = load_config(
        TrainConfig,
        "examples/calculator_cpu.yaml",
        ["rollout.env=tests.envs._envs:Echo", "rollout.env_workers=1"],
    )
    client = RolloutClient(ScriptedEngine(), SamplingParams(max_new_tokens=32))
    driver = EpisodeDriver(cfg, SentencePieceTokenizer(TOKENIZER), client)
    try:
        groups = EpisodeEngine(driver).generate([[40, 41]], 2, SamplingParams(seed=3))
    finally:
        driver.close()
    assert [len(g) for g in groups] == [2]
    assert all(c.loss_mask is not None and 0 in c.loss_mask for c in groups[0])
