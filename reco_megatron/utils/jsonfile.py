"""JSON result files that a kill at any moment leaves readable.

Long jobs (benchmarks, the device check's steps) write their results as they go, so that a
job stopped by a time limit (SIGTERM, then SIGKILL) keeps what it had measured:

* :func:`write_json` replaces a whole JSON document atomically (a temporary file in the same
  folder, flushed to disk, then ``os.replace``): a reader sees the previous document or the
  new one, never a mix or a truncated file.
* :func:`append_jsonl` appends one JSON object per line, flushed to disk before it returns; a
  kill during the write can tear only the last line, which :func:`read_jsonl` drops.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any


def write_json(path: str | Path, obj: Any, indent: int | None = 1) -> Path:
    """Replace ``path`` with ``obj`` as JSON, atomically (parents created); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(obj, f, indent=indent)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; results are read by whoever fetches them
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def append_jsonl(path: str | Path, row: dict) -> None:
    """Append ``row`` as one line of ``path`` and flush it to disk before returning."""
    line = json.dumps(row) + "\n"
    with open(path, "a", encoding="utf-8") as f:
        f.write(line)
        f.flush()
        os.fsync(f.fileno())


def read_jsonl(path: str | Path) -> tuple[list[dict], int]:
    """The rows of ``path`` and how many lines were unreadable. Only a torn *last* line is
    expected (a kill during :func:`append_jsonl`); an unreadable line elsewhere raises
    ``ValueError`` naming the file and line, since that is damage, not a kill."""
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    rows, torn = [], 0
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as exc:
            if i != len(lines) - 1:
                raise ValueError(f"{path}: line {i + 1} is not JSON ({exc})") from exc
            torn += 1
    return rows, torn
