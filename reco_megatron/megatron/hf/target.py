"""Where a Hugging Face export may go, checked before any weight is loaded, and how it gets
there without removing anything the export did not create.

:func:`check_target` refuses, in one line naming the user's path: a path that is a file, a
symlink or something else that is not a directory; a non-empty directory (unless
``overwrite``); a place where no directory can be created (read-only, no permission, under a
file) — proven by creating and removing a probe directory there, not guessed from
permissions; and an existing directory on another file system than its parent (a mount
point: the finished export is renamed into place, which cannot cross file systems).
:func:`move_into_place` renames the finished temporary directory onto the target.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from reco_megatron.utils.paths import kind_of

__all__ = ["ExportTargetError", "check_target", "move_into_place"]


class ExportTargetError(ValueError):
    """The export's output path cannot be used (one line naming it and the fix)."""


def _nearest_existing(path: Path) -> Path:
    path = path.absolute()
    while not os.path.lexists(path) and path != path.parent:
        path = path.parent
    return path


def check_target(out: str | Path, *, overwrite: bool = False) -> None:
    """Raise :class:`ExportTargetError` (``FileExistsError`` for a non-empty directory
    without ``overwrite``) when ``out`` cannot receive an export; see the module doc."""
    out = Path(out)
    if os.path.lexists(out):
        if out.is_symlink():
            raise ExportTargetError(
                f"the export target {str(out)!r} is a symlink to {os.readlink(out)!r}: pass "
                "the directory it points to, or a new path"
            )
        if not out.is_dir():
            raise ExportTargetError(
                f"the export target {str(out)!r} is {kind_of(os.stat(out).st_mode)}, not a "
                "directory: choose a new path (an export is a directory of files)"
            )
        if any(out.iterdir()) and not overwrite:
            raise FileExistsError(f"{out} exists and is not empty: pass overwrite or a new path")
        if os.stat(out).st_dev != os.stat(out.absolute().parent).st_dev:
            raise ExportTargetError(
                f"the export target {str(out)!r} is on another file system than its parent "
                "(a mount point): the export is written beside it and renamed into place; "
                "choose a new directory inside it instead"
            )
    base = _nearest_existing(out.absolute().parent)
    if not base.is_dir():
        raise ExportTargetError(
            f"cannot create the export {str(out)!r}: {str(base)!r} is not a directory"
        )
    try:
        shutil.rmtree(tempfile.mkdtemp(dir=base, prefix=".reco-export-probe."))
    except OSError as exc:
        raise ExportTargetError(
            f"cannot write the export {str(out)!r}: no directory can be created in "
            f"{str(base)!r} ({exc.strerror or exc}); choose a writable place"
        ) from exc


def move_into_place(tmp: Path, out: Path) -> None:
    """Rename ``tmp`` to ``out``. An existing ``out`` (empty, or replaced with overwrite) is
    first renamed aside to a unique name and removed once ``tmp`` is in place."""
    if not os.path.lexists(out):
        os.replace(tmp, out)
        return
    check_target(out, overwrite=True)  # still a directory of its own, on this file system
    aside = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".old-{out.name}."))
    os.replace(out, aside / out.name)
    try:
        os.replace(tmp, out)
    except BaseException:
        os.replace(aside / out.name, out)  # put the previous export back
        aside.rmdir()
        raise
    shutil.rmtree(aside, ignore_errors=True)
