"""Megatron DDP + distributed optimizer + learning-rate schedule, from one typed config.

Reuses megatron-core's own pieces: ``DistributedDataParallel`` (gradient buffers, reduce-scatter
into the distributed optimizer's shards), ``get_megatron_optimizer`` (Adam; on GPU with bf16
params it keeps fp32 main weights, on CPU everything is fp32) and
``OptimizerParamScheduler`` (warm-up, then constant or cosine decay).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch

from reco_megatron.utils.logging import get_logger

logger = get_logger(__name__)


@dataclass(kw_only=True)
class OptimConfig:
    """Adam, gradient clipping and the learning-rate schedule (steps are optimizer steps)."""

    lr: float = 1e-6
    """Peak learning rate (the ReCo/GRPO papers use 1e-6 for 1.5B-8B models)."""
    min_lr: float = 0.0
    """Floor of the cosine decay."""
    weight_decay: float = 0.01
    """Decoupled weight decay (AdamW)."""
    adam_beta1: float = 0.9
    """Adam beta1."""
    adam_beta2: float = 0.999
    """Adam beta2."""
    adam_eps: float = 1e-8
    """Adam epsilon."""
    clip_grad: float = 1.0
    """Global gradient-norm clip (0 disables)."""
    lr_warmup_steps: int = 0
    """Linear warm-up from 0 to ``lr`` over this many optimizer steps."""
    lr_decay_style: Literal["constant", "cosine", "linear"] = "constant"
    """After warm-up: constant, or cosine / linear decay to ``min_lr`` at ``lr_decay_steps``."""
    lr_decay_steps: int | None = None
    """Optimizer steps until the end of the decay (default: the run's total optimizer steps)."""
    use_distributed_optimizer: bool = True
    """Shard optimizer state over data-parallel ranks (megatron's distributed optimizer)."""

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"optimizer.lr must be > 0, got {self.lr}")
        if not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"optimizer.min_lr must be in [0, lr={self.lr}], got {self.min_lr}")
        for name in ("adam_beta1", "adam_beta2"):
            value = getattr(self, name)
            if not 0 <= value < 1:
                raise ValueError(f"optimizer.{name} must be in [0, 1), got {value}")
        if self.weight_decay < 0 or self.clip_grad < 0 or self.adam_eps <= 0:
            raise ValueError(
                "optimizer.weight_decay and clip_grad must be >= 0 and adam_eps > 0, got "
                f"{self.weight_decay}, {self.clip_grad}, {self.adam_eps}"
            )
        if self.lr_warmup_steps < 0:
            raise ValueError(f"optimizer.lr_warmup_steps must be >= 0, got {self.lr_warmup_steps}")
        if self.lr_decay_style not in ("constant", "cosine", "linear"):
            raise ValueError(
                f"optimizer.lr_decay_style must be constant, cosine or linear, got "
                f"{self.lr_decay_style!r}"
            )


def wrap_ddp(chunks: list[Any], config: Any, optim: OptimConfig) -> list[Any]:
    """Wrap each model chunk in megatron's ``DistributedDataParallel``."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=optim.use_distributed_optimizer,
        check_for_nan_in_grad=False,  # the trainer's stability guard handles NaN (skip + count)
    )
    return [
        DistributedDataParallel(config, ddp_config, chunk, disable_bucketing=i > 0)
        for i, chunk in enumerate(chunks)
    ]


def build_optimizer(
    ddp_chunks: list[Any], config: Any, optim: OptimConfig, total_steps: int
) -> tuple[Any, Any]:
    """Megatron optimizer over ``ddp_chunks`` and its ``OptimizerParamScheduler``.

    Also wires ``config`` for the schedules: ``finalize_model_grads`` (the DP gradient
    all-reduce and the per-token normalisation, see ``loss_layer``), the DDP ``no_sync``
    context for gradient accumulation over micro-batches, and the loss scaler.
    """
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    opt_config = OptimizerConfig(
        optimizer="adam",
        lr=optim.lr,
        min_lr=optim.min_lr,
        weight_decay=optim.weight_decay,
        adam_beta1=optim.adam_beta1,
        adam_beta2=optim.adam_beta2,
        adam_eps=optim.adam_eps,
        clip_grad=optim.clip_grad,
        use_distributed_optimizer=optim.use_distributed_optimizer,
        bf16=config.bf16,
        fp16=config.fp16,
        params_dtype=config.params_dtype,
    )
    optimizer = get_megatron_optimizer(opt_config, ddp_chunks)
    decay_steps = max(optim.lr_decay_steps or total_steps, optim.lr_warmup_steps + 1, 1)
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if optim.lr_warmup_steps else optim.lr,
        max_lr=optim.lr,
        min_lr=optim.min_lr,
        lr_warmup_steps=optim.lr_warmup_steps,
        lr_decay_steps=decay_steps,
        lr_decay_style=optim.lr_decay_style,
        start_wd=optim.weight_decay,
        end_wd=optim.weight_decay,
        wd_incr_steps=decay_steps,
        wd_incr_style="constant",
    )
    config.finalize_model_grads_func = finalize_model_grads
    no_sync = [chunk.no_sync for chunk in ddp_chunks]
    config.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync
    config.grad_scale_func = optimizer.scale_loss
    return optimizer, scheduler


def current_lr(optimizer: Any) -> float:
    """Learning rate of the first parameter group."""
    groups = optimizer.param_groups
    return float(groups[0]["lr"]) if groups else 0.0


def to_float(value: Any) -> float:
    """A python float from a tensor or number (``nan`` for None)."""
    if value is None:
        return float("nan")
    if isinstance(value, torch.Tensor):
        return float(value.detach().float().item())
    return float(value)
