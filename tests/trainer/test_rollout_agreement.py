"""Every rank of a model-parallel group trains on the first rank's tokens when engines disagree
(``reco_megatron/trainer/orchestration/agreement.py``), and nothing moves when they agree."""

from __future__ import annotations

import dataclasses

import pytest

from reco_megatron.rollout.requests import Completion
from reco_megatron.testing.multiprocess import run_distributed
from reco_megatron.trainer.orchestration import completions_fingerprint


def _completions(tokens: list[list[list[int]]], logprob: float = -1.0) -> list[list[Completion]]:
    return [
        [
            Completion(
                prompt_index=i,
                sample_index=j,
                token_ids=ids,
                logprobs=[logprob] * len(ids),
                finish_reason="stop" if ids and ids[-1] == 2 else "length",
            )
            for j, ids in enumerate(group)
        ]
        for i, group in enumerate(tokens)
    ]


BASE = [[[5, 6, 2], [7]], [[8, 9, 10, 2], []]]


def test_fingerprint_sees_tokens_finish_and_grouping_but_not_logprobs() -> None:
    ref = completions_fingerprint(_completions(BASE))
    assert ref.shape == (4,)
    assert ref.equal(completions_fingerprint(_completions(BASE, logprob=-1.5)))
    other_token = [[[5, 6, 2], [7]], [[8, 9, 11, 2], []]]
    regrouped = [[[5, 6, 2]], [[7], [8, 9, 10, 2], []]]
    split = [[[5, 6], [2, 7]], [[8, 9, 10, 2], []]]
    for tokens in (other_token, regrouped, split):
        assert not ref.equal(completions_fingerprint(_completions(tokens))), tokens
    finished = _completions(BASE)
    finished[0][1] = dataclasses.replace(finished[0][1], finish_reason="stop")
    assert not ref.equal(completions_fingerprint(finished))


def _agree_body(rank: int, world_size: int, differ: bool) -> tuple[list[list[int]], bool]:
    import torch.distributed as dist

    from reco_megatron.trainer.orchestration import agree_on_completions

    tokens = [[list(g) for g in group] for group in BASE]
    if differ and rank == 1:
        tokens[1][0] = [8, 9, 3, 3]  # this rank's engine sampled something else
    out, diverged = agree_on_completions(_completions(tokens), dist.group.WORLD)
    return [c.token_ids for group in out for c in group], diverged


@pytest.mark.dist
@pytest.mark.parametrize("differ", [False, True], ids=["agree", "differ"])
def test_ranks_train_on_the_first_ranks_tokens(differ: bool) -> None:
    results = run_distributed(_agree_body, 2, args=(differ,), timeout=120)
    expected = [ids for group in BASE for ids in group]
    for tokens, diverged in results:
        assert tokens == expected
        assert diverged is differ


def test_single_process_is_a_no_op() -> None:
    from reco_megatron.trainer.orchestration import agree_on_completions

    completions = _completions(BASE)
    assert agree_on_completions(completions, None) == (completions, False)
