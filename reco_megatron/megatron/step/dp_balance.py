"""Balanced data-parallel ranks: whole groups move between ranks so that each rank's compute
is about the same.

Each data-parallel rank generates the responses of its own groups (``batch.data_parallel_groups``),
so with long-tailed lengths one rank may hold several times the tokens of another, and every
optimizer step waits for the slowest. :func:`balance_across_ranks` exchanges the ranks'
rollout batches over the data-parallel group and gives each rank an equal number of whole
groups with about equal estimated compute (:func:`sequence_cost`, attention included;
:func:`balanced_partition`), **within each global mini-batch**: global mini-batch ``k`` is the
same set of groups as without balancing, only its split over the ranks changes. Since the loss is
normalised over the global mini-batch (docs/megatron-engine.md), the gradient is the same.

The exchange is an all-gather of the token-level tensors (every rank then holds the global
rollout batch: ``B x L`` token ids, masks and log-probs, 64 MB at the 8B example's 1024 x
4096 positions), then each rank keeps its share. Every rank computes the same
assignment from the same gathered lengths (the partition is deterministic).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import fields, replace
from typing import Any

import torch
import torch.distributed as dist

from reco_megatron.megatron.step.microbatching import needed_lengths, round_up, take_rows
from reco_megatron.parallel.batch import RolloutBatch
from reco_megatron.parallel.collectives import collective_device


def sequence_cost(length: int, hidden_size: int) -> float:
    """Estimated forward compute of one sequence, in units of one position's dense layers.

    A layer's dense matmuls cost about ``24 h^2`` FLOPs per position (QKV, output projection
    and a SwiGLU MLP of ~3.5 h); causal attention costs ``2 h L`` per position on average over
    a sequence of ``L`` (QK^T and AV over L/2 keys). Per sequence: ``L + L^2 / (12 h)``; at
    h = 4096 and L = 4096 attention adds 8 %."""
    return length + length * length / (12.0 * hidden_size)


def balanced_partition(costs: Sequence[float], parts: int) -> list[list[int]]:
    """Split items into ``parts`` lists of equal size (``len(costs) / parts`` each) with sums
    as equal as possible: longest-processing-time first (each item to the lightest part with
    room), then swaps between the heaviest and the lightest part while one lowers the
    heavier's sum. Deterministic (ties go to the lower index), so every rank computes the same
    answer. Returns the item indices of each part, ascending."""
    n = len(costs)
    if parts < 1 or n % parts:
        raise ValueError(f"{n} items cannot be split into {parts} equal parts")
    size = n // parts
    sums = [0.0] * parts
    out: list[list[int]] = [[] for _ in range(parts)]
    for i in sorted(range(n), key=lambda i: (-costs[i], i)):
        p = min((p for p in range(parts) if len(out[p]) < size), key=lambda p: (sums[p], p))
        out[p].append(i)
        sums[p] += costs[i]
    for _ in range(4 * n):
        hi = max(range(parts), key=lambda p: (sums[p], -p))
        lo = min(range(parts), key=lambda p: (sums[p], p))
        gap = sums[hi] - sums[lo]
        best = None
        for a in out[hi]:
            for b in out[lo]:
                delta = costs[a] - costs[b]
                if 0 < delta < gap and (best is None or abs(gap - 2 * delta) < best[0]):
                    best = (abs(gap - 2 * delta), a, b)
        if best is None or best[0] >= gap:
            break
        _, a, b = best
        out[hi].remove(a)
        out[lo].remove(b)
        out[hi].append(b)
        out[lo].append(a)
        sums[hi] += costs[b] - costs[a]
        sums[lo] += costs[a] - costs[b]
    return [sorted(p) for p in out]


def _gather_batches(batch: RolloutBatch, group: Any) -> RolloutBatch:
    """The rows of every rank's ``batch``, rank after rank, right-padded to the longest."""
    device = collective_device(group)
    world = dist.get_world_size(group)
    width = torch.tensor([batch.tokens.shape[1]], dtype=torch.long, device=device)
    dist.all_reduce(width, op=dist.ReduceOp.MAX, group=group)
    batch = take_rows(batch, range(batch.num_sequences), int(width.item()) - 1)
    names = [f.name for f in fields(batch) if f.name != "group_size"]  # the tensors
    present = torch.tensor(
        [getattr(batch, n) is not None for n in names], dtype=torch.long, device=device
    )
    agree = present.clone()
    dist.all_reduce(agree, op=dist.ReduceOp.MIN, group=group)
    if not torch.equal(agree, present):
        bad = [n for n, a, p in zip(names, agree.tolist(), present.tolist(), strict=True) if a != p]
        raise RuntimeError(f"RolloutBatch fields {bad} are set on some data-parallel ranks only")
    out = {}
    for name in names:
        value = getattr(batch, name)
        if value is None:
            continue
        # int16 (routed experts) travels as int32: gloo's all_gather has no 16-bit integers
        wire = torch.int32 if value.dtype == torch.int16 else value.dtype
        local = value.contiguous().to(device=device, dtype=wire)
        parts = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(parts, local, group=group)
        out[name] = torch.cat(parts).to(value.device, value.dtype)
    return replace(batch, **out)


