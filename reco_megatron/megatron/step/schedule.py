"""Feeding megatron's pipeline schedule: a batch cut into micro-batches (fixed, token-budget or
packed, ``microbatching``) and run through ``get_forward_backward_func``.

:class:`MicroBatcher` is what the engine asks for every pass (old-policy, reference, update,
SFT), so they all share one split. Shapes that differ between micro-batches are fine for
megatron's schedules as long as the pipeline stages tell each other what they send:
:meth:`MicroBatcher.configure` turns on ``TransformerConfig.variable_seq_lengths`` when a token
budget runs with pipeline parallelism.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from reco_megatron.megatron.step.dp_balance import balance_across_ranks, common_count
from reco_megatron.megatron.step.loss_layer import LossContext, make_forward_step
from reco_megatron.megatron.step.microbatching import (
    MicroBatchPlan,
    budget_plan,
    fixed_plan,
    length_multiple,
    needed_lengths,
    packed_plan,
    round_up,
    split_to,
    take_rows,
)
from reco_megatron.megatron.step.packing import (
    PackedMicroBatch,
    make_packed_forward_step,
    pack_layout,
    packing_available,
)
from reco_megatron.parallel.batch import RolloutBatch
from reco_megatron.utils.logging import get_logger

logger = get_logger(__name__)


class MicroBatcher:
    """The micro-batching of one engine.

    ``update``: the engine's ``UpdateConfig`` (``max_tokens_per_microbatch``,
    ``microbatch_length_multiple``, ``balance_data_parallel``, ``sequence_packing``,
    ``fused_output_layer``, ``minibatches_per_rollout``);
    ``parallel``: its ``ParallelConfig``; ``attention``: the attention that runs (``te``,
    ``torch`` or ``local``, ``model.build.attention_backend``).
    """

    def __init__(self, update: Any, parallel: Any, attention: str) -> None:
        self.update, self.parallel = update, parallel
        self.budget: int | None = update.max_tokens_per_microbatch
        """Tokens per micro-batch, or None for fixed micro-batches."""
        self.multiple = length_multiple(
            update.microbatch_length_multiple,
            parallel.tensor_model_parallel_size,
            parallel.sequence_parallel,
            parallel.context_parallel_size,
        )
        """What token-budget micro-batch lengths are rounded up to."""
        self.packing = bool(update.sequence_packing) and self._packing_possible(attention)
        """Whether micro-batches run as packed rows (THD)."""

    def _packing_possible(self, attention: str) -> bool:
        ok, why = packing_available(attention)
        if ok and self.parallel.context_parallel_size > 1:
            raise ValueError(
                "update.sequence_packing=true with context_parallel_size > 1 is not supported: "
                "set update.sequence_packing=false (token-budget micro-batches still apply)"
            )
        if not ok:
            logger.warning(
                "update.sequence_packing=true but %s: packing is off, the token-budget "
                "micro-batches run as right-padded rows",
                why,
            )
        return ok

    def configure(self, config: Any) -> None:
        """Adjust megatron's ``TransformerConfig`` before the model is built: with a budget
        and PP > 1 the stages exchange each micro-batch's shape (``variable_seq_lengths``)."""
        if self.budget is not None and self.parallel.pipeline_model_parallel_size > 1:
            config.variable_seq_lengths = True

    def balance(self, batch: RolloutBatch, hidden_size: int) -> tuple[RolloutBatch, dict]:
        """This rank's balanced share of the global rollout batch and the balance metrics
        (``dp_balance``, collective over DP) with a budget, ``update.balance_data_parallel``
        and DP > 1; else ``batch`` as it is and no metrics."""
        from megatron.core import parallel_state as ps

        u = self.update
        if not u.balance_data_parallel or self.budget is None:
            return batch, {}
        if ps.get_data_parallel_world_size() == 1:
            return batch, {}
        group = ps.get_data_parallel_group()
        minibatches = u.minibatches_per_rollout
        return balance_across_ranks(batch, group, minibatches, hidden_size, self.multiple)

    def plan(self, batch: RolloutBatch) -> MicroBatchPlan:
        """The micro-batches ``batch`` runs as on this rank: fixed, or under the token budget
        with as many micro-batches as the data-parallel rank that needs the most (collective
        over the DP group; a multiple of PP with a virtual pipeline, as megatron requires)."""
        from megatron.core import parallel_state as ps

        needed = needed_lengths(batch.loss_mask)
        if self.budget is None:  # the batch's length, padded as the layout needs (SP, CP)
            p = self.parallel
            layout = length_multiple(
                1, p.tensor_model_parallel_size, p.sequence_parallel, p.context_parallel_size
            )
            length = round_up(batch.seq_length, layout)
            return fixed_plan(needed, length, self.parallel.micro_batch_size)
        vp = self.parallel.virtual_pipeline_model_parallel_size
        divisor = self.parallel.pipeline_model_parallel_size if vp else 1
        m = self.multiple
        if self.packing:
            plan = packed_plan(needed, self.budget, 1, row_multiple=m)
        else:
            plan = budget_plan(needed, self.budget, m)
        dp_group = ps.get_data_parallel_group()
        count = common_count(plan.num_microbatches, len(needed), dp_group, divisor)
        return split_to(plan, count, 1 if self.packing else m, m)

    def run(
        self,
        model: list[Any],
        batch: RolloutBatch,
        loss_func: Any,
        ctx: LossContext,
        device: torch.device,
        forward_only: bool,
        iterators: Callable[[list[RolloutBatch]], Any] | None = None,
    ) -> tuple[list[Any], MicroBatchPlan]:
        """Run ``batch`` (on ``device``) through megatron's schedule, one ``loss_func`` call
        per micro-batch on the last stage; returns the schedule's per-micro-batch outputs and
        the plan they follow. ``iterators(micro-batches)``: the schedule's data iterator(s)
        instead of plain ones (mixture-of-experts routing sets each micro-batch's routers as
        it is drawn); not with packed rows."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        plan = self.plan(batch)
        if plan.packed:
            mbs: list[Any] = [
                PackedMicroBatch(
                    take_rows(batch, rows, max(plan.needed[i] for i in rows)),
                    pack_layout([plan.needed[i] for i in rows], 1, self.multiple),
                )
                for rows in plan.rows
            ]
            fused = self.update.fused_output_layer
            step = make_packed_forward_step(loss_func, ctx, device, fused)
        else:
            mbs = [take_rows(batch, r, s) for r, s in zip(plan.rows, plan.lengths, strict=True)]
            step = make_forward_step(loss_func, ctx, device)
        if iterators is not None:
            if plan.packed:
                raise ValueError(  # the pre-flight refuses packing with model.moe first
                    "packed rows (update.sequence_packing) with a mixture-of-experts model are "
                    "not supported: set update.sequence_packing=false"
                )
            data: Any = iterators(mbs)
        elif len(model) > 1:  # virtual pipeline: one iterator per chunk
            data = [iter(mbs) for _ in model]
        else:
            data = iter(mbs)
        parts = get_forward_backward_func()(
            forward_step_func=step,
            data_iterator=data,
            model=model,
            num_microbatches=len(mbs),
            seq_length=max(plan.lengths),
            micro_batch_size=1 if plan.packed else max(len(r) for r in plan.rows),
            forward_only=forward_only,
        )
        return parts, plan
