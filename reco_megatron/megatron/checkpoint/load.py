"""Loading a checkpoint into an engine: verify every file, check the model and layout match,
then read model, optimizer, scheduler and RNG states.

Loading verifies every file against ``manifest.json`` first (``integrity``) and refuses a
damaged checkpoint with :class:`DamagedCheckpointError` naming the file, before any byte is
deserialised; ``resume.resume_latest`` then names the previous complete checkpoint, and with
``on_damaged="fallback"`` moves the damaged one aside and resumes from the newest one that
verifies. Checkpoints written before manifests existed load with a warning.
"""

from __future__ import annotations

import logging
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException

from reco_megatron.megatron.checkpoint import integrity
from reco_megatron.megatron.checkpoint.format import (
    FORMAT_VERSION,
    CheckpointError,
    DamagedCheckpointError,
    UnsafeCheckpointError,
    read_meta,
    requires_manifest,
)
from reco_megatron.megatron.checkpoint.megatron_state import (
    load_model_and_optimizer,
    schedule_of_checkpoint,
)
from reco_megatron.megatron.checkpoint.rng import set_rng_state
from reco_megatron.megatron.checkpoint.safe_pickle import check_dcp_metadata
from reco_megatron.megatron.checkpoint.save import layout
from reco_megatron.parallel.collectives import all_gather, barrier, rank, world_size
from reco_megatron.utils.logging import get_logger

__all__ = ["check_compatible", "load_checkpoint", "verify_checkpoint"]

logger = get_logger(__name__)


def check_compatible(meta: dict[str, Any], engine: Any, with_optimizer: bool) -> None:
    """Refuse a checkpoint whose model (or, for the optimizer, DP size) differs from ours."""
    saved, current = meta["layout"], layout(engine)
    diffs = [
        f"model.{k}: checkpoint {saved['model'].get(k)!r} vs config {v!r}"
        for k, v in current["model"].items()
        if k not in ("params_dtype", "init_method_std", "attention_backend")
        and saved["model"].get(k) != v
    ]
    if with_optimizer and saved["data_parallel_size"] != current["data_parallel_size"]:
        diffs.append(
            f"data-parallel size: checkpoint {saved['data_parallel_size']} vs run "
            f"{current['data_parallel_size']} (the distributed optimizer state is sharded by DP; "
            "resume with the same DP size, or load the model weights only)"
        )
    saved_ep = saved.get("expert_model_parallel_size", 1)
    if with_optimizer and saved_ep != current["expert_model_parallel_size"]:
        diffs.append(
            f"expert-parallel size: checkpoint {saved_ep} vs run "
            f"{current['expert_model_parallel_size']} (the experts' optimizer state is sharded "
            "over their data-parallel group; resume with the same EP size, or load the model "
            "weights only)"
        )
    if diffs:
        raise CheckpointError("checkpoint does not match this run:\n  " + "\n  ".join(diffs))


def load_checkpoint(
    path: str | Path, engine: Any, *, load_optimizer: bool = True, load_rng: bool = True
) -> dict[str, Any]:
    """Load a checkpoint into ``engine``; returns the saved trainer state (collective).

    Every file is checked against the manifest first (:func:`verify_checkpoint`): a damaged
    checkpoint raises :class:`DamagedCheckpointError` before anything is loaded, one whose
    pickles name code raises :class:`UnsafeCheckpointError` (``safe_pickle``).

    The learning-rate schedule is the engine's (the run's config): the checkpoint gives the
    optimizer state and the number of scheduler steps taken, so a resume with another
    ``optimizer.lr``, ``min_lr``, warm-up or decay continues from the same step on the new
    schedule (with an unchanged config the result is the same as the checkpoint's own).
    """
    path = Path(path)
    verify_checkpoint(path)
    meta = read_meta(path)
    check_compatible(meta, engine, with_optimizer=load_optimizer)
    optimizer = engine.optimizer if load_optimizer else None
    try:
        with schedule_of_checkpoint(optimizer, meta["scheduler"], engine.scheduler.state_dict()):
            load_model_and_optimizer(str(path / "dist"), engine.unwrapped(), optimizer)
    # dist_checkpointing raises many types for damaged files; torch's CheckpointException
    # derives from BaseException.
    except UnsafeCheckpointError as exc:
        raise UnsafeCheckpointError(
            f"checkpoint {path}: {exc}; nothing was loaded from it"
        ) from None
    except (Exception, CheckpointException) as exc:
        raise CheckpointError(
            f"could not read the weights of {path} ({type(exc).__name__}: {exc}); the "
            "checkpoint is damaged or was written by another model: use an older one"
        ) from exc
    if load_optimizer:
        _load_schedule(engine.scheduler, meta["scheduler"])
        engine.optimizer_steps = meta["optimizer_steps"]
    else:
        engine.optimizer.reload_model_params()
    engine.sync_reference()
    if load_rng:
        rng_file = path / "rng" / f"rank_{rank():05d}.pt"
        if not rng_file.exists():
            raise CheckpointError(
                f"{rng_file} is missing: the checkpoint was written with another world size "
                f"({meta['layout']['world_size']} ranks); resume with that many, or pass "
                "load_rng=False"
            )
        set_rng_state(torch.load(rng_file, weights_only=True))
    barrier()
    logger.info("loaded checkpoint %s (step %d)", path, meta["step"])
    return meta["trainer_state"]


