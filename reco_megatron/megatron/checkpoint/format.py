"""The on-disk layout of a checkpoint and how to read its plain parts (no pickle, no torch).

Layout of ``<root>``::

    latest                     # text: the name of the newest complete checkpoint
    sft_00000040/              # taken inside the SFT warm-up (a stop signal), same layout
    step_00000000/             # the end of the SFT warm-up: never pruned by keep_last
    step_00000012/
        meta.json              # format version, step, trainer state (incl. the run's
                               # config), scheduler, model/parallel layout
        manifest.json          # every file's size and CRC-32 (``integrity``); mandatory
                               # from format 2 on
        dist/                  # megatron dist_checkpointing (torch_dist) of model + optimizer
        rng/rank_00003.pt      # per-rank RNG states (python, numpy, torch, cuda, megatron)

Save (``save``), load (``load``), resume with fallback (``resume``), integrity (``integrity``),
RNG states (``rng``), megatron-core's dist_checkpointing across versions (``megatron_state``)
and the restricted reading of its pickles (``safe_pickle``) live beside this module; the
package ``__init__`` lists the public API.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

__all__ = [
    "FORMAT_VERSION",
    "PREFIX",
    "PRUNED_PREFIX",
    "SFT_PREFIX",
    "CheckpointError",
    "CheckpointSpaceError",
    "DamagedCheckpointError",
    "LatestPointerError",
    "UnsafeCheckpointError",
    "checkpoint_name",
    "checkpoint_order",
    "complete_checkpoints",
    "latest_checkpoint",
    "read_latest",
    "read_meta",
    "requires_manifest",
    "sft_checkpoint_name",
]

FORMAT_VERSION = 2
"""Written into ``meta.json``. 2: the manifest is part of the format (a checkpoint without
one, or with a file it does not list, is damaged); 1: written before that (its manifest, when
it has one, is checked; without one it loads with a warning)."""
READABLE_VERSIONS = (1, 2)
PREFIX = "step_"
"""Name prefix of complete RL checkpoint directories (``step_00000012``)."""
SFT_PREFIX = "sft_"
"""Name prefix of checkpoints taken inside the SFT warm-up (``sft_00000040``: after 40 SFT
steps); they come before ``step_00000000`` (the end of the warm-up) in every ordering."""
PRUNED_PREFIX = ".pruned-"
"""A checkpoint being removed by ``keep_last`` is first renamed ``.pruned-<name>``."""
_NAME = re.compile(r"^(sft|step)_(\d{8})$")
MAX_LATEST_BYTES = 256


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, corrupted or incompatible with this run."""


class DamagedCheckpointError(CheckpointError):
    """A file of a checkpoint does not match its manifest (missing, other size, other CRC)."""


class CheckpointSpaceError(CheckpointError):
    """A save ran out of disk space (or quota); the message says how much was free and needed."""


class UnsafeCheckpointError(CheckpointError):
    """A pickled part of a checkpoint names code to run (``safe_pickle``): never loaded, never
    a reason to fall back silently."""


class LatestPointerError(CheckpointError):
    """``<root>/latest`` is empty, not ASCII, not a checkpoint name, or names a checkpoint
    that is not there. ``checkpoint.on_damaged=fallback`` resumes from the newest complete
    checkpoint instead."""


def checkpoint_name(step: int) -> str:
    """Directory name of the checkpoint after optimizer-loop step ``step``."""
    return f"{PREFIX}{step:08d}"


def sft_checkpoint_name(sft_step: int) -> str:
    """Directory name of a checkpoint taken after ``sft_step`` steps of the SFT warm-up."""
    return f"{SFT_PREFIX}{sft_step:08d}"


def checkpoint_order(path: Path) -> tuple[int, int]:
    """Sort key of a checkpoint directory: SFT checkpoints first, then RL steps."""
    match = _NAME.match(path.name)
    if match is None:
        raise ValueError(f"{path.name!r} is not a checkpoint name (step_* or sft_*)")
    return (0 if match.group(1) == "sft" else 1, int(match.group(2)))


def complete_checkpoints(root: str | Path) -> list[Path]:
    """Every ``sft_*`` / ``step_*`` directory under ``root`` that has its ``meta.json``, oldest
    first (SFT checkpoints before ``step_00000000``). A symlink is not one: the trainer
    never makes them, so it neither loads nor prunes through one."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [
        p
        for p in root.iterdir()
        if _NAME.match(p.name) and not p.is_symlink() and (p / "meta.json").exists()
    ]
    return sorted(found, key=checkpoint_order)


def read_latest(root: str | Path) -> str | None:
    """The checkpoint name in ``<root>/latest`` (None when there is no such file).

    Raises :class:`LatestPointerError` (one line, no traceback) when the file is empty, over
    256 bytes, not ASCII, or not a checkpoint name."""
    pointer = Path(root) / "latest"
    try:
        with open(pointer, "rb") as f:
            raw = f.read(MAX_LATEST_BYTES + 1)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise LatestPointerError(f"{pointer} cannot be read ({exc.strerror})") from exc
    text = raw.decode("ascii", errors="replace").strip()
    if not raw.strip():
        problem = "is empty"
    elif len(raw) > MAX_LATEST_BYTES:
        problem = f"is over {MAX_LATEST_BYTES} bytes long"
    elif not raw.isascii():
        problem = f"holds non-ASCII bytes ({raw[:40]!r})"
    elif not _NAME.match(text):
        problem = f"holds {text[:40]!r}, not a checkpoint name like step_00000012"
    else:
        return text
    raise LatestPointerError(
        f"{pointer} {problem}: the pointer to the newest checkpoint is damaged"
    )


def latest_checkpoint(root: str | Path) -> Path | None:
    """The newest complete checkpoint under ``root`` (via ``latest``), or None when there is no
    ``latest``. Raises :class:`LatestPointerError` when ``latest`` is damaged or names a
    checkpoint that is missing or incomplete."""
    root = Path(root)
    name = read_latest(root)
    if name is None:
        return None
    path = root / name
    if path.is_symlink():  # not a pointer problem: no fallback to another checkpoint
        raise CheckpointError(
            f"{root / 'latest'} names {name!r}, a symlink to {os.readlink(path)!r}: a run "
            "resumes only from checkpoints it wrote in its own directory; copy the checkpoint "
            f"in its place, or start from it with checkpoint.init_megatron={str(path)!r}"
        )
    if not (path / "meta.json").exists():
        raise LatestPointerError(
            f"{root / 'latest'} names {name!r} but {path}/meta.json does not exist: the checkpoint "
            "was removed or is incomplete"
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
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
        if not isinstance(meta, dict):
            raise ValueError(f"a JSON {type(meta).__name__}, not an object")
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{meta_path} is corrupted ({exc}); use an older checkpoint") from exc
    if meta.get("format_version") not in READABLE_VERSIONS:
        raise CheckpointError(
            f"{path} has format_version {meta.get('format_version')!r}, this version reads "
            f"{', '.join(map(str, READABLE_VERSIONS))}"
        )
    return meta


def requires_manifest(path: str | Path) -> bool:
    """Whether the checkpoint at ``path`` declares (in ``meta.json``, plain JSON) a format
    whose manifest is mandatory. An unreadable ``meta.json`` counts as mandatory: only a
    checkpoint that says it is of the old format is loaded unverified."""
    try:
        meta = json.loads((Path(path) / "meta.json").read_text(encoding="utf-8"))
        return not (isinstance(meta, dict) and meta.get("format_version") == 1)
    except (OSError, ValueError):
        return True
