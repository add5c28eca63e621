"""Token-budget planning (pure Python, no process group): every row exactly once, the budget
kept, the fewest micro-batches with the least padding, balanced data-parallel shares."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from reco_megatron.megatron.step.dp_balance import balanced_partition, sequence_cost
from reco_megatron.megatron.step.microbatching import (
    MicroBatchPlan,
    budget_plan,
    fixed_plan,
    length_multiple,
    needed_lengths,
    packed_plan,
    round_up,
    scatter_rows,
    split_to,
    take_rows,
)
from reco_megatron.parallel.batch import RolloutBatch


def _long_tailed(n: int, seed: int = 0, low: int = 4, high: int = 300) -> list[int]:
    rng = random.Random(seed)
    return [min(high, max(low, int(rng.lognormvariate(3.5, 1.0)))) for _ in range(n)]


def _check(plan: MicroBatchPlan, needed: list[int], budget: int, multiple: int) -> None:
    assert sorted(r for mb in plan.rows for r in mb) == list(range(len(needed)))
    for i, (rows, length) in enumerate(zip(plan.rows, plan.lengths, strict=True)):
        assert length % multiple == 0
        assert length >= max(needed[r] for r in rows)
        assert plan.tokens(i) <= budget


def test_needed_lengths_are_the_last_scored_position_plus_one() -> None:
    mask = torch.zeros(3, 8)
    mask[0, 2:5] = 1  # response labels at 2..4: positions 0..4 are needed
    mask[1, 7] = 1
    assert needed_lengths(mask) == [5, 8, 1]  # an empty response still needs one position


def test_fixed_plan_is_todays_split() -> None:
    plan = fixed_plan([3, 9, 2, 7], seq_length=9, micro_batch_size=2)
    assert plan.rows == ((0, 1), (2, 3)) and plan.lengths == (9, 9)
    assert plan.computed_tokens == 36 and plan.real_tokens == 21
    with pytest.raises(ValueError, match="micro_batch_size"):
        fixed_plan([1, 2, 3], 3, 2)


@pytest.mark.parametrize("seed", range(5))
def test_budget_plan_keeps_the_budget_and_covers_every_row_once(seed: int) -> None:
    needed = _long_tailed(97, seed)
    plan = budget_plan(needed, max_tokens=640, multiple=8)
    _check(plan, needed, 640, 8)
    fixed = fixed_plan(needed, round_up(max(needed), 8), 1)
    assert plan.pad_frac < 0.25 < 0.75 < fixed.pad_frac


def _brute_force(needed: list[int], budget: int, multiple: int, charge: float) -> float:
    """The least computed tokens + ``charge`` per micro-batch over every partition."""
    best = float("inf")
    n = len(needed)
    for labels in itertools.product(range(n), repeat=n):
        if any(labels[i] > max(labels[:i], default=-1) + 1 for i in range(n)):
            continue  # canonical labelling only
        groups: dict[int, list[int]] = {}
        for i, g in enumerate(labels):
            groups.setdefault(g, []).append(i)
        costs = [len(g) * round_up(max(needed[i] for i in g), multiple) for g in groups.values()]
        if max(costs) <= budget:
            best = min(best, sum(costs) + charge * len(groups))
    return best


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("overhead", [0.0, 1 / 16, 1.0])
def test_budget_plan_is_optimal_on_small_cases(seed: int, overhead: float) -> None:
    rng = random.Random(seed)
    needed = [rng.randint(1, 20) for _ in range(6)]
    budget = rng.choice([24, 32, 48])
    plan = budget_plan(needed, budget, multiple=4, overhead=overhead)
    got = plan.computed_tokens + overhead * budget * plan.num_microbatches
    assert got == pytest.approx(_brute_force(needed, budget, 4, overhead * budget))


def test_a_row_longer_than_the_budget_is_an_error_naming_the_fix() -> None:
    with pytest.raises(ValueError, match=r"max_tokens_per_microbatch=64.*raise the budget"):
        budget_plan([10, 65], max_tokens=64)


def test_split_to_adds_micro_batches_without_adding_padding() -> None:
    needed = _long_tailed(40, 3)
    plan = budget_plan(needed, 1024, 8)
    more = split_to(plan, plan.num_microbatches + 5, 8)
    _check(more, needed, 1024, 8)
    assert more.num_microbatches == plan.num_microbatches + 5
    assert more.computed_tokens <= plan.computed_tokens
    assert budget_plan(needed, 1024, 8, num_microbatches=len(needed)).pad_frac == pytest.approx(
        1 - sum(needed) / sum(round_up(n, 8) for n in needed)
    )
    with pytest.raises(ValueError, match="at least one row"):
        split_to(plan, len(needed) + 1)


def test_packed_plan_fills_rows_by_first_fit_decreasing() -> None:
    needed = _long_tailed(60, 4)
    plan = packed_plan(needed, 512, row_multiple=8)
    assert plan.packed
    _check(plan, needed, 512, 8)
    assert plan.pad_frac < 0.02
    # first-fit decreasing uses at most 11/9 OPT + 1 rows; OPT >= total / capacity
    assert plan.num_microbatches <= 11 / 9 * (sum(needed) / 512) + 2


def test_length_multiple_for_sequence_and_context_parallel() -> None:
    assert length_multiple(16, 8, False, 1) == 16
    assert length_multiple(16, 8, True, 1) == 16
    assert length_multiple(16, 3, True, 1) == 48
    assert length_multiple(6, 4, True, 2) == 12  # lcm(6, TP 4, 2 x CP 2)


def test_rounding_for_tp2_with_sequence_parallel() -> None:
    # TP 2 + SP shards every micro-batch's sequence over 2 ranks: lengths must be even
    m = length_multiple(1, 2, True, 1)
    plan = budget_plan([3, 5, 7, 1, 2], 16, m)
    assert all(length % 2 == 0 for length in plan.lengths)


def test_balanced_partition_equal_sizes_and_close_sums() -> None:
    rng = random.Random(7)
    costs = [rng.lognormvariate(5, 1.2) for _ in range(32)]
    parts = balanced_partition(costs, 4)
    assert sorted(i for p in parts for i in p) == list(range(32))
    assert {len(p) for p in parts} == {8}
    sums = [sum(costs[i] for i in p) for p in parts]
    naive = [sum(costs[i * 8 : (i + 1) * 8]) for i in range(4)]
    assert max(sums) - min(sums) <= 0.1 * max(costs)
    assert max(sums) <= max(naive)
    assert parts == balanced_partition(list(costs), 4)  # deterministic


def test_sequence_cost_counts_attention() -> None:
    assert sequence_cost(4096, 4096) == pytest.approx(4096 * (1 + 1 / 12))
    assert sequence_cost(10, 4096) == pytest.approx(10, rel=1e-3)


def test_take_rows_cuts_or_pads_and_scatter_rows_restores_the_order() -> None:
    b, length = 4, 9
    tokens = torch.arange(b * length).view(b, length)
    mask = torch.ones(b, length)
    batch = RolloutBatch(
        tokens=tokens,
        response_mask=mask,
        advantages=torch.arange(b).float(),
        group_size=2,
        rollout_logprobs=torch.ones(b, length - 1),
    )
    short = take_rows(batch, [3, 1], 5)
    assert short.tokens.shape == (2, 6) and short.rollout_logprobs.shape == (2, 5)
    assert torch.equal(short.tokens, tokens[[3, 1], :6])
    assert torch.equal(short.advantages, torch.tensor([3.0, 1.0]))
    long = take_rows(batch, [0], 12, pad_id=-1)
    assert long.tokens.shape == (1, 13) and (long.tokens[0, 9:] == -1).all()
    assert (long.response_mask[0, 9:] == 0).all() and (long.rollout_logprobs[0, 8:] == 0).all()
    plan = MicroBatchPlan(((3, 1), (0, 2)), (5, 8), (5, 5, 8, 5))
    parts = [torch.full((2, 5), 1.0), torch.full((2, 8), 2.0)]
    out = scatter_rows(parts, plan, 8)
    assert out[3, :5].eq(1).all() and out[3, 5:].eq(0).all() and out[2].eq(2).all()


def test_a_plan_that_drops_or_repeats_a_row_is_refused() -> None:
    with pytest.raises(ValueError, match="exactly once"):
        MicroBatchPlan(((0, 1), (1,)), (4, 4), (2, 2, 2))
    with pytest.raises(ValueError, match="exactly once"):
        MicroBatchPlan(((0,),), (4,), (2, 2))
    with pytest.raises(ValueError, match="needs"):
        MicroBatchPlan(((0, 1),), (3,), (2, 4))
