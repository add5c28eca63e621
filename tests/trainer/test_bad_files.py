"""Files that are not what they claim (a broken tokenizer, a FIFO, a symlink to a device) are
one line and exit 2 at start-up, with no traceback and no output directory."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from reco_megatron.train import main


def _refused(tmp_path: Path, capsys, overrides: list[str]) -> str:
    out = tmp_path / "run"
    code = main(["examples/tiny_cpu.yaml", f"trainer.output_dir={out}", *overrides])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err and not out.exists(), err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (b"\x00garbage\xff" * 50, r"is not a valid model file \(RuntimeError"),
        (b"", r"is not a valid model file \(RuntimeError"),
        ("fifo", r"is a FIFO \(named pipe\), not a regular file"),
        ("devzero", r"is a symlink to '/dev/zero' \(a character device\), not a regular file"),
    ],
    ids=["garbage", "empty", "fifo", "dev-zero-link"],
)
def test_a_broken_tokenizer_is_one_line(tmp_path, capsys, content, expected) -> None:
    """Before: a 33-line traceback (sentencepiece raises RuntimeError)."""
    path = tmp_path / "tok.model"
    if content == "fifo":
        os.mkfifo(path)
    elif content == "devzero":
        path.symlink_to("/dev/zero")
    else:
        path.write_bytes(content)
    line = _refused(tmp_path, capsys, [f"data.tokenizer={path}"])
    assert f"data.tokenizer={str(path)!r}: cannot load it" in line, line
    assert re.search(expected, line), line
