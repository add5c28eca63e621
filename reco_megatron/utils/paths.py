"""What a path is, in words, for one-line errors: ``"a FIFO, not a regular file"``.

A file the trainer reads (a checkpoint shard, a tokenizer, a config) that is not a regular
file used to be reported as "missing" or as the library's own traceback; :func:`file_problem`
says what it is instead (a symlink names its target)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

__all__ = ["file_problem", "kind_of"]

_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISREG, "a regular file"),
)


def kind_of(mode: int) -> str:
    """``"a FIFO (named pipe)"``, ``"a directory"``, ... for an ``st_mode``."""
    return next((name for test, name in _KINDS if test(mode)), "an unknown kind of file")


def file_problem(path: str | Path, *, allow_symlink: bool = True) -> str | None:
    """None when ``path`` is a regular file (through a symlink if ``allow_symlink``), else
    what it is: ``"does not exist"``, ``"is a FIFO (named pipe), not a regular file"``,
    ``"is a symlink to '/dev/zero' (a character device), not a regular file"``."""
    path = Path(path)
    try:
        link = os.lstat(path)
    except FileNotFoundError:
        return "does not exist"
    except OSError as exc:
        return f"cannot be examined ({exc.strerror})"
    if stat.S_ISLNK(link.st_mode):
        target = os.readlink(path)
        try:
            mode = os.stat(path).st_mode
        except OSError:
            return f"is a symlink to {target!r}, which does not exist"
        if not allow_symlink:
            return f"is a symlink to {target!r} ({kind_of(mode)}), not a regular file"
        if not stat.S_ISREG(mode):
            return f"is a symlink to {target!r} ({kind_of(mode)}), not a regular file"
        return None
    if not stat.S_ISREG(link.st_mode):
        return f"is {kind_of(link.st_mode)}, not a regular file"
    return None
