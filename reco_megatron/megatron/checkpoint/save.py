"""Crash-safe save of a training checkpoint: model, optimizer, scheduler, RNG, trainer state.

A checkpoint (layout in ``format``) is written to ``.tmp-step_...`` and renamed when every rank
has finished, then ``latest`` is replaced atomically, then old checkpoints beyond ``keep_last``
are removed: a crash (or a second preemption signal) at any point leaves the previous
``latest`` intact. The model part reshards on load (another TP/PP is fine); the distributed
optimizer state is saved ``dp_reshardable`` and must be loaded at the same data-parallel size.

Every file is listed in ``manifest.json`` with its size and CRC-32 (``integrity``), hashed and
fsynced by the rank that wrote it before the directory is renamed; the renamed directory and
``latest`` are fsynced too, so after a power loss ``latest`` never names data that is not on
disk. A save that runs out of disk space raises :class:`CheckpointSpaceError` (free space,
needed space, path) and removes its partial ``.tmp-step_*``; so does
``resume.remove_partial_checkpoints`` at the next start.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException

from reco_megatron.megatron.checkpoint import integrity
from reco_megatron.megatron.checkpoint.format import (
    FORMAT_VERSION,
    PRUNED_PREFIX,
    SFT_PREFIX,
    CheckpointError,
    CheckpointSpaceError,
    checkpoint_name,
    complete_checkpoints,
)
from reco_megatron.megatron.checkpoint.megatron_state import save_model_and_optimizer, state_bytes
from reco_megatron.megatron.checkpoint.ownership import mark_owner, owned_by, remove_tree
from reco_megatron.megatron.checkpoint.rng import rng_state
from reco_megatron.parallel.collectives import (
    all_gather,
    barrier,
    from_rank0,
    rank,
    world_size,
)
from reco_megatron.utils.logging import get_logger

__all__ = ["layout", "save_checkpoint"]

logger = get_logger(__name__)


def layout(engine: Any) -> dict[str, Any]:
    """The model config and parallel layout a checkpoint records (``meta.json``)."""
    from megatron.core import parallel_state as ps

    return {
        "model": asdict(engine.model_cfg),
        "tensor_model_parallel_size": ps.get_tensor_model_parallel_world_size(),
        "pipeline_model_parallel_size": ps.get_pipeline_model_parallel_world_size(),
        "expert_model_parallel_size": ps.get_expert_model_parallel_world_size(),
        "data_parallel_size": ps.get_data_parallel_world_size(),
        "world_size": world_size(),
    }


def save_checkpoint(
    root: str | Path,
    step: int,
    engine: Any,
    trainer_state: dict[str, Any],
    keep_last: int = 3,
    *,
    name: str | None = None,
    group_writable: bool = False,
    run_id: str = "",
) -> Path:
    """Collective: every rank calls it. Returns the final checkpoint directory.

    ``name``: the directory name (default ``step_<step>``; the SFT warm-up passes
    ``sft_<n>``). ``keep_last``: complete checkpoints kept besides ``step_00000000`` (the end
    of the SFT warm-up, never pruned; 0 keeps all). Files and directories are written
    without group/other write permission unless ``group_writable`` (``checkpoint.
    group_writable``): a checkpoint is read by code that trusts it to be what was saved.
    ``run_id``: the run directory's id, written first into the temporary directory
    (``ownership.OWNER``) so that only this run's leftovers are ever removed as debris.

    Raises :class:`CheckpointSpaceError` on every rank when the disk is full (the partial
    directory is removed, ``latest`` is untouched) and :class:`CheckpointError` for any other
    failure to write.
    """
    root = Path(root)
    final = root / (name or checkpoint_name(step))
    with _umask(0 if group_writable else 0o022):
        made = _make_tmp(root, final.name, run_id, group_writable) if rank() == 0 else None
        tmp_name, problem = from_rank0(made)
        if problem is not None:
            raise CheckpointError(problem)
        tmp = root / tmp_name
        return _save(root, tmp, final, step, engine, trainer_state, keep_last)


def _make_tmp(root: Path, name: str, run_id: str, group_writable: bool) -> tuple[str, str | None]:
    """Rank 0: create ``.tmp-<name>`` marked as ``run_id``'s; ``(its name, None)`` or
    ``("", one-line problem)``. A look-alike this run did not write is left alone and a
    suffixed name used."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        if not group_writable:
            _not_group_writable(root)
        tmp = root / f".tmp-{name}"
        if owned_by(tmp, run_id):  # this run's own leftover of an earlier attempt
            remove_tree(tmp)
        n = 1
        while os.path.lexists(tmp):
            tmp, n = root / f".tmp-{name}.{n}", n + 1
        tmp.mkdir()
        mark_owner(tmp, run_id)
        (tmp / "dist").mkdir()
        (tmp / "rng").mkdir()
    except OSError as exc:
        return "", f"cannot start checkpoint {root / name}: {exc}"
    return tmp.name, None


