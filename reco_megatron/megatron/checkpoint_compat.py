"""Save and resume model + distributed optimizer with ``dist_checkpointing`` on 0.16 and 0.19.

A resume that reproduces the uninterrupted run needs four things megatron leaves to the caller:

1. ``metadata={"distrib_optim_sharding_type": "dp_reshardable"}``: each rank saves its own
   optimizer shard as a ShardedTensor (no gather); loadable at the same DP size.
2. The optimizer state (``exp_avg``, ``exp_avg_sq``) must exist before the *load template* is
   built, or the template has nothing to load into.
3. Loading runs under ``torch.no_grad()``: the template's parameters are leaf tensors that
   require grad, and the in-place copies into them must not be recorded.
4. After ``load_state_dict`` torch's Adam ``step`` is one tensor shared by every parameter of a
   group; Adam increments it once per parameter, so the next step would use a wrong bias
   correction. :func:`untie_adam_steps` gives each parameter its own copy.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from reco_megatron.megatron import compat
from reco_megatron.utils.logging import get_logger

__all__ = [
    "DISTRIB_OPTIM_METADATA",
    "load_model_and_optimizer",
    "save_model_and_optimizer",
    "untie_adam_steps",
]

logger = get_logger(__name__)

DISTRIB_OPTIM_METADATA: dict[str, str] = {"distrib_optim_sharding_type": "dp_reshardable"}
"""Sharding of the distributed optimizer's state in our checkpoints (see module docstring)."""


def _chunks(model: Any) -> list[Any]:
    return model if isinstance(model, list) else [model]


def _model_sharded_state_dict(model: Any) -> dict[str, Any]:
    chunks = _chunks(model)
    if len(chunks) != 1:
        raise ValueError(
            f"got {len(chunks)} model chunks; virtual pipeline stages are not supported here"
        )
    return chunks[0].sharded_state_dict()


def _inner_optimizers(optimizer: Any) -> list[Any]:
    """The megatron optimizers inside a ChainedOptimizer (or the optimizer itself)."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _init_optimizer_state(optimizer: Any) -> None:
    """Create Adam's moments *and* ``step`` (megatron's ``init_state_fn`` omits ``step``,
    which the distributed optimizer's ``state_dict()`` reads while building the template)."""
    for opt in _inner_optimizers(optimizer):
        init = getattr(opt, "init_state_fn", None)
        if init is None:
            continue
        init(opt.optimizer, getattr(opt, "config", None))
        for state in opt.optimizer.state.values():
            if "exp_avg" in state and "step" not in state:
                state["step"] = torch.zeros((), dtype=torch.float32)


def untie_adam_steps(optimizer: Any) -> int:
    """Give every parameter its own Adam ``step`` tensor, equal to the loaded step.

    The loaded step is read from the param group (where megatron's ``load_state_dict`` puts
    it); a state whose step tensor is shared with another parameter gets a private copy.
    Returns how many states were rewritten.
    """
    fixed = 0
    for opt in _inner_optimizers(optimizer):
        seen: set[int] = set()
        for group in opt.optimizer.param_groups:
            for param in group["params"]:
                state = opt.optimizer.state.get(param, {})
                step = state.get("step")
                if not isinstance(step, torch.Tensor):
                    continue
                if "step" in group:
                    state["step"] = torch.tensor(float(group["step"]), dtype=step.dtype)
                    fixed += 1
                elif id(step) in seen:
                    state["step"] = step.clone()
                    fixed += 1
                seen.add(id(state["step"]))
    return fixed


def save_model_and_optimizer(
    checkpoint_dir: str, model: Any, optimizer: Any | None = None, **save_kwargs: Any
) -> None:
    """Save ``model`` (one chunk) and the distributed ``optimizer`` with ``dist_checkpointing``.

    Collective: every rank of the job calls it with the same ``checkpoint_dir`` (created if
    missing; dist_checkpointing requires it to exist and be empty).
    """
    os.makedirs(checkpoint_dir, exist_ok=True)
    model_sd = _model_sharded_state_dict(model)
    state: dict[str, Any] = {"model": model_sd}
    if optimizer is not None:
        state["optimizer"] = optimizer.sharded_state_dict(
            model_sd, is_loading=False, metadata=DISTRIB_OPTIM_METADATA
        )
    compat.dist_checkpointing_save(state, checkpoint_dir, **save_kwargs)
    logger.info("saved %s to %s", ", ".join(state), checkpoint_dir)


def load_model_and_optimizer(
    checkpoint_dir: str, model: Any, optimizer: Any | None = None, strict: bool = True
) -> None:
    """Load what :func:`save_model_and_optimizer` wrote into ``model`` (and ``optimizer``).

    The model may use a different TP/PP layout than the save (dist_checkpointing reshards);
    the distributed optimizer state must be loaded at the DP size it was saved with.
    """
    chunk = _chunks(model)[0]
    model_sd = _model_sharded_state_dict(model)
    template: dict[str, Any] = {"model": model_sd}
    if optimizer is not None:
        _init_optimizer_state(optimizer)
        template["optimizer"] = optimizer.sharded_state_dict(
            model_sd, is_loading=True, metadata=DISTRIB_OPTIM_METADATA
        )
    with torch.no_grad():
        loaded = compat.dist_checkpointing_load(template, checkpoint_dir)
        chunk.load_state_dict(loaded["model"], strict=strict)
        if optimizer is not None:
            optimizer.load_state_dict(loaded["optimizer"])
    if optimizer is not None:
        untie_adam_steps(optimizer)
    logger.info("loaded %s from %s", ", ".join(template), checkpoint_dir)
