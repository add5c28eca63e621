"""Crash-safe training checkpoints: model, optimizer, scheduler, RNG and trainer state.

Layout of ``<root>``::

    latest                     # text: the name of the newest complete checkpoint
    step_00000012/
        meta.json              # step, trainer state, scheduler, model/parallel layout, version
        dist/                  # megatron dist_checkpointing (torch_dist) of model + optimizer
        rng/rank_00003.pt      # per-rank RNG states (python, numpy, torch, cuda, megatron)

A checkpoint is written to ``.tmp-step_...`` and renamed when every rank has finished, then
``latest`` is replaced atomically, then old checkpoints beyond ``keep_last`` are removed: a
crash (or a second preemption signal) at any point leaves the previous ``latest`` intact. The
model part reshards on load (another TP/PP is fine); the distributed optimizer state is saved
``dp_reshardable`` and must be loaded at the same data-parallel size, which is checked with a
message saying what differs.

Integrity (``checkpoint_integrity``): every file is listed in ``manifest.json`` with its size
and CRC-32, hashed and fsynced by the rank that wrote it before the directory is renamed;
the renamed directory and ``latest`` are fsynced too, so after a power loss ``latest`` never
names data that is not on disk. Loading verifies every file first and refuses a damaged
checkpoint with :class:`DamagedCheckpointError` naming the file;
``checkpoint_resume.resume_latest`` then names the previous complete checkpoint, and with
``on_damaged="fallback"`` moves the damaged one aside (``damaged-step_*``) and resumes from
the newest one that verifies. Checkpoints
written before manifests existed load with a warning. A save that runs out of disk space
raises :class:`CheckpointSpaceError` (free space, needed space, path) and removes its partial
``.tmp-step_*``; so does ``checkpoint_resume.remove_partial_checkpoints`` at the next start.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from reco_megatron.megatron import checkpoint_integrity as integrity
from reco_megatron.megatron.checkpoint_compat import (
    load_model_and_optimizer,
    save_model_and_optimizer,
    state_bytes,
)
from reco_megatron.megatron.checkpoint_rng import rng_state, set_rng_state
from reco_megatron.utils.logging import get_logger

logger = get_logger(__name__)

FORMAT_VERSION = 1
PREFIX = "step_"
"""Name prefix of complete checkpoint directories (``step_00000012``)."""


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, corrupted or incompatible with this run."""


class DamagedCheckpointError(CheckpointError):
    """A file of a checkpoint does not match its manifest (missing, other size, other CRC)."""


class CheckpointSpaceError(CheckpointError):
    """A save ran out of disk space (or quota); the message says how much was free and needed."""


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _all_gather(obj: Any) -> list[Any]:
    """Every rank's ``obj`` (a picklable value), on every rank."""
    if not dist.is_initialized():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _from_rank0(obj: Any) -> Any:
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def checkpoint_name(step: int) -> str:
    """Directory name of the checkpoint after optimizer-loop step ``step``."""
    return f"{PREFIX}{step:08d}"


def latest_checkpoint(root: str | Path) -> Path | None:
    """The newest complete checkpoint under ``root`` (via ``latest``), or None."""
    root = Path(root)
    pointer = root / "latest"
    if not pointer.exists():
        return None
    name = pointer.read_text().strip()
    path = root / name
    if not (path / "meta.json").exists():
        raise CheckpointError(
            f"{pointer} names {name!r} but {path}/meta.json does not exist: the checkpoint was "
            "removed or is incomplete; point 'latest' at another step_* directory or delete it"
        )
    return path


def _layout(engine: Any) -> dict[str, Any]:
    from megatron.core import parallel_state as ps

    return {
        "model": asdict(engine.model_cfg),
        "tensor_model_parallel_size": ps.get_tensor_model_parallel_world_size(),
        "pipeline_model_parallel_size": ps.get_pipeline_model_parallel_world_size(),
        "data_parallel_size": ps.get_data_parallel_world_size(),
        "world_size": dist.get_world_size() if dist.is_initialized() else 1,
    }


