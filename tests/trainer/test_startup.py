"""Bad start-up conditions are reported before any compute is spent."""

from __future__ import annotations

from collections import namedtuple
from pathlib import Path

import pytest

from reco_megatron.config import ConfigError
from reco_megatron.megatron.checkpoint.ownership import mark_owner
from reco_megatron.trainer import setup
from reco_megatron.trainer.preflight import load_tokenizer
from tests.tmpfs import small_tmpfs


def test_unwritable_output_dir_is_a_clear_error(tmp_path: Path) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    with pytest.raises(ConfigError, match=r"trainer.output_dir=.*is not writable"):
        setup.prepare_output_dir(blocker / "run")


def test_full_disk_is_a_clear_error(tmp_path: Path, monkeypatch) -> None:
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(setup.shutil, "disk_usage", lambda _: usage(10**9, 10**9, 1024))
    with pytest.raises(ConfigError, match="has only 0 MiB free"):
        setup.prepare_output_dir(tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_stale_partial_checkpoint_is_removed_before_the_space_check(tmp_path: Path) -> None:
    """A save cut short (SIGKILL, full disk) left 40 MiB in .tmp-step_*; on a real 80 MiB
    tmpfs that leaves less than the 64 MiB the start-up check wants, unless it is removed."""
    with small_tmpfs(tmp_path / "disk", "80m") as disk:
        partial = disk / "run" / "checkpoints" / ".tmp-step_00000003" / "dist"
        partial.mkdir(parents=True)
        mark_owner(partial.parent, "")  # as save_checkpoint does first
        (partial / "__0_0.distcp").write_bytes(b"\1" * (40 << 20))
        out = setup.prepare_output_dir(disk / "run")
        assert not (out / "checkpoints" / ".tmp-step_00000003").exists()


def test_unknown_tokenizer_spec(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"neither a SentencePiece \.model file nor a tokenizer"):
        load_tokenizer(str(tmp_path / "missing.txt"))
