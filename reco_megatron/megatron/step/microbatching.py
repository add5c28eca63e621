"""Which rows of a batch run together, and at what length: fixed and token-budget micro-batches.

A rollout batch is right-padded to its longest sequence. With fixed micro-batches
(``parallel.micro_batch_size`` rows each) every micro-batch runs at that length, so with
long-tailed response lengths most of the compute goes to padding. With a token budget
(``update.max_tokens_per_microbatch``) each micro-batch is cut to its own longest row, rounded
up to a multiple the layout needs (:func:`length_multiple`), and rows are grouped so that
``rows x length <= budget`` and the fewest computed positions, each micro-batch charged a
fixed overhead on top (:func:`budget_plan`). With sequence packing the cost of a micro-batch is the
sum of its rows' lengths instead (:func:`packed_plan`).

Lengths here are **needed positions**: the model positions a row must run so that every
response label is predicted (the last response label's index + 1, :func:`needed_lengths`);
everything after it is padding that no loss term reads.

The planning is pure Python over lists of ints (no megatron-core, no collectives): every rank
of a model-parallel group computes the same plan from the same batch. Pieces:

* :class:`MicroBatchPlan`: rows and length of each micro-batch, with its padding accounting;
* :func:`fixed_plan`, :func:`budget_plan`, :func:`packed_plan`, :func:`split_to` (more
  micro-batches, so that every data-parallel rank runs the same count);
* :func:`take_rows`: a micro-batch's tensors at its length.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace

import torch

from reco_megatron.parallel.batch import RolloutBatch


def round_up(n: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` that is >= ``n`` (and >= ``multiple``)."""
    return max(1, -(-n // multiple)) * multiple


def length_multiple(base: int, tp: int, sequence_parallel: bool, cp: int) -> int:
    """What every micro-batch length is rounded up to: ``base`` (kernel-friendly shapes), TP
    with sequence parallelism (megatron shards the sequence over the TP ranks), ``2 x CP``
    with context parallelism (load-balanced causal chunks)."""
    m = base
    if sequence_parallel:
        m = math.lcm(m, tp)
    if cp > 1:
        m = math.lcm(m, 2 * cp)
    return m


def needed_lengths(loss_mask: torch.Tensor) -> list[int]:
    """Positions each row of ``loss_mask [B, S]`` must run: last response label + 1 (>= 1).

    Causal attention never lets an earlier position see a later one, so cutting a row after
    its last response label changes none of its scored tokens."""
    b, s = loss_mask.shape
    if b == 0:
        return []
    scored = loss_mask.detach().to("cpu") > 0
    positions = torch.arange(1, s + 1).expand(b, s)
    last = torch.where(scored, positions, torch.zeros_like(positions)).amax(dim=1)
    return [max(1, int(x)) for x in last]


@dataclass(frozen=True)
class MicroBatchPlan:
    """The split of one batch (``B`` rows) into micro-batches.

    Every row appears in exactly one micro-batch (checked on construction), so nothing is
    dropped or run twice."""

    rows: tuple[tuple[int, ...], ...]
    """Row indices of each micro-batch, in the order they run."""
    lengths: tuple[int, ...]
    """Length ``S`` each micro-batch runs at (a packed micro-batch: its packed row's length)."""
    needed: tuple[int, ...]
    """Needed positions of every row of the batch (:func:`needed_lengths`)."""
    packed: bool = False
    """Sequences of a micro-batch are packed into one row (THD) instead of padded rows."""

    def __post_init__(self) -> None:
        if len(self.rows) != len(self.lengths):
            raise ValueError(f"{len(self.rows)} row lists but {len(self.lengths)} lengths")
        seen = sorted(r for mb in self.rows for r in mb)
        if seen != list(range(len(self.needed))):
            raise ValueError(
                f"a micro-batch plan must use every one of the {len(self.needed)} rows exactly "
                f"once, got rows {seen}"
            )
        if any(not mb for mb in self.rows):
            raise ValueError("a micro-batch plan holds an empty micro-batch")
        for mb, length in zip(self.rows, self.lengths, strict=True):
            need = (
                sum(self.needed[r] for r in mb) if self.packed else max(self.needed[r] for r in mb)
            )
            if length < need:
                raise ValueError(f"micro-batch {mb} runs at {length} < the {need} it needs")

    @property
    def num_microbatches(self) -> int:
        """Micro-batches of the plan."""
        return len(self.rows)

    def tokens(self, i: int) -> int:
        """Positions micro-batch ``i`` computes (rows x length; a packed row: its length)."""
        return self.lengths[i] if self.packed else len(self.rows[i]) * self.lengths[i]

    @property
    def computed_tokens(self) -> int:
        """Positions the model computes over the whole plan, padding included."""
        return sum(self.tokens(i) for i in range(self.num_microbatches))

    @property
    def real_tokens(self) -> int:
        """Positions that are needed (:attr:`needed` summed)."""
        return sum(self.needed)

    @property
    def pad_frac(self) -> float:
        """Share of the computed positions that are padding."""
        total = self.computed_tokens
        return 1.0 - self.real_tokens / total if total else 0.0

    def counters(self) -> dict[str, float]:
        """The plan's numbers as metric entries (``name/sum`` / ``/max`` / ``/min``), summed or
        reduced over micro-batches and data-parallel ranks by ``engine_metrics.reduce_metrics``."""
        tokens = float(self.computed_tokens)
        return {
            "tokens_computed/sum": tokens,
            "tokens_real/sum": float(self.real_tokens),
            "microbatches/max": float(self.num_microbatches),
            "rank_tokens_max/max": tokens,
            "rank_tokens_min/min": tokens,
        }


def fixed_plan(needed: Sequence[int], seq_length: int, micro_batch_size: int) -> MicroBatchPlan:
    """Today's split: consecutive slices of ``micro_batch_size`` rows, all at ``seq_length``."""
    b = len(needed)
    if micro_batch_size < 1 or b % micro_batch_size:
        raise ValueError(
            f"{b} sequences cannot be split into micro-batches of {micro_batch_size}: choose "
            "parallel.micro_batch_size dividing the per-rank batch (prompts x group size / DP)"
        )
    rows = tuple(tuple(range(i, i + micro_batch_size)) for i in range(0, b, micro_batch_size))
    return MicroBatchPlan(rows, (seq_length,) * len(rows), tuple(needed))


def _check_fits(needed: Sequence[int], max_tokens: int, multiple: int) -> list[int]:
    rounded = [round_up(n, multiple) for n in needed]
    if rounded and max(rounded) > max_tokens:
        raise ValueError(
            f"a sequence needs {max(needed)} positions ({max(rounded)} rounded up to a multiple "
            f"of {multiple}) but update.max_tokens_per_microbatch={max_tokens}: raise the budget "
            "to at least the longest prompt + response (rollout.max_prompt_len + "
            "rollout.max_new_tokens, rounded up)"
        )
    return rounded


MICROBATCH_OVERHEAD = 1 / 16
"""What one more micro-batch costs, as a share of a full one (``max_tokens`` positions): kernel
launches and scheduling that do not shrink with the micro-batch. A launch-count estimate for
an 8B model (~1500 launches of ~5 us against ~0.25 s of work for 4096 positions at TP 2) gives
~1/30; 1/16 errs toward fewer, fuller micro-batches."""


def budget_plan(
    needed: Sequence[int],
    max_tokens: int,
    multiple: int = 1,
    num_microbatches: int | None = None,
    overhead: float = MICROBATCH_OVERHEAD,
) -> MicroBatchPlan:
    """Padded micro-batches under a token budget: ``rows x round_up(longest row) <= max_tokens``.

    Rows sorted by needed length (longest first) are cut into consecutive runs; a dynamic
    program over the cut points minimises the computed positions plus ``overhead x
    max_tokens`` per micro-batch (ties: fewer micro-batches). Exact over such runs, and runs of
    the sorted order lose nothing: any grouping can be rearranged into runs with the same row
    counts whose every micro-batch is no longer. ``overhead = inf`` gives the fewest
    micro-batches, then the least padding. ``O(B x w)`` for ``w`` the most rows that fit one
    micro-batch. ``num_microbatches`` asks for that many (:func:`split_to`), e.g. to match the
    other data-parallel ranks.
    """
    rounded = _check_fits(needed, max_tokens, multiple)
    order = sorted(range(len(needed)), key=lambda i: (-needed[i], i))
    lens = [rounded[i] for i in order]  # non-increasing
    n = len(order)
    charge = overhead * max_tokens
    best: list[tuple[float, int]] = [(0.0, 0)] + [(math.inf, 0)] * n
    cut = [0] * (n + 1)
    for end in range(1, n + 1):
        for start in range(end - 1, -1, -1):
            tokens = (end - start) * lens[start]  # lens[start] is the run's longest row
            if tokens > max_tokens:
                break  # an earlier start only adds rows and length
            cost, count = best[start]
            cand = (cost + tokens + charge, count + 1)
            if cand < best[end]:
                best[end], cut[end] = cand, start
    runs = []
    end = n
    while end > 0:
        runs.append(order[cut[end] : end])
        end = cut[end]
    runs.reverse()
    plan = MicroBatchPlan(
        tuple(tuple(r) for r in runs),
        tuple(max(rounded[i] for i in r) for r in runs),
        tuple(needed),
    )
    return split_to(plan, num_microbatches, multiple) if num_microbatches else plan


def packed_plan(
    needed: Sequence[int],
    max_tokens: int,
    multiple: int = 1,
    num_microbatches: int | None = None,
    row_multiple: int = 1,
) -> MicroBatchPlan:
    """Packed micro-batches (THD): first-fit decreasing of the rows' lengths (each rounded up to
    ``multiple``) into rows of at most ``max_tokens`` positions; a packed row's length is
    rounded up to ``row_multiple`` (TP with sequence parallelism)."""
    _check_fits(needed, max_tokens, math.lcm(multiple, row_multiple))
    rounded = [round_up(n, multiple) for n in needed]
    order = sorted(range(len(needed)), key=lambda i: (-needed[i], i))
    bins: list[list[int]] = []
    room: list[int] = []
    for i in order:
        for b, free in enumerate(room):
            if (
                rounded[i] <= free
                and round_up(max_tokens - free + rounded[i], row_multiple) <= max_tokens
            ):
                bins[b].append(i)
                room[b] -= rounded[i]
                break
        else:
            bins.append([i])
            room.append(max_tokens - rounded[i])
    plan = MicroBatchPlan(
        tuple(tuple(b) for b in bins),
        tuple(round_up(sum(rounded[i] for i in b), row_multiple) for b in bins),
        tuple(needed),
        packed=True,
    )
    if num_microbatches:
        plan = split_to(plan, num_microbatches, multiple, row_multiple)
    return plan


def split_to(
    plan: MicroBatchPlan, count: int | None, multiple: int = 1, row_multiple: int = 1
) -> MicroBatchPlan:
    """``plan`` with exactly ``count`` micro-batches: the one computing the most tokens is
    halved (its longest rows in one half) until there are enough. More micro-batches never
    add padding. Raises when there are fewer rows than ``count``."""
    if count is None or count == plan.num_microbatches:
        return plan
    if count < plan.num_microbatches or count > len(plan.needed):
        raise ValueError(
            f"cannot make {count} micro-batches from a plan of {plan.num_microbatches} over "
            f"{len(plan.needed)} rows (every micro-batch needs at least one row)"
        )
    rows = [sorted(r, key=lambda i: (-plan.needed[i], i)) for r in plan.rows]

    def length(r: list[int]) -> int:
        if plan.packed:
            return round_up(sum(round_up(plan.needed[i], multiple) for i in r), row_multiple)
        return round_up(max(plan.needed[i] for i in r), multiple)

    def tokens(r: list[int]) -> int:
        return length(r) if plan.packed else len(r) * length(r)

    while len(rows) < count:
        splittable = [k for k, r in enumerate(rows) if len(r) > 1]
        k = max(splittable, key=lambda k: (tokens(rows[k]), -k))
        half = len(rows[k]) // 2
        rows[k : k + 1] = [rows[k][:half], rows[k][half:]]
    return MicroBatchPlan(
        tuple(tuple(r) for r in rows),
        tuple(length(r) for r in rows),
        plan.needed,
        packed=plan.packed,
    )


# ---------------------------------------------------------------- tensors of one micro-batch
_PAD_FILL = {"routed_experts": -1}
"""What padding positions hold, per field, when it is not 0 (``-1``: no expert recorded)."""


def take_rows(batch: RolloutBatch, rows: Sequence[int], seq_length: int, pad_id: int = 0):
    """Rows ``rows`` of ``batch`` with every per-token tensor cut or right-padded to
    ``seq_length`` positions (``tokens``/``response_mask``: ``seq_length + 1``). Padding gets
    ``pad_id`` tokens and zeros elsewhere; it is never scored (``response_mask`` is 0)."""
    index = torch.as_tensor(list(rows), dtype=torch.long, device=batch.tokens.device)
    s_full = batch.seq_length
    out = {}
    for f in fields(batch):
        value = getattr(batch, f.name)
        if not isinstance(value, torch.Tensor):
            continue
        value = value.index_select(0, index)
        if value.dim() >= 2:  # [B, S, ...]: per token (routed_experts: [B, S, layers, k])
            width = seq_length + (value.shape[1] - s_full)  # +1 for tokens / response_mask
            if width <= value.shape[1]:
                value = value[:, :width]
            else:
                fill = _PAD_FILL.get(f.name, 0) if f.name != "tokens" else pad_id
                pad = value.new_full(
                    (value.shape[0], width - value.shape[1], *value.shape[2:]), fill
                )
                value = torch.cat([value, pad], dim=1)
        out[f.name] = value
    b = len(rows)
    group = batch.group_size if b % batch.group_size == 0 else 1
    return replace(batch, **out, group_size=group)


def scatter_rows(
    parts: Sequence[torch.Tensor], plan: MicroBatchPlan, seq_length: int
) -> torch.Tensor:
    """Per-token results ``[rows_i, S_i]`` of each micro-batch back to ``[B, seq_length]`` in
    the batch's row order (zeros past a micro-batch's length)."""
    first = parts[0]
    out = first.new_zeros((len(plan.needed), seq_length))
    for rows, part in zip(plan.rows, parts, strict=True):
        width = min(part.shape[1], seq_length)
        index = torch.as_tensor(rows, dtype=torch.long, device=part.device)
        out[index, :width] = part[:, :width]
    return out


def with_plan_counters(parts: Sequence[dict], plan: MicroBatchPlan) -> list[dict]:
    """Each micro-batch's metric dict plus its share of :meth:`MicroBatchPlan.counters`, so
    that ``reduce_metrics`` sums the tokens and takes the extremes over micro-batches and
    data-parallel ranks together with the loss metrics."""
    rank_total = float(plan.computed_tokens)
    return [
        {
            **part,
            "tokens_computed/sum": float(plan.tokens(i)),
            "tokens_real/sum": float(sum(plan.needed[r] for r in plan.rows[i])),
            "microbatches/max": float(plan.num_microbatches),
            "rank_tokens_max/max": rank_total,
            "rank_tokens_min/min": rank_total,
        }
        for i, part in enumerate(parts)
    ]