def save_checkpoint(
    root: str | Path, step: int, engine: Any, trainer_state: dict[str, Any], keep_last: int = 3
) -> Path:
    """Collective: every rank calls it. Returns the final checkpoint directory.

    Raises :class:`CheckpointSpaceError` on every rank when the disk is full (the partial
    directory is removed, ``latest`` is untouched) and :class:`CheckpointError` for any other
    failure to write.
    """
    root = Path(root)
    final = root / checkpoint_name(step)
    tmp = root / f".tmp-{checkpoint_name(step)}"
    if _rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / "dist").mkdir(parents=True)
        (tmp / "rng").mkdir()
    _barrier()
    error: BaseException | None = None
    try:
        save_model_and_optimizer(str(tmp / "dist"), engine.unwrapped(), engine.optimizer)
        torch.save(rng_state(), tmp / "rng" / f"rank_{_rank():05d}.pt")
    # dist_checkpointing raises torch's CheckpointException (a BaseException) on every rank
    except (Exception, CheckpointException) as exc:
        error = exc
    entries: dict[str, Any] = {}
    # after the attempt: the optimizer's moments exist by now, even when the write failed
    estimate = state_bytes(engine.unwrapped(), engine.optimizer, _layout_dp(engine))
    gathered = _all_gather((_describe(error), estimate))
    failures = [f for f, _ in gathered if f is not None]
    if not failures:  # every rank hashes (and fsyncs) the files it wrote, in parallel
        try:
            entries = integrity.hash_owned(tmp, _rank(), _world(), fsync=True)
        except OSError as exc:
            error = exc
        hashed = _all_gather((_describe(error), entries))
        failures = [f for f, _ in hashed if f is not None]
        entries = {k: v for _, part in hashed for k, v in part.items()}
    if not failures and _rank() == 0:
        try:
            _finish_save(root, tmp, final, engine, step, trainer_state, entries, keep_last)
        except OSError as exc:
            failures = [_describe(exc)]
    failures = _from_rank0(failures)
    if failures:
        if _rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        _barrier()
        message, no_space = integrity.save_failure_message(
            root, final.name, failures, sum(e for _, e in gathered)
        )
        raise (CheckpointSpaceError if no_space else CheckpointError)(message)
    return final


def _layout_dp(engine: Any) -> int:
    from megatron.core import parallel_state as ps

    return ps.get_data_parallel_world_size()


def _describe(exc: BaseException | None) -> tuple[str, bool] | None:
    """A picklable summary of a rank's failure: (message, is a full disk)."""
    if exc is None:
        return None
    return f"{type(exc).__name__}: {exc}"[:2000], integrity.is_no_space(exc)


def _finish_save(
    root: Path,
    tmp: Path,
    final: Path,
    engine: Any,
    step: int,
    trainer_state: dict[str, Any],
    entries: dict[str, Any],
    keep_last: int,
) -> None:
    """Rank 0, after every rank's files are written and hashed: meta.json, the manifest,
    fsync of the directories, rename, then ``latest``."""
    meta = {
        "format_version": FORMAT_VERSION,
        "step": step,
        "optimizer_steps": engine.optimizer_steps,
        "trainer_state": trainer_state,
        "scheduler": engine.scheduler.state_dict(),
        "layout": _layout(engine),
    }
    integrity.write_durable(tmp / "meta.json", json.dumps(meta, indent=1, sort_keys=True))
    size, crc = integrity.file_crc32(tmp / "meta.json")
    entries = {**entries, "meta.json": {"size": size, integrity.ALGORITHM: crc}}
    manifest = {"format": 1, "algorithm": integrity.ALGORITHM, "files": entries}
    missing = set(integrity.list_files(tmp)) - set(entries)
    if missing:
        raise OSError(f"files written but not hashed: {sorted(missing)}")
    text = json.dumps(manifest, indent=1, sort_keys=True)
    integrity.write_durable(tmp / integrity.MANIFEST, text)
    for sub in ("dist", "rng", "."):
        integrity.fsync_dir(tmp / sub)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    integrity.fsync_dir(root)
    integrity.write_durable(root / "latest", final.name + "\n")
    _prune(root, keep_last)
    logger.info("saved checkpoint %s (%d files with checksums)", final, len(entries))


def _prune(root: Path, keep_last: int) -> None:
    if keep_last <= 0:
        return
    done = sorted(p for p in root.glob(f"{PREFIX}*") if (p / "meta.json").exists())
    for old in done[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)


