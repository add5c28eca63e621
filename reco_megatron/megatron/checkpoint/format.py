"""The on-disk layout of a checkpoint and how to read its plain parts (no pickle, no torch).

Layout of ``<root>``::

    latest                     # text: the name of the newest complete checkpoint
    step_00000012/
        meta.json              # step, trainer state, scheduler, model/parallel layout, version
        manifest.json          # every file's size and CRC-32 (``integrity``)
        dist/                  # megatron dist_checkpointing (torch_dist) of model + optimizer
        rng/rank_00003.pt      # per-rank RNG states (python, numpy, torch, cuda, megatron)

Save (``save``), load (``load``), resume with fallback (``resume``), integrity (``integrity``),
RNG states (``rng``) and megatron-core's dist_checkpointing across versions
(``megatron_state``) live beside this module; the package ``__init__`` lists the public API.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = [
    "FORMAT_VERSION",
    "PREFIX",
    "CheckpointError",
    "CheckpointSpaceError",
    "DamagedCheckpointError",
    "checkpoint_name",
    "complete_checkpoints",
    "latest_checkpoint",
    "read_meta",
]

FORMAT_VERSION = 1
PREFIX = "step_"
"""Name prefix of complete checkpoint directories (``step_00000012``)."""


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, corrupted or incompatible with this run."""


class DamagedCheckpointError(CheckpointError):
    """A file of a checkpoint does not match its manifest (missing, other size, other CRC)."""


class CheckpointSpaceError(CheckpointError):
    """A save ran out of disk space (or quota); the message says how much was free and needed."""


def checkpoint_name(step: int) -> str:
    """Directory name of the checkpoint after optimizer-loop step ``step``."""
    return f"{PREFIX}{step:08d}"


def complete_checkpoints(root: str | Path) -> list[Path]:
    """Every ``step_*`` directory under ``root`` that has its ``meta.json``, oldest first."""
    return sorted(p for p in Path(root).glob(f"{PREFIX}*") if (p / "meta.json").exists())


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
