"""The ReCo training engine on megatron-core: old-policy pass, then mini-batch updates.

One rollout batch (whole groups of G responses per DP rank) goes through:

1. :meth:`ReCoEngine.prepare` -- a forward-only pass of the current weights over the whole
   batch (the *old policy*: ``logp_old``, ``sum_p2_old``), the reference model's log-probs when
   a KL term is used, and the ReCo response weights computed **per complete group** before the
   batch is split into mini-/micro-batches (:mod:`reco_megatron.megatron.step.old_policy`).
2. :meth:`ReCoEngine.train_on_rollout` -- ``epochs_per_rollout`` x ``minibatches_per_rollout``
   optimizer steps. At the first step ``theta == theta_old`` so ReCo's token ratio is exactly 1;
   from the second mini-batch on it acts (docs/loss.md).

Pipeline parallelism: only the last stage computes statistics and losses, so ``old_logprobs``,
weights and metrics live there; metrics are then broadcast to every rank of the model-parallel
group so that global rank 0 can log them.

Devices (:mod:`reco_megatron.megatron.device`): the engine computes on ``engine.device`` (the
current CUDA device, or the CPU). Batches come from the trainer on any device (the trainer
builds them on the CPU); every public method moves them to ``engine.device`` itself, and what it
returns is on the CPU: the prepared :class:`RolloutBatch`, statistics tensors, and metrics as
Python floats. Nothing above the engine moves tensors to the engine's device.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from reco_megatron.algo import LossConfig, check_weight_policy
from reco_megatron.megatron.device import resolve_device
from reco_megatron.megatron.distributed import ParallelConfig
from reco_megatron.megatron.model.build import (
    attention_backend,
    build_model,
    fuse_output_layer,
    transformer_config,
)
from reco_megatron.megatron.model.config import ModelConfig
from reco_megatron.megatron.model.optimizer import (
    OptimConfig,
    build_optimizer,
    current_lr,
    wrap_ddp,
)
from reco_megatron.megatron.model.routing import MoERouting
from reco_megatron.megatron.step.config import UpdateConfig
from reco_megatron.megatron.step.loss_layer import (
    LossContext,
    denominator_share,
    policy_loss_func,
    sft_loss_func,
    statistics_func,
)
from reco_megatron.megatron.step.metrics import reduce_metrics
from reco_megatron.megatron.step.microbatching import (
    MicroBatchPlan,
    scatter_rows,
    with_plan_counters,
)
from reco_megatron.megatron.step.old_policy import prepare_rollout
from reco_megatron.megatron.step.schedule import MicroBatcher
from reco_megatron.parallel.batch import RolloutBatch
from reco_megatron.parallel.collectives import collective_device
from reco_megatron.utils.logging import get_logger

logger = get_logger(__name__)


class ReCoEngine:
    """Model chunks, DDP, distributed optimizer, scheduler and the ReCo update.

    Must be constructed after :func:`reco_megatron.megatron.distributed.initialize_parallel`.
    ``device``: where the model and its computations live; None (the default) is the current
    CUDA device when CUDA is available, else the CPU (``engine.device`` holds the answer).
    ``response_weight_policy``: whose log-probs the response weights read, resolved
    (``TrainConfig.response_weight_policy``): ``proximal`` (pi_old) or ``behaviour`` (mu).
    """

    def __init__(
        self,
        model: ModelConfig,
        parallel: ParallelConfig,
        loss: LossConfig,
        optim: OptimConfig,
        update: UpdateConfig,
        total_optimizer_steps: int,
        seed: int = 1234,
        device: torch.device | str | None = None,
        *,
        response_weight_policy: str = "proximal",
    ) -> None:
        from megatron.core import parallel_state as ps

        self.model_cfg, self.parallel, self.loss_cfg = model, parallel, loss
        self.optim_cfg, self.update = optim, update
        check_weight_policy(response_weight_policy)
        self.response_weight_policy = response_weight_policy
        self.device = resolve_device(device)
        """Where the model lives and every batch is moved to (``cpu`` or the current CUDA)."""
        self.on_gpu = self.device.type == "cuda"
        parallel.validate_for_model(model, model.num_layers, self.on_gpu)
        self.config = transformer_config(model, parallel, self.on_gpu)
        self.attention = attention_backend(model, self.on_gpu)
        """The attention that runs: ``te``, ``torch`` or ``local`` (``model.attention_backend``)."""
        if parallel.context_parallel_size > 1 and self.attention != "te":
            raise ValueError(
                f"parallel.context_parallel_size={parallel.context_parallel_size} needs "
                f"transformer-engine's attention, not model.attention_backend={self.attention!r}"
                ": set context_parallel_size=1, or install transformer-engine and use 'auto'"
            )
        self.batcher = MicroBatcher(update, parallel, self.attention)
        """Micro-batches of every pass: fixed, token-budget or packed."""
        self.batcher.configure(self.config)
        torch.manual_seed(seed)  # identical initial weights on every data-parallel replica
        self.model = wrap_ddp(self._build_chunks(), self.config, optim)
        self.optimizer, self.scheduler = build_optimizer(
            self.model, self.config, optim, total_optimizer_steps
        )
        self.ref_model: list[Any] | None = None
        if loss.kl_coef > 0:
            self.ref_model = self._build_chunks()
            self.sync_reference()
        self.routing: MoERouting | None = None
        """The policy's routers (mixture-of-experts models): replay, records, metrics."""
        if model.moe is not None:
            self.routing = MoERouting(
                self.unwrapped(),
                num_layers=model.num_layers,
                sequence_parallel=parallel.sequence_parallel,
            )
        self.ctx = LossContext(
            loss=loss,
            vocab_size=model.vocab_size,
            tp_group=ps.get_tensor_model_parallel_group(),
            stats_implementation=update.stats_implementation,  # type: ignore[arg-type]
            fused_output_layer=update.fused_output_layer,
            sequence_parallel=parallel.sequence_parallel,
        )
        self.optimizer_steps = 0
        self.last_plan: MicroBatchPlan | None = None
        """The micro-batch plan of the latest forward-only pass (metrics, tests)."""

    # ------------------------------------------------------------------ construction
    def _build_chunks(self) -> list[Any]:
        from megatron.core import parallel_state as ps

        vp = self.parallel.virtual_pipeline_model_parallel_size
        chunks = []
        for i in range(vp or 1):
            kwargs = {} if vp is None else {"vp_stage": i}
            chunk = build_model(
                self.model_cfg,
                self.config,
                pre_process=ps.is_pipeline_first_stage(ignore_virtual=vp is None, **kwargs),
                post_process=ps.is_pipeline_last_stage(ignore_virtual=vp is None, **kwargs),
                on_gpu=self.on_gpu,
                vp_stage=None if vp is None else i,
            )
            if self.update.fused_output_layer:
                fuse_output_layer(chunk)
            chunks.append(chunk.to(self.device))
        return chunks

    def unwrapped(self) -> list[Any]:
        """The GPTModel chunks inside DDP."""
        return [chunk.module for chunk in self.model]

    def sync_reference(self) -> None:
        """Copy the current policy weights into the reference model (frozen, no grad)."""
        if self.ref_model is None:
            return
        for ref, cur in zip(self.ref_model, self.unwrapped(), strict=True):
            ref.load_state_dict(cur.state_dict(), strict=True)
            ref.requires_grad_(False)
            ref.eval()

    @property
    def is_last_stage(self) -> bool:
        """Whether this rank computes the loss (last pipeline stage)."""
        from megatron.core import parallel_state as ps

        return ps.is_pipeline_last_stage(ignore_virtual=True)

    # ------------------------------------------------------------------ schedules
    def _run(self, model, batch, loss_func, forward_only, *, replay=False, measure=False):
        """``(per-micro-batch outputs, plan)`` of one pass over ``batch``
        (``schedule.MicroBatcher``: fixed or token-budget micro-batches). For the policy of a
        mixture-of-experts model the data iterators also set each micro-batch's routing
        (``replay``: the rollout's experts; ``measure``: record the free choices) and, when
        training, the auxiliary loss's coefficient (:mod:`reco_megatron.megatron.model.routing`)."""
        batch = batch.to(self.device)
        routing = self.routing if model is self.model else None
        iterators = None
        if routing is not None:
            sft = loss_func is sft_loss_func

            def iterators(mbs: list[RolloutBatch]) -> Any:
                shares = [
                    mb.loss_mask.sum() if sft else denominator_share(mb, self.loss_cfg)
                    for mb in mbs
                ]
                return routing.micro_batches(
                    mbs,
                    len(model),
                    replay=replay,
                    measure=measure,
                    train=not forward_only,
                    shares=shares,
                )

        try:
            return self.batcher.run(
                model, batch, loss_func, self.ctx, self.device, forward_only, iterators
            )
        finally:
            if routing is not None:
                routing.end_pass()

    def statistics(self, batch: RolloutBatch, reference: bool = False) -> dict[str, torch.Tensor]:
        """Forward-only per-token ``logprob``, ``sum_p2``, ``entropy`` ``[B, S]`` on the CPU
        (last stage; ``{}`` elsewhere) of the current policy, or of the reference model."""
        return {k: v.cpu() for k, v in self.statistics_on_device(batch, reference).items()}

    def statistics_on_device(
        self, batch: RolloutBatch, reference: bool, **routing: bool
    ) -> dict[str, torch.Tensor]:
        """:meth:`statistics` on ``self.device`` (``routing``: see :meth:`_run`)."""
        model = self.ref_model if reference else self.model
        if model is None:
            raise RuntimeError("no reference model: it exists only when loss.kl_coef > 0")
        for chunk in model:
            chunk.eval()
        with torch.no_grad():
            parts, plan = self._run(model, batch, statistics_func, forward_only=True, **routing)
        for chunk in self.model:
            chunk.train()
        self.last_plan = plan
        if not self.is_last_stage:
            return {}
        s = batch.seq_length
        return {key: scatter_rows([p[key] for p in parts], plan, s) for key in parts[0]}

    def prepare(self, batch: RolloutBatch) -> tuple[RolloutBatch, dict[str, float]]:
        """The old-policy pass, reference log-probs and response weights of a whole batch
        (:func:`reco_megatron.megatron.step.old_policy.prepare_rollout`).

        With a token budget, ``update.balance_data_parallel`` and DP > 1 the ranks first exchange
        whole groups (``dp_balance``, collective): the returned batch then holds this rank's
        balanced share of the same global mini-batches. Returns the batch with
        ``old_logprobs``, ``old_sum_p2``, ``ref_logprobs`` and ``weights`` filled, on the CPU,
        and the metrics of the pass."""
        return prepare_rollout(self, batch)

    def routing_for(self, batch: RolloutBatch) -> dict[str, bool]:
        """How the policy's routers treat ``batch``: ``replay`` the rollout's experts and
        ``measure`` the mismatch (the old-policy pass measures; updates only replay)."""
        if self.routing is None:
            return {}
        return self.routing.pass_options(self.update.routing_replay, batch)

    def grads_finite(self) -> bool:
        """Whether every gradient on every rank is finite (collective over the world)."""
        ok = torch.ones((), dtype=torch.float32)
        for chunk in self.model:
            for param in chunk.parameters():
                grad = getattr(param, "main_grad", None)
                if grad is None:
                    grad = param.grad
                if grad is not None and not torch.isfinite(grad).all():
                    ok.zero_()
                    break
        if dist.is_initialized() and dist.get_world_size() > 1:
            ok = ok.to(collective_device())
            dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        return bool(ok.item() > 0)

    def train_step(
        self, minibatch: RolloutBatch, guard: Callable[[dict[str, float], bool], str] | None = None
    ) -> dict[str, float]:
        """One optimizer step on ``minibatch`` (this DP rank's share), globally normalised.

        ``guard(metrics, grads_finite)`` sees the step's global metrics after
        forward+backward and returns ``"skip"`` to drop the update (the stability guards);
        without a guard, a step with non-finite gradients is skipped.
        """
        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        start = time.perf_counter()
        replay = self.routing_for(minibatch).get("replay", False)
        parts, plan = self._run(self.model, minibatch, policy_loss_func, False, replay=replay)
        middle = time.perf_counter()
        if self.is_last_stage:
            parts = with_plan_counters(parts, plan)
        metrics = reduce_metrics(parts if self.is_last_stage else [], weight_key="num_tokens/sum")
        metrics = self.broadcast_metrics(metrics)
        metrics.update(self.routing.step_metrics() if self.routing is not None else {})
        finite = self.grads_finite()
        decision = guard(metrics, finite) if guard is not None else ("ok" if finite else "skip")
        grad_norm = None
        update_ok = False
        if decision != "skip":
            update_ok, grad_norm, _ = self.optimizer.step()
            if update_ok:
                self.scheduler.step(increment=1)
        end = time.perf_counter()
        self.optimizer_steps += 1
        metrics["grad_norm"] = float(grad_norm) if grad_norm is not None else float("nan")
        metrics["update_skipped"] = 0.0 if update_ok else 1.0
        metrics["lr"] = current_lr(self.optimizer)
        metrics["time_forward_backward"] = middle - start
        metrics["time_optimizer"] = end - middle
        return metrics

    def sft_step(self, batch: RolloutBatch, lr: float) -> dict[str, float]:
        """One supervised step (NLL of the response tokens) at learning rate ``lr``.

        The scheduler is not advanced: SFT warm-up does not consume the RL schedule.
        """
        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        saved = [group["lr"] for group in self.optimizer.param_groups]
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        try:
            parts, _ = self._run(self.model, batch, sft_loss_func, forward_only=False)
            update_ok, grad_norm, _ = self.optimizer.step()
        finally:
            for group, value in zip(self.optimizer.param_groups, saved, strict=True):
                group["lr"] = value
        metrics = reduce_metrics(parts if self.is_last_stage else [], weight_key="num_tokens/sum")
        metrics.update(self.routing.step_metrics() if self.routing is not None else {})
        metrics["grad_norm"] = float(grad_norm) if grad_norm is not None else float("nan")
        metrics["update_skipped"] = 0.0 if update_ok else 1.0
        return metrics

    def train_on_rollout(
        self, batch: RolloutBatch, guard: Callable[[dict[str, float], bool], str] | None = None
    ) -> list[dict[str, float]]:
        """``epochs x minibatches`` optimizer steps over a prepared batch (whole groups)."""
        n = self.update.minibatches_per_rollout
        b = batch.num_sequences
        if b % n:
            raise ValueError(
                f"{b} sequences per rank cannot be split into {n} mini-batches: make "
                "update.minibatches_per_rollout divide prompts_per_step x group_size / DP"
            )
        size = b // n
        out = []
        for _ in range(self.update.epochs_per_rollout):
            for i in range(n):
                mini = batch.select(slice(i * size, (i + 1) * size))
                out.append(self.train_step(mini, guard))
        return out

    def broadcast_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
        """Metrics of the last pipeline stage on every rank (for rank-0 logging)."""
        from megatron.core import parallel_state as ps

        if ps.get_pipeline_model_parallel_world_size() == 1:
            return metrics
        box = [metrics if self.is_last_stage else None]
        group = ps.get_pipeline_model_parallel_group()
        dist.broadcast_object_list(box, src=ps.get_pipeline_model_parallel_last_rank(), group=group)
        return {**box[0], **{k: v for k, v in metrics.items() if k not in box[0]}}