def read_meta(path: str | Path) -> dict[str, Any]:
    """``meta.json`` of a checkpoint, with a clear error when it is missing or unreadable."""
    meta_path = Path(path) / "meta.json"
    if not meta_path.exists():
        raise CheckpointError(
            f"{path} is not a reco-megatron checkpoint (no meta.json): pass a step_* directory "
            "written by save_checkpoint, or its parent holding a 'latest' file"
        )
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{meta_path} is corrupted ({exc}); use an older checkpoint") from exc
    if meta.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{path} has format_version {meta.get('format_version')!r}, this version reads "
            f"{FORMAT_VERSION}"
        )
    return meta


def check_compatible(meta: dict[str, Any], engine: Any, with_optimizer: bool) -> None:
    """Refuse a checkpoint whose model (or, for the optimizer, DP size) differs from ours."""
    saved, current = meta["layout"], _layout(engine)
    diffs = [
        f"model.{k}: checkpoint {saved['model'].get(k)!r} vs config {v!r}"
        for k, v in current["model"].items()
        if k not in ("params_dtype", "init_method_std") and saved["model"].get(k) != v
    ]
    if with_optimizer and saved["data_parallel_size"] != current["data_parallel_size"]:
        diffs.append(
            f"data-parallel size: checkpoint {saved['data_parallel_size']} vs run "
            f"{current['data_parallel_size']} (the distributed optimizer state is sharded by DP; "
            "resume with the same DP size, or load the model weights only)"
        )
    if diffs:
        raise CheckpointError("checkpoint does not match this run:\n  " + "\n  ".join(diffs))


def load_checkpoint(
    path: str | Path, engine: Any, *, load_optimizer: bool = True, load_rng: bool = True
) -> dict[str, Any]:
    """Load a checkpoint into ``engine``; returns the saved trainer state (collective).

    Every file is checked against the manifest first (:func:`verify_checkpoint`): a damaged
    checkpoint raises :class:`DamagedCheckpointError` before anything is loaded.
    """
    path = Path(path)
    verify_checkpoint(path)
    meta = read_meta(path)
    check_compatible(meta, engine, with_optimizer=load_optimizer)
    try:
        load_model_and_optimizer(
            str(path / "dist"), engine.unwrapped(), engine.optimizer if load_optimizer else None
        )
    # dist_checkpointing raises many types for damaged files; torch's CheckpointException
    # derives from BaseException.
    except (Exception, CheckpointException) as exc:
        raise CheckpointError(
            f"could not read the weights of {path} ({type(exc).__name__}: {exc}); the "
            "checkpoint is damaged or was written by another model: use an older one"
        ) from exc
    if load_optimizer:
        engine.scheduler.load_state_dict(meta["scheduler"])
        engine.optimizer_steps = meta["optimizer_steps"]
    else:
        engine.optimizer.reload_model_params()
    engine.sync_reference()
    if load_rng:
        rng_file = path / "rng" / f"rank_{_rank():05d}.pt"
        if not rng_file.exists():
            raise CheckpointError(
                f"{rng_file} is missing: the checkpoint was written with another world size "
                f"({meta['layout']['world_size']} ranks); resume with that many, or pass "
                "load_rng=False"
            )
        set_rng_state(torch.load(rng_file, weights_only=True))
    _barrier()
    logger.info("loaded checkpoint %s (step %d)", path, meta["step"])
    return meta["trainer_state"]


def verify_checkpoint(path: str | Path) -> bool:
    """Check every file of a checkpoint against its manifest (collective: each rank checks
    the files it owns, see ``checkpoint_integrity.owner``). Returns False (with a warning) for
    a checkpoint written before manifests existed; raises :class:`DamagedCheckpointError`
    naming each damaged file."""
    path = Path(path)
    problems: list[str] = []
    try:
        manifest = integrity.read_manifest(path)
    except ValueError as exc:
        manifest, problems = None, [str(exc)]
    if manifest is None and not problems:
        logger.warning(
            "%s has no %s (written before checkpoints had checksums): loading it unverified",
            path,
            integrity.MANIFEST,
        )
        return False
    if manifest is not None:
        problems = integrity.verify_owned(path, manifest, _rank(), _world())
    problems = [p for part in _all_gather(problems) for p in part]
    if problems:
        more = f" (and {len(problems) - 1} more: {'; '.join(problems[1:4])})"
        more = more if problems[1:] else ""
        raise DamagedCheckpointError(
            f"checkpoint {path} is damaged: {problems[0]}{more}; nothing was loaded from it"
        )
    return True
