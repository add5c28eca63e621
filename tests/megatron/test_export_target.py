"""``reco-export`` checks its target before the model loads and never removes what it did not
create (``reco_megatron.megatron.hf.target``)."""

from __future__ import annotations

import logging
import os
import subprocess
from pathlib import Path

import pytest

from reco_megatron.export import main
from reco_megatron.megatron.hf.target import ExportTargetError, check_target, move_into_place
from tests.tmpfs import small_tmpfs


def _export_log(argv: list[str], caplog) -> tuple[int, str]:
    package = logging.getLogger("reco_megatron")  # it does not propagate to the root logger
    package.addHandler(caplog.handler)
    try:
        code = main(argv)
    finally:
        package.removeHandler(caplog.handler)
    return code, caplog.text


def test_a_file_as_target_is_one_line_naming_it(tmp_path, caplog) -> None:
    """Before: a NotADirectoryError traceback."""
    target = tmp_path / "model.txt"
    target.write_text("mine")
    code, text = _export_log([str(tmp_path / "no-checkpoint"), str(target)], caplog)
    assert code == 2
    (line,) = text.strip().splitlines()  # one line: no traceback, nothing after it
    assert f"the export target {str(target)!r} is a regular file, not a directory" in line
    (record,) = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert record.exc_info is None and record.stack_info is None
    assert target.read_text() == "mine"


def test_an_unwritable_place_names_the_users_path_before_loading(caplog) -> None:
    """Before: it failed naming /proc/.tmp-rt_export, after loading the whole model."""
    code, text = _export_log(["/nonexistent-checkpoint", "/proc/rt_export"], caplog)
    assert code == 2
    assert "cannot write the export '/proc/rt_export'" in text
    assert ".tmp-" not in text and "does not exist" not in text  # checked before the checkpoint


def test_a_read_only_file_system_and_a_mount_point(tmp_path) -> None:
    with small_tmpfs(tmp_path / "ro", "1m") as ro:
        done = subprocess.run(["mount", "-o", "remount,ro", str(ro)], capture_output=True)
        if done.returncode != 0:
            pytest.skip(f"cannot remount read-only: {done.stderr!r}")
        with pytest.raises(ExportTargetError, match=r"export .*/ro/hf'.*Read-only"):
            check_target(ro / "hf")
        with pytest.raises(ExportTargetError, match="on another file system than its parent"):
            check_target(ro)


def test_a_symlink_target_is_refused(tmp_path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with pytest.raises(ExportTargetError, match="is a symlink to"):
        check_target(tmp_path / "link")
    with pytest.raises(FileExistsError, match="not empty"):
        (tmp_path / "real" / "x").write_text("x")
        check_target(tmp_path / "real")


def test_moving_into_place_keeps_everything_else(tmp_path) -> None:
    """Before: write_hf removed a sibling ``.tmp-<name>`` folder it had not created."""
    sibling = tmp_path / ".tmp-hf"
    sibling.mkdir()
    (sibling / "keep.txt").write_text("mine")
    for round_ in range(2):  # a new target, then an overwrite of it
        new = Path(os.path.join(tmp_path, f"new{round_}"))
        new.mkdir()
        (new / "config.json").write_text(str(round_))
        move_into_place(new, tmp_path / "hf")
        assert (tmp_path / "hf" / "config.json").read_text() == str(round_)
    assert (sibling / "keep.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".tmp-hf", "hf"]
