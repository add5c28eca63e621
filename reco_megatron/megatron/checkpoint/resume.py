"""Resuming a run: the newest checkpoint that verifies, and the leftovers of interrupted saves.

:func:`resume_latest` loads ``<root>/latest``; when a file of it fails its checksum it either
refuses, naming the file and the previous complete checkpoint (``on_damaged="stop"``), or
moves the damaged checkpoint aside to ``damaged-step_*`` and goes back one checkpoint at a
time (``on_damaged="fallback"``); the fallback also covers a damaged or missing ``latest``.
:func:`remove_partial_checkpoints` deletes the ``.tmp-*`` directories that a save cut short
by SIGKILL, a second Ctrl-C or a full disk left behind, and the ``.pruned-*`` ones of an
interrupted prune, when they carry this run's marker (``ownership``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from reco_megatron.megatron.checkpoint import integrity
from reco_megatron.megatron.checkpoint.format import (
    DamagedCheckpointError,
    LatestPointerError,
    checkpoint_order,
    complete_checkpoints,
    latest_checkpoint,
)
from reco_megatron.megatron.checkpoint.load import load_checkpoint
from reco_megatron.megatron.checkpoint.ownership import partial_leftovers, remove_tree
from reco_megatron.parallel.collectives import barrier, rank
from reco_megatron.utils.logging import get_logger

__all__ = ["remove_partial_checkpoints", "resume_latest"]

logger = get_logger(__name__)


def resume_latest(
    root: str | Path, engine: Any, *, on_damaged: str = "stop"
) -> tuple[Path, dict[str, Any]] | None:
    """Load ``<root>/latest`` into ``engine`` (collective); None when there is no checkpoint.

    When it is damaged: ``on_damaged="stop"`` raises :class:`DamagedCheckpointError` naming
    the file and the previous complete checkpoint; ``"fallback"`` renames the damaged one to
    ``damaged-step_*`` (kept for inspection, never loaded or pruned), points ``latest`` at the
    previous complete checkpoint and tries it, down to the oldest. A ``latest`` that is
    missing while complete checkpoints exist, empty, not a checkpoint name or naming one that
    is gone raises :class:`LatestPointerError` (one line) with ``"stop"``; with
    ``"fallback"`` the newest complete checkpoint that verifies is loaded and ``latest``
    rewritten. Returns ``(checkpoint loaded, trainer state)``.
    """
    root = Path(root)
    path, pointed = _start_point(root, on_damaged)
    while path is not None:
        try:
            state = load_checkpoint(path, engine)
        except DamagedCheckpointError as exc:
            path = _fall_back(root, path, exc, on_damaged)
            continue
        if path != pointed and rank() == 0:  # the pointer was damaged: name what was loaded
            integrity.write_durable(root / "latest", path.name + "\n")
        barrier()
        return path, state
    return None


def _start_point(root: Path, on_damaged: str) -> tuple[Path | None, Path | None]:
    """``(where to start, what latest names)``: the checkpoint ``latest`` names (both the
    same); with ``on_damaged="fallback"`` the newest complete one when ``latest`` is damaged
    or missing (then ``latest`` names nothing usable: None)."""
    found = complete_checkpoints(root)
    try:
        path = latest_checkpoint(root)
        if path is not None or not found:
            return path, path
        problem = f"{root / 'latest'} is missing but {len(found)} complete checkpoint(s) exist"
    except LatestPointerError as exc:
        problem = str(exc)
    if not found:
        raise LatestPointerError(
            f"{problem}, and there is no complete checkpoint under {root}: delete 'latest' to "
            "start over, or restore the checkpoints"
        )
    newest = found[-1]
    if on_damaged != "fallback":
        raise LatestPointerError(
            f"{problem}. The newest complete checkpoint is {newest}: resume from it with "
            f"checkpoint.on_damaged=fallback, or write {newest.name!r} into {root / 'latest'}"
        )
    logger.warning(
        "%s; resuming from the newest complete checkpoint, %s (checkpoint.on_damaged=fallback)",
        problem,
        newest.name,
    )
    return newest, None


def _fall_back(root: Path, path: Path, exc: DamagedCheckpointError, on_damaged: str) -> Path:
    """The checkpoint before the damaged ``path`` (which is moved aside), or raise."""
    older = [p for p in complete_checkpoints(root) if checkpoint_order(p) < checkpoint_order(path)]
    if not older:
        raise DamagedCheckpointError(
            f"{exc}. There is no older complete checkpoint under {root}: restore the "
            "file from a copy, or start over with checkpoint.resume=false"
        ) from exc
    previous = older[-1]
    if on_damaged != "fallback":
        raise DamagedCheckpointError(
            f"{exc}. The previous complete checkpoint is {previous}: resume from it "
            "with checkpoint.on_damaged=fallback (moves the damaged one aside to "
            f"{root / ('damaged-' + path.name)}), or restore the file from a copy"
        ) from exc
    aside = root / f"damaged-{path.name}"
    n = 1
    while aside.exists():
        aside, n = root / f"damaged-{path.name}.{n}", n + 1
    if rank() == 0:
        os.replace(path, aside)
        integrity.write_durable(root / "latest", previous.name + "\n")
    barrier()
    logger.warning(
        "%s; moved it to %s and falling back to %s (checkpoint.on_damaged=fallback)",
        exc,
        aside.name,
        previous,
    )
    return previous


def remove_partial_checkpoints(
    root: str | Path, *, quiet: bool = False, run_id: str = ""
) -> list[str]:
    """Remove what a save or prune of run ``run_id`` interrupted by a crash, SIGKILL or full
    disk left under ``root`` (``.tmp-*`` / ``.pruned-*`` directories carrying its
    ``owner.json``, and ``latest.tmp``); returns their names. Look-alikes that do not carry
    the marker are left in place and named in a warning (``ownership``). Call it at start,
    before any rank saves (every rank may call it: removal ignores races). ``quiet``: the
    caller reports the names itself."""
    root = Path(root)
    stale, others = partial_leftovers(root, run_id)
    for path in stale:
        remove_tree(path)
    if stale and not quiet:
        logger.warning(
            "removed %d partial checkpoint(s) left by an interrupted save: %s",
            len(stale),
            ", ".join(p.name for p in stale),
        )
    if others:
        logger.warning(
            "left %s in %s: named like a partial checkpoint but not marked as this run's "
            "(an older release's or not the trainer's); delete it yourself if it is debris",
            ", ".join(p.name for p in others),
            root,
        )
    return [p.name for p in stale]
