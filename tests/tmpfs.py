"""A real, small, full-able file system for disk-full tests: a tmpfs mounted for the test.

Mounting needs root (CI runs as root on the same kind of machine as development); elsewhere
the test is skipped with the reason, never faked.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


@contextmanager
def small_tmpfs(path: Path, size: str) -> Iterator[Path]:
    """Mount a tmpfs of ``size`` (``mount -o size=``, e.g. ``"2m"``) on ``path``, yield it,
    unmount it."""
    path.mkdir(parents=True, exist_ok=True)
    if shutil.which("mount") is None:
        pytest.skip("no mount command: cannot make a small tmpfs for a disk-full test")
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.skip(
            f"cannot mount a tmpfs ({done.stderr.strip() or done.returncode}): the disk-full "
            "test needs root (CI runs it as root)"
        )
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False, capture_output=True)


def fill(path: Path, leave_bytes: int) -> Path:
    """Write a ballast file under ``path`` until ``leave_bytes`` remain free; returns it."""
    ballast = path / "ballast.bin"
    free = shutil.disk_usage(path).free - leave_bytes
    with open(ballast, "wb") as f:
        while free > 0:
            chunk = min(free, 1 << 20)
            f.write(b"\0" * chunk)
            free -= chunk
    return ballast