def balance_across_ranks(
    batch: RolloutBatch,
    group: Any,
    minibatches: int,
    hidden_size: int,
    length_multiple: int = 1,
) -> tuple[RolloutBatch, dict[str, float]]:
    """This rank's balanced share of the global rollout batch (collective over ``group``).

    ``batch``: this rank's rows, whole groups, its ``minibatches`` consecutive parts being its
    slices of global mini-batches ``0..minibatches-1`` (what ``batch.data_parallel_share`` and
    the trainer give). Returns the new rows in the same layout (mini-batch-major, whole groups,
    as many groups as before; tensors cut to the longest row needs, rounded up to
    ``length_multiple``) and metrics: ``balance_tokens_max``/``_min``, the most and fewest
    needed tokens on a rank before (``_before``) and after balancing.
    """
    world = dist.get_world_size(group) if group is not None else 1
    if world == 1:
        return batch, {}
    rank = dist.get_rank(group)
    g = batch.group_size
    groups = batch.num_sequences // g
    if groups % minibatches:
        raise ValueError(
            f"{groups} groups on this rank cannot be split into {minibatches} mini-batches"
        )
    per = groups // minibatches
    full = _gather_batches(batch, group)
    needed = needed_lengths(full.loss_mask)
    local_groups = groups  # every rank holds the same number (checked by the trainer's split)

    def rows_of(r: int, local: int) -> range:
        start = (r * local_groups + local) * g
        return range(start, start + g)

    mine: list[int] = []
    before = [0] * world
    total = [0.0] * world
    after = [0] * world
    for k in range(minibatches):
        owners = [(r, k * per + j) for r in range(world) for j in range(per)]
        costs = [sum(sequence_cost(needed[i], hidden_size) for i in rows_of(*o)) for o in owners]
        parts = balanced_partition(costs, world)
        # the heaviest part to the rank with the least work so far (the old-policy pass runs
        # all mini-batches at once): each update and the whole batch are balanced
        load = [sum(costs[i] for i in part) for part in parts]
        heaviest_first = sorted(range(world), key=lambda p: (-load[p], p))
        least_loaded_first = sorted(range(world), key=lambda r: (total[r], r))
        part_of = dict(zip(least_loaded_first, heaviest_first, strict=True))
        for r in range(world):
            total[r] += load[part_of[r]]
            for idx in parts[part_of[r]]:
                rows = rows_of(*owners[idx])
                after[r] += sum(needed[i] for i in rows)
                if r == rank:
                    mine.extend(rows)
        for r, local in owners:
            before[r] += sum(needed[i] for i in rows_of(r, local))
    length = round_up(max(needed[i] for i in mine), length_multiple)
    out = take_rows(full, mine, min(length, full.seq_length))
    out = replace(out, group_size=g)
    metrics = {
        "balance_tokens_max_before": float(max(before)),
        "balance_tokens_min_before": float(min(before)),
        "balance_tokens_max": float(max(after)),
        "balance_tokens_min": float(min(after)),
    }
    return out, metrics


def common_count(count: int, rows: int, group: Any, divisor: int = 1) -> int:
    """The number of micro-batches every rank of ``group`` runs: the largest ``count`` over the
    group (collective), rounded up to a multiple of ``divisor``. Pipeline schedules run the
    same count on every rank, and a rank that needs fewer gets its micro-batches split (which
    adds no padding) rather than empty ones."""
    if group is not None and dist.get_world_size(group) > 1:
        t = torch.tensor([count], dtype=torch.long, device=collective_device(group))
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        count = int(t.item())
    count = round_up(count, divisor)
    if count > rows:
        why = (
            f", rounded up to a multiple of PP = {divisor} for the virtual pipeline"
            if divisor > 1
            else ""
        )
        raise ValueError(
            f"{rows} sequences on this rank cannot fill {count} micro-batches (the most any "
            f"data-parallel rank needs under update.max_tokens_per_microbatch{why}): give each "
            "rank more sequences per mini-batch (rollout.prompts_per_step) or raise the budget"
        )
    return count