def _load_schedule(scheduler: Any, saved: dict[str, Any]) -> None:
    """Megatron's scheduler state with the run's own values (lr, min_lr, warm-up, decay) and
    the checkpoint's step count; logs each value that differs from the checkpoint's."""
    current = scheduler.state_dict()
    for key in sorted(set(saved) & set(current)):
        if key != "num_steps" and saved[key] != current[key]:
            logger.info(
                "learning-rate schedule: %s %r -> %r (the run's config)",
                key,
                saved[key],
                current[key],
            )
    scheduler.override_opt_param_scheduler = True
    scheduler.use_checkpoint_opt_param_scheduler = False
    quiet = logging.getLogger("megatron.core.optimizer_param_scheduler")
    level = quiet.level
    quiet.setLevel(logging.WARNING)  # megatron logs every overridden value at INFO
    try:
        scheduler.load_state_dict(saved)
    finally:
        quiet.setLevel(level)


def verify_checkpoint(path: str | Path) -> bool:
    """Check every file of a checkpoint against its manifest (collective: each rank checks
    the files it owns, see ``integrity.owner``; rank 0 also looks for files the manifest does
    not list and reads ``dist/.metadata`` with the restricted unpickler).

    Returns False (with a warning) for a checkpoint of format 1 without a manifest (written
    before checksums); raises :class:`DamagedCheckpointError` naming each damaged file (for a
    format-2 checkpoint a missing manifest, or a file missing from it, is damage) and
    :class:`UnsafeCheckpointError` when ``.metadata`` names code."""
    path = Path(path)
    if not (path / "meta.json").exists():
        read_meta(path)  # raises: not a checkpoint
    problems: list[str] = []
    unsafe = None
    try:
        manifest = integrity.read_manifest(path)
    except ValueError as exc:
        manifest, problems = None, [str(exc)]
    if manifest is None and not problems:
        read_meta(path)  # an unreadable meta.json says so itself: its format is unknown
    unverified = manifest is None and not problems and not requires_manifest(path)
    if manifest is None and not problems and not unverified:
        problems = [
            f"{path / integrity.MANIFEST}: missing (meta.json declares format "
            f"{FORMAT_VERSION}, whose checkpoints always have one: without it nothing can be "
            "verified)"
        ]
    if manifest is not None:
        problems = integrity.verify_owned(path, manifest, rank(), world_size())
        if rank() == 0:
            problems += integrity.unlisted_files(path, manifest)
    if rank() == 0 and not problems:
        unsafe = _unsafe_metadata(path)
    gathered = all_gather((problems, unsafe))
    problems = [p for part, _ in gathered for p in part]
    unsafe = next((u for _, u in gathered if u), None)
    if problems:
        more = f" (and {len(problems) - 1} more: {'; '.join(problems[1:4])})"
        more = more if problems[1:] else ""
        raise DamagedCheckpointError(
            f"checkpoint {path} is damaged: {problems[0]}{more}; nothing was loaded from it"
        )
    if unsafe:
        raise UnsafeCheckpointError(f"checkpoint {path}: {unsafe}; nothing was loaded from it")
    if unverified:
        logger.warning(
            "%s has no %s (format 1, written before checkpoints had checksums): loading it "
            "unverified",
            path,
            integrity.MANIFEST,
        )
        return False
    return True


def _unsafe_metadata(path: Path) -> str | None:
    """The refusal of ``dist/.metadata`` by the restricted unpickler, or None. A metadata file
    that is merely unreadable is left to the loader's own error."""
    metadata = path / "dist" / ".metadata"
    if not metadata.is_file():
        return None
    try:
        check_dcp_metadata(metadata)
    except UnsafeCheckpointError as exc:
        return str(exc)
    except (OSError, pickle.UnpicklingError):
        return None
    return None
