"""Episodes on real engines: a one-turn episode is the single-turn call, token for token; the
log-probs of later turns are the policy's given the whole context (observations included);
the megatron engine and the embedded engine on the same weights give the same episodes."""

from __future__ import annotations

import pytest
import torch

from reco_megatron.envs import EnvPool, run_episodes
from reco_megatron.rollout import SamplingParams
from reco_megatron.trainer.orchestration import completions_batch

pytest.importorskip("transformers", reason="the embedded engine needs transformers")

from reco_megatron.rollout import EmbeddedEngine
from tests.rollout._tiny import TINY_LLAMA, teacher_forced_logprobs, tiny_model

PROMPTS = [[5, 17, 3], [9, 1, 44, 12, 7]]
ROWS = [{"prompt": "", "answer": "", "prompt_ids": p} for p in PROMPTS]
N = 3


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=0)


def _engine(model) -> EmbeddedEngine:
    eng = EmbeddedEngine(TINY_LLAMA)
    eng.update_weights(model.state_dict().items())
    return eng


def _params(budget: int = 16) -> list[SamplingParams]:
    return [
        SamplingParams(temperature=1.0, max_new_tokens=budget, seed=7 + i, stop_token_ids=(2,))
        for i in range(len(PROMPTS))
    ]


def test_a_one_turn_episode_is_the_single_turn_call_token_for_token(model) -> None:
    plain = _engine(model).generate(PROMPTS, N, _params())
    with EnvPool("tests.envs._envs:OneTurn", num_workers=1) as pool:
        got = run_episodes(_engine(model).generate, pool, ROWS, N, _params(), max_turns=8)
    assert got.prompts == PROMPTS
    flat_a = [c for g in plain for c in g]
    flat_b = [c for g in got.completions for c in g]
    for a, b in zip(flat_a, flat_b, strict=True):
        assert (a.token_ids, a.logprobs, a.finish_reason) == (
            b.token_ids,
            b.logprobs,
            b.finish_reason,
        )
        assert b.loss_mask == [1] * len(b.token_ids)
    adv = torch.randn(len(flat_a))
    batch_a = completions_batch(PROMPTS, flat_a, adv, N, pad_id=0)
    batch_b = completions_batch(got.prompts, flat_b, adv, N, pad_id=0)
    for name in ("tokens", "response_mask", "rollout_logprobs"):
        assert torch.equal(getattr(batch_a, name), getattr(batch_b, name)), name


def test_later_turns_report_the_policys_logprobs_given_the_observations(model) -> None:
    with EnvPool("tests.envs._envs:Echo", num_workers=2) as pool:
        got = run_episodes(_engine(model).generate, pool, ROWS, N, _params(24), max_turns=4)
    checked = 0
    for g, group in enumerate(got.completions):
        for c in group:
            ref = teacher_forced_logprobs(model, PROMPTS[g], c.token_ids, 1.0)
            mask = torch.tensor(c.loss_mask, dtype=torch.bool)
            gap = (torch.tensor(c.logprobs) - ref)[mask].abs().max()
            assert gap < 1e-5, gap
            checked += int(mask.sum())
            # token ids end to end: the batch row is the prompt and the episode, verbatim
            batch = completions_batch([PROMPTS[g]], [c] * 2, torch.zeros(2), 2, pad_id=0)
            row = batch.tokens[0, : len(PROMPTS[g]) + len(c.token_ids)].tolist()
            assert row == PROMPTS[g] + c.token_ids
            assert batch.response_mask[0, len(PROMPTS[g]) :].sum() == sum(c.loss_mask)
    assert got.metrics["env_tool_calls_sum"] > 0 and checked > 0


@pytest.mark.dist
def test_the_megatron_and_embedded_engines_give_the_same_episodes() -> None:
    from reco_megatron.testing import run_distributed
    from tests.envs._engine_bodies import episodes_versus_embedded_body

    ((same, masks, gap, tokens),) = run_distributed(
        episodes_versus_embedded_body, 1, args=(1,), timeout=240
    )
    assert same and masks and tokens > 0
    assert gap < 1e-5


@pytest.mark.dist
def test_a_model_parallel_group_shares_one_pool_and_agrees() -> None:
    """Environments run on the group's first rank only; every rank drives the same episodes
    and makes the same engine calls, failures and timeouts included (no rank waits alone)."""
    from reco_megatron.testing import run_distributed
    from tests.envs._engine_bodies import shared_pool_body

    first, second = run_distributed(shared_pool_body, 2, timeout=240)
    assert first == second
    assert first[1] == [[True], [True], [False]]  # the raising and the hanging environment
    assert first[2]["env_timeout_sum"] == 1 and first[2]["env_error_sum"] == 1
