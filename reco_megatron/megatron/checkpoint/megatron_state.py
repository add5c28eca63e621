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

Saves are synchronous and need no helper process. dist_checkpointing collects the write
results of its writer threads through a module-level queue that it creates, on first use, as a
``multiprocessing`` *Manager* queue: a spawned server process (plus Python's resource tracker)
that is only needed for megatron's asynchronous saves. That process dies from the SIGTERM that
Slurm sends to every process of a job step (the next save then fails with BrokenPipeError) and
outlives a SIGKILLed trainer. :func:`save_model_and_optimizer` hands megatron a plain in-process
``queue.Queue`` instead (fresh for every save), so no helper process is ever started.
"""

from __future__ import annotations

import contextlib
import os
import queue
import sys
from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException

from reco_megatron.megatron.checkpoint.format import UnsafeCheckpointError
from reco_megatron.megatron.checkpoint.safe_pickle import (
    check_extra_state,
    refusal_in,
    restricted_loads,
)
from reco_megatron.megatron.compat import versions as compat
from reco_megatron.utils.logging import get_logger

__all__ = [
    "DISTRIB_OPTIM_METADATA",
    "init_optimizer_state",
    "load_model_and_optimizer",
    "save_model_and_optimizer",
    "schedule_of_checkpoint",
    "shutdown_async_writer",
    "state_bytes",
    "untie_adam_steps",
]

logger = get_logger(__name__)

DISTRIB_OPTIM_METADATA: dict[str, str] = {"distrib_optim_sharding_type": "dp_reshardable"}
"""Sharding of the distributed optimizer's state in our checkpoints (see module docstring)."""


def _chunks(model: Any) -> list[Any]:
    return model if isinstance(model, list) else [model]


def _model_states(model: Any) -> dict[str, Any]:
    """``{"model": sd}`` for one chunk, ``{"model0": sd0, "model1": ...}`` for virtual
    pipeline chunks (megatron's own naming)."""
    chunks = _chunks(model)
    if len(chunks) == 1:
        return {"model": chunks[0].sharded_state_dict()}
    return {f"model{i}": c.sharded_state_dict() for i, c in enumerate(chunks)}


def _merged(model_states: dict[str, Any]) -> dict[str, Any]:
    merged: dict[str, Any] = {}
    for part in model_states.values():
        merged.update(part)
    return merged


def _inner_optimizers(optimizer: Any) -> list[Any]:
    """The megatron optimizers inside a ChainedOptimizer (or the optimizer itself)."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def init_optimizer_state(optimizer: Any) -> None:
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


_SCHEDULE_KEYS = ("max_lr", "min_lr")
"""Values megatron's scheduler reads from each param group, which megatron's optimizer also
uses to match saved param groups to the current ones on load."""


@contextlib.contextmanager
def schedule_of_checkpoint(
    optimizer: Any | None, saved: dict[str, Any], current: dict[str, Any]
) -> Iterator[None]:
    """Load the optimizer under the param-group schedule values the checkpoint was saved with,
    then put the run's own values back.

    Megatron matches saved param groups to the current ones by a key that includes
    ``max_lr`` and ``min_lr``; after a change of ``optimizer.lr`` no group matches and the
    load fails (a ``KeyError`` of the group key). ``saved``/``current``: the scheduler state
    of the checkpoint / of this run; a group whose value equals the run's scheduler value is
    given the checkpoint's for the load."""
    if optimizer is None:
        yield
        return
    groups = [g for opt in _inner_optimizers(optimizer) for g in opt.optimizer.param_groups]
    own = [{k: g[k] for k in _SCHEDULE_KEYS if k in g} for g in groups]
    for group, values in zip(groups, own, strict=True):
        for key, value in values.items():
            if key in saved and value == current.get(key):
                group[key] = saved[key]
    try:
        yield
    finally:
        groups = [g for opt in _inner_optimizers(optimizer) for g in opt.optimizer.param_groups]
        for group, values in zip(groups, own, strict=True):
            group.update(values)


def save_model_and_optimizer(
    checkpoint_dir: str, model: Any, optimizer: Any | None = None, **save_kwargs: Any
) -> None:
    """Save ``model`` (a chunk or a list of chunks) and the distributed ``optimizer``.

    Collective: every rank of the job calls it with the same ``checkpoint_dir`` (created if
    missing; dist_checkpointing requires it to exist and be empty).
    """
    os.makedirs(checkpoint_dir, exist_ok=True)
    model_states = _model_states(model)
    state: dict[str, Any] = dict(model_states)
    if optimizer is not None:
        # A never-stepped optimizer has no state to shard: give it Adam's step-0 state (what
        # its first step would create), so a checkpoint can be taken at any point.
        init_optimizer_state(optimizer)
        state["optimizer"] = optimizer.sharded_state_dict(
            _merged(model_states), is_loading=False, metadata=DISTRIB_OPTIM_METADATA
        )
    _in_process_write_results()
    compat.dist_checkpointing_save(state, checkpoint_dir, **save_kwargs)
    logger.info("saved %s to %s", ", ".join(state), checkpoint_dir)


def load_model_and_optimizer(
    checkpoint_dir: str, model: Any, optimizer: Any | None = None, strict: bool = True
) -> None:
    """Load what :func:`save_model_and_optimizer` wrote into ``model`` (and ``optimizer``).

    The model may use a different TP/PP layout than the save (dist_checkpointing reshards);
    the distributed optimizer state must be loaded at the DP size it was saved with. Every
    pickle in the checkpoint is read with an allow-list (``safe_pickle``): one that names
    code raises :class:`~reco_megatron.megatron.checkpoint.format.UnsafeCheckpointError`.
    """
    chunks = _chunks(model)
    model_states = _model_states(model)
    template: dict[str, Any] = dict(model_states)
    if optimizer is not None:
        init_optimizer_state(optimizer)
        template["optimizer"] = optimizer.sharded_state_dict(
            _merged(model_states), is_loading=True, metadata=DISTRIB_OPTIM_METADATA
        )
    with torch.no_grad(), restricted_loads(checkpoint_dir):
        try:
            loaded = compat.dist_checkpointing_load(template, checkpoint_dir)
        except (Exception, CheckpointException) as exc:  # a BaseException: see save
            refusal = refusal_in(exc)
            if refusal is not None:
                raise UnsafeCheckpointError(refusal) from None
            raise
        for key, chunk in zip(model_states, chunks, strict=True):
            check_extra_state(loaded[key], checkpoint_dir)  # before TE unpickles it
            chunk.load_state_dict(loaded[key], strict=strict)
        if optimizer is not None:
            optimizer.load_state_dict(loaded["optimizer"])
    if optimizer is not None:
        untie_adam_steps(optimizer)
    logger.info("loaded %s from %s", ", ".join(template), checkpoint_dir)


_ASYNC_MODULE = "megatron.core.dist_checkpointing.strategies.filesystem_async"


def _in_process_write_results() -> None:
    """Give dist_checkpointing's synchronous writer an in-process results queue (module
    docstring): the writer threads run in this process, so ``put``/``get_nowait`` on a
    ``queue.Queue`` is all it needs. A fresh queue per save: a save that failed between its
    ``put`` and its ``get`` cannot leave a stale result for the next one."""
    import importlib

    module = importlib.import_module(_ASYNC_MODULE)
    if not hasattr(module, "_results_queue"):  # a megatron that no longer keeps one
        logger.warning(
            "%s has no _results_queue: dist_checkpointing may start a helper process that a "
            "process-group SIGTERM kills",
            _ASYNC_MODULE,
        )
        return
    shutdown_async_writer()
    module._results_queue = queue.Queue()


def state_bytes(model: Any, optimizer: Any, dp_size: int) -> int:
    """Bytes this rank adds to a checkpoint, roughly: its model shard (replicated over the
    ``dp_size`` data-parallel ranks, so counted once in ``dp_size``) plus the optimizer state
    it holds (fp32 main parameters and Adam moments, sharded over data-parallel ranks)."""
    model_bytes = sum(
        p.numel() * p.element_size() for chunk in _chunks(model) for p in chunk.parameters()
    )
    opt_bytes = 0
    for opt in _inner_optimizers(optimizer):
        inner = getattr(opt, "optimizer", None)
        if inner is None:
            continue
        for group in inner.param_groups:
            opt_bytes += sum(p.numel() * p.element_size() for p in group["params"])
        for state in inner.state.values():
            opt_bytes += sum(
                t.numel() * t.element_size() for t in state.values() if isinstance(t, torch.Tensor)
            )
    return model_bytes // max(dp_size, 1) + opt_bytes


def shutdown_async_writer() -> None:
    """Stop a multiprocessing Manager that dist_checkpointing started for its results queue
    (none when every save went through :func:`save_model_and_optimizer`), and forget the
    queue. Safe to call when nothing was saved."""
    module = sys.modules.get(_ASYNC_MODULE)
    results = getattr(module, "_results_queue", None)
    if module is None or results is None:
        return
    manager = getattr(results, "_manager", None)
    module._results_queue = None
    if manager is not None:
        manager.shutdown()
