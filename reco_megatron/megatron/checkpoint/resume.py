"""Resuming a run: the newest checkpoint that verifies, and the leftovers of interrupted saves.

:func:`resume_latest` loads ``<root>/latest``; when a file of it fails its checksum it either
refuses, naming the file and the previous complete checkpoint (``on_damaged="stop"``), or
moves the damaged checkpoint aside to ``damaged-step_*`` and goes back one checkpoint at a
time (``on_damaged="fallback"``). :func:`remove_partial_checkpoints` deletes the
``.tmp-step_*`` directories that a save cut short by SIGKILL or a full disk left behind.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from reco_megatron.megatron.checkpoint import integrity
from reco_megatron.megatron.checkpoint.collective import barrier, rank
from reco_megatron.megatron.checkpoint.format import (
    PREFIX,
    DamagedCheckpointError,
    complete_checkpoints,
    latest_checkpoint,
)
from reco_megatron.megatron.checkpoint.load import load_checkpoint
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
    previous complete checkpoint and tries it, down to the oldest.
    Returns ``(checkpoint loaded, trainer state)``.
    """
    root = Path(root)
    path = latest_checkpoint(root)
    while path is not None:
        try:
            return path, load_checkpoint(path, engine)
        except DamagedCheckpointError as exc:
            older = [p for p in complete_checkpoints(root) if p.name < path.name]
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
            path = previous
    return None


def remove_partial_checkpoints(root: str | Path) -> list[str]:
    """Remove the ``.tmp-step_*`` directories (and ``latest.tmp``) that a save interrupted by
    a crash, SIGKILL or full disk left under ``root``; returns their names. Call it at start,
    before any rank saves (every rank may call it: removal ignores races)."""
    root = Path(root)
    stale = sorted(root.glob(f".tmp-{PREFIX}*")) + sorted(root.glob("latest.tmp"))
    for path in stale:
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    if stale:
        logger.warning(
            "removed %d partial checkpoint(s) left by an interrupted save: %s",
            len(stale),
            ", ".join(p.name for p in stale),
        )
    return [p.name for p in stale]
