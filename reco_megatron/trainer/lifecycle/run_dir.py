"""A run directory is the trainer's only when it proves it: ``<output_dir>/run.json``.

The trainer overwrites ``config.yaml``, rewrites ``metrics.jsonl`` on resume and clears the
debris of interrupted saves; in a directory holding someone else's files that is data loss.
So a start accepts ``trainer.output_dir`` only when it is

* new, empty, or holds nothing but a ``trainer.lock`` that is empty or holds a lock record (a
  start killed before it wrote anything; earlier releases left an empty one after every
  exit): a new run; :func:`mark_run_directory` writes ``run.json`` (a random run
  id, the time and the host) right after the run lock is taken, before anything else;
* marked: ``run.json`` is a regular file holding a run id;
* a run directory of an earlier release (no ``run.json``): its ``config_history.jsonl``
  starts with a record the trainer wrote (a JSON object with ``from_step`` and ``config``),
  or ``checkpoints/latest`` names a checkpoint there with its ``meta.json``. It is adopted:
  ``run.json`` is written and one line says so.

Anything else is refused with one line (:func:`foreign_files`). The run id is what the
debris of this run's interrupted saves carries (each partial save is named with it):
nothing is removed because of its name alone.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import time
from pathlib import Path
from typing import Any

from reco_megatron.megatron import (
    CheckpointError,
    latest_checkpoint,
    read_meta,
    remove_partial_checkpoints,
)
from reco_megatron.trainer.lifecycle.run_lock import LOCK_NAME, RUN_MARKER, RunLock, RunLockError
from reco_megatron.utils.jsonfile import write_json
from reco_megatron.utils.logging import get_logger
from reco_megatron.utils.paths import file_problem

__all__ = [
    "RUN_MARKER",
    "foreign_files",
    "mark_run_directory",
    "read_run_id",
    "take_run_directory",
]

logger = get_logger(__name__)

_HISTORY = "config_history.jsonl"
_MAX_MARKER_BYTES = 4096


def read_run_id(out: str | Path) -> str | None:
    """The run id in ``<out>/run.json``; None when there is no such file.

    Raises:
        ValueError: it is not a regular file or holds no run id (one line)."""
    path = Path(out) / RUN_MARKER
    kind = file_problem(path, allow_symlink=False)
    if kind == "does not exist":
        return None
    if kind is not None:
        raise ValueError(f"{path} {kind}")
    try:
        with path.open("rb") as f:
            data = json.loads(f.read(_MAX_MARKER_BYTES).decode("utf-8"))
        run_id = data["run_id"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{path} is not a run marker ({type(exc).__name__}: {exc})") from exc
    if not isinstance(run_id, str) or not run_id.isalnum():
        raise ValueError(f"{path} holds run_id={run_id!r}, not a run id")
    return run_id


def _legacy_run(out: Path) -> str | None:
    """What shows that an earlier release's trainer made ``out`` (None: nothing does)."""
    history = out / _HISTORY
    if file_problem(history, allow_symlink=False) is None:
        try:
            with history.open("rb") as f:
                first = json.loads(f.readline(1 << 24).decode("utf-8"))
            if isinstance(first, dict) and {"from_step", "config"} <= first.keys():
                return f"its {_HISTORY}"
        except (OSError, ValueError):
            pass
    latest = out / "checkpoints" / "latest"
    if file_problem(latest, allow_symlink=False) is None:
        try:
            name = latest.read_text(encoding="ascii", errors="replace")[:256].strip()
        except OSError:
            name = ""
        if name and "/" not in name and (out / "checkpoints" / name / "meta.json").is_file():
            return f"its checkpoints/latest ({name})"
    return None


def foreign_files(out: str | Path) -> str | None:
    """None when ``out`` may be used as a run directory, else the one-line refusal."""
    out = Path(out)
    if not out.is_dir():
        return None  # missing (created later) or not a directory (the writability check says)
    try:
        read_run_id(out)
    except ValueError as exc:
        return (
            f"trainer.output_dir={str(out)!r} is not a usable reco-megatron run directory: "
            f"{exc}; choose an empty or new directory"
        )
    if (out / RUN_MARKER).exists() or _legacy_run(out) is not None:
        return None
    entries = sorted(p.name for p in out.iterdir())
    lock = out / LOCK_NAME
    if entries == [] or (entries == [LOCK_NAME] and _lock_only(lock)):
        return None
    shown = ", ".join(entries[:5]) + (", ..." if len(entries) > 5 else "")
    return (
        f"trainer.output_dir={str(out)!r} is not a reco-megatron run directory: it holds files "
        f"the trainer did not write ({shown}; no {RUN_MARKER}); choose an empty or new directory"
    )


