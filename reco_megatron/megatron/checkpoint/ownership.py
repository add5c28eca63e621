"""What the trainer may delete under a checkpoint root: only what carries its own marker.

A save writes ``.tmp-<name>/`` and, first of all, ``.tmp-<name>/owner.json`` holding the run
id (``<output_dir>/run.json``, ``reco_megatron.trainer.lifecycle.run_dir``); the marker stays in the
finished checkpoint (listed in its manifest), so a checkpoint renamed ``.pruned-<name>`` by
pruning carries it too. At start-up :func:`partial_leftovers` sorts what an interrupted save
or prune left: directories whose ``owner.json`` names this run are removed; anything else
matching those names (another run's, an older release's, a user's ``.tmp-step_mywork/``, a
symlink) is left in place and named in one warning. ``latest.tmp`` is removed only when it
is a small regular file holding a checkpoint name (what ``integrity.write_durable`` writes).

:func:`remove_tree` never follows a symlink: a link is unlinked, not its target emptied.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
from pathlib import Path

from reco_megatron.megatron.checkpoint.format import PREFIX, PRUNED_PREFIX, SFT_PREFIX

__all__ = ["OWNER", "mark_owner", "owned_by", "partial_leftovers", "remove_tree"]

OWNER = "owner.json"
"""The marker file inside a checkpoint (and its temporary directory): ``{"run_id": ...}``."""


def mark_owner(directory: str | Path, run_id: str) -> None:
    """Write ``<directory>/owner.json`` naming ``run_id`` (rank 0, before anything else)."""
    path = Path(directory) / OWNER
    with open(path, "w", encoding="utf-8") as f:
        f.write(json.dumps({"run_id": run_id}) + "\n")


def owned_by(directory: str | Path, run_id: str) -> bool:
    """True when ``directory`` is a real directory (not a symlink) whose marker names
    ``run_id``."""
    directory = Path(directory)
    try:
        if not stat.S_ISDIR(os.lstat(directory).st_mode):
            return False
        marker = directory / OWNER
        if not stat.S_ISREG(os.lstat(marker).st_mode):
            return False
        with open(marker, "rb") as f:
            data = json.loads(f.read(4096).decode("utf-8"))
        return isinstance(data, dict) and data.get("run_id") == run_id
    except (OSError, ValueError):
        return False


def remove_tree(path: str | Path) -> None:
    """Remove ``path``: a symlink or a file is unlinked (its target untouched), a directory
    removed with everything in it; errors are ignored (races with other ranks)."""
    path = Path(path)
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        return
    if stat.S_ISDIR(mode):
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _pointer_tmp(path: Path) -> bool:
    """``latest.tmp`` as ``write_durable`` leaves it: a small regular file, a checkpoint name."""
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode) or path.stat().st_size > 256:
            return False
        text = path.read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError):
        return False
    return not text or (text.startswith((PREFIX, SFT_PREFIX)) and "/" not in text)


def partial_leftovers(root: str | Path, run_id: str) -> tuple[list[Path], list[Path]]:
    """``(this run's leftovers to remove, look-alikes to leave in place)`` under ``root``."""
    root = Path(root)
    patterns = (f".tmp-{PREFIX}*", f".tmp-{SFT_PREFIX}*", f"{PRUNED_PREFIX}*")
    found = [p for pattern in patterns for p in sorted(root.glob(pattern))]
    mine = [p for p in found if owned_by(p, run_id)]
    others = [p for p in found if p not in mine]
    pointer = root / "latest.tmp"
    if os.path.lexists(pointer):
        (mine if _pointer_tmp(pointer) else others).append(pointer)
    return mine, others