def _save(
    root: Path,
    tmp: Path,
    final: Path,
    step: int,
    engine: Any,
    trainer_state: dict[str, Any],
    keep_last: int,
) -> Path:
    error: BaseException | None = None
    try:
        save_model_and_optimizer(str(tmp / "dist"), engine.unwrapped(), engine.optimizer)
        torch.save(rng_state(), tmp / "rng" / f"rank_{rank():05d}.pt")
    # dist_checkpointing raises torch's CheckpointException (a BaseException) on every rank
    except (Exception, CheckpointException) as exc:
        error = exc
    entries: dict[str, Any] = {}
    # after the attempt: the optimizer's moments exist by now, even when the write failed
    estimate = state_bytes(engine.unwrapped(), engine.optimizer, _layout_dp(engine))
    gathered = all_gather((_describe(error), estimate))
    failures = [f for f, _ in gathered if f is not None]
    if not failures:  # every rank hashes (and fsyncs) the files it wrote, in parallel
        try:
            entries = integrity.hash_owned(tmp, rank(), world_size(), fsync=True)
        except OSError as exc:
            error = exc
        hashed = all_gather((_describe(error), entries))
        failures = [f for f, _ in hashed if f is not None]
        entries = {k: v for _, part in hashed for k, v in part.items()}
    if not failures and rank() == 0:
        try:
            _finish_save(root, tmp, final, engine, step, trainer_state, entries, keep_last)
        except OSError as exc:
            failures = [_describe(exc)]
    failures = from_rank0(failures)
    if failures:
        if rank() == 0:
            remove_tree(tmp)
        barrier()
        message, no_space = integrity.save_failure_message(
            root, final.name, failures, sum(e for _, e in gathered)
        )
        raise (CheckpointSpaceError if no_space else CheckpointError)(message)
    return final


@contextlib.contextmanager
def _umask(clear: int) -> Iterator[None]:
    """Also clear the permission bits ``clear`` from everything created inside (the umask is
    process-wide: it covers dist_checkpointing's writer threads too)."""
    previous = os.umask(0)
    os.umask(previous | clear)
    try:
        yield
    finally:
        os.umask(previous)


def _not_group_writable(path: Path) -> None:
    """Drop group/other write permission from ``path`` when this user owns it."""
    with contextlib.suppress(OSError):
        st = path.stat()
        if st.st_uid == os.getuid() and st.st_mode & 0o022:
            path.chmod(stat.S_IMODE(st.st_mode) & ~0o022)


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
        "layout": layout(engine),
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
    if os.path.lexists(final):  # a save of this step whose 'latest' was never written
        doomed = root / f"{PRUNED_PREFIX}{final.name}"
        os.replace(final, doomed)
        remove_tree(doomed)  # a symlink is unlinked, never followed
    os.replace(tmp, final)
    integrity.fsync_dir(root)
    integrity.write_durable(root / "latest", final.name + "\n")
    _prune(root, keep_last)
    logger.info("saved checkpoint %s (%d files with checksums)", final, len(entries))


def _prune(root: Path, keep_last: int) -> None:
    """Remove the complete checkpoints beyond the newest ``keep_last``, never
    ``step_00000000`` (the end of the SFT warm-up: the base a run is compared with), and the
    ``sft_*`` checkpoints once ``step_00000000`` exists (the warm-up is done). Each is
    renamed to ``.pruned-*`` first (atomic), so an interruption never leaves a half-removed
    checkpoint under its own name; ``resume.remove_partial_checkpoints`` clears leftovers."""
    done = [p for p in complete_checkpoints(root) if p.name != checkpoint_name(0)]
    base_saved = (root / checkpoint_name(0) / "meta.json").exists()
    doomed_sft = [p for p in done if base_saved and p.name.startswith(SFT_PREFIX)]
    kept = done[-keep_last:] if keep_last > 0 else done
    for old in [p for p in done if p not in kept or p in doomed_sft]:
        doomed = root / f"{PRUNED_PREFIX}{old.name}"
        try:
            os.replace(old, doomed)
        except OSError:
            continue
        remove_tree(doomed)