def _lock_only(path: Path) -> bool:
    """An empty lock file, or one holding a lock record (a start killed before run.json)."""
    if file_problem(path, allow_symlink=False) is not None or path.stat().st_size > 4096:
        return False
    text = path.read_text(encoding="utf-8", errors="replace").strip()
    try:
        return not text or {"host", "pid"} <= json.loads(text).keys()
    except (ValueError, AttributeError):
        return False


def mark_run_directory(out: str | Path) -> str:
    """The run id of ``out`` (rank 0, holding the run lock, after :func:`foreign_files`
    passed): read from ``run.json``, or a new one written there (a new run, or an earlier
    release's run directory, adopted with one line)."""
    out = Path(out)
    run_id = read_run_id(out)
    if run_id is not None:
        return run_id
    legacy = _legacy_run(out)
    run_id = secrets.token_hex(8)
    marker = {
        "run_id": run_id,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "adopted": legacy is not None,
    }
    write_json(out / RUN_MARKER, marker)
    if legacy is not None:
        logger.info(
            "%s was made by an earlier release (%s shows it): marked it as run %s in %s",
            out,
            legacy,
            run_id,
            RUN_MARKER,
        )
    return run_id


def take_run_directory(out_dir: str | Path, rank: int) -> tuple[RunLock | None, str]:
    """Global rank 0 proves ``out_dir`` is (or becomes) this trainer's run directory
    (``run_dir``: a new or empty directory, or one marked ``run.json``; never one holding
    files the trainer did not write) and takes its lock; every rank learns the outcome
    (collective) and raises the same :class:`RunLockError` (busy) or ``ConfigError`` (not
    a run directory, not writable). Returns ``(the held lock on rank 0, None elsewhere;
    the run id)``."""
    from reco_megatron.config import ConfigError
    from reco_megatron.parallel.collectives import from_rank0

    lock, outcome = None, None
    if rank == 0:
        lock, outcome = _take(Path(out_dir))
    outcome = from_rank0(outcome)
    kind, message = outcome
    if kind == "ok":
        return lock, message
    raise RunLockError(message) if kind == "busy" else ConfigError([message])


def _take(out: Path) -> tuple[RunLock | None, tuple[str, str]]:
    # A foreign directory is refused before the lock file is created in it; when a lock
    # file is there already, a live holder is reported first (then the directory checked).
    had_lock = os.path.lexists(out / LOCK_NAME)
    problem = None if had_lock else foreign_files(out)
    if had_lock and not _lock_only(out / LOCK_NAME):  # not a lock file: never write to it
        problem = foreign_files(out) or f"{out / LOCK_NAME} is not a lock file of the trainer"
    if problem is not None:
        return None, ("foreign", problem)
    try:
        lock = RunLock(out).acquire()
    except RunLockError as exc:
        return None, ("busy", str(exc))
    except OSError as exc:
        return None, ("unwritable", _unwritable(out, exc))
    problem = foreign_files(out) if had_lock else None
    if problem is not None:
        lock.release()
        return None, ("foreign", problem)
    try:
        return lock, ("ok", mark_run_directory(out))
    except (OSError, ValueError) as exc:
        lock.release(failed_start=True)
        return None, ("unwritable", _unwritable(out, exc))


def _unwritable(out: Path, exc: Exception) -> str:
    reason = exc.strerror if isinstance(exc, OSError) else str(exc)
    return (
        f"trainer.output_dir={str(out)!r} is not writable ({reason}): choose "
        "another directory with trainer.output_dir=..."
    )


def latest_trainer_state(root: Path) -> tuple[str | None, dict[str, Any] | None]:
    """Name and trainer state (plain JSON) of the checkpoint ``root/latest`` names, or
    ``(None, None)`` when there is none or it cannot be read (the resume then says why)."""
    try:
        path = latest_checkpoint(root)
        return (path.name, read_meta(path).get("trainer_state") or {}) if path else (None, None)
    except CheckpointError:
        return None, None


def clean_aborted_save(root: Path, run_id: str | None) -> tuple[list[str], Path | None]:
    """After a save cut short: remove the partial checkpoints of run ``run_id`` under ``root``
    (None: not a marked run, nothing removed); returns their names and the newest complete
    checkpoint left (None: none, or ``latest`` is damaged)."""
    removed = []
    if root.is_dir() and run_id is not None:
        removed = remove_partial_checkpoints(root, quiet=True, run_id=run_id)
    try:
        latest = latest_checkpoint(root)
    except CheckpointError:
        latest = None
    return removed, latest
