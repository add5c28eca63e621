"""Checkpoint directories and files that are symlinks or not regular files: a run neither
loads nor prunes through a symlinked step directory, and a shard that is a FIFO or a link to a
device is named for what it is, not "missing"."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from reco_megatron.megatron.checkpoint import (
    CheckpointError,
    complete_checkpoints,
    integrity,
    latest_checkpoint,
    save_checkpoint,
)
from reco_megatron.megatron.checkpoint.ownership import OWNER
from reco_megatron.megatron.checkpoint.save import _prune
from reco_megatron.testing import run_distributed
from tests.megatron import _reco


def _save(rank, world_size, root):
    save_checkpoint(root, 1, _reco.build_engine(), {"step": 1}, run_id="cafe")


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("links") / "checkpoints"
    run_distributed(_save, 1, args=(str(root),), timeout=180)
    return root / "step_00000001"


def test_the_marker_is_part_of_the_checkpoint(saved) -> None:
    assert json.loads((saved / OWNER).read_text()) == {"run_id": "cafe"}
    manifest = integrity.read_manifest(saved)
    assert OWNER in manifest["files"]
    assert integrity.unlisted_files(saved, manifest) == []
    assert sorted(p.name for p in saved.parent.iterdir()) == ["latest", saved.name]


def test_a_symlinked_step_directory_is_refused(saved, tmp_path) -> None:
    """Before: it was loaded from where the link pointed."""
    root = tmp_path / "checkpoints"
    root.mkdir()
    (root / saved.name).symlink_to(saved)
    (root / "latest").write_text(saved.name + "\n")
    with pytest.raises(CheckpointError, match=r"a symlink to .*checkpoint.init_megatron=.*'$"):
        latest_checkpoint(root)
    assert complete_checkpoints(root) == []


def test_pruning_never_follows_or_leaves_links(saved, tmp_path) -> None:
    """Before: the link was renamed .pruned-step_... and left dangling (rmtree fails on it)."""
    root = tmp_path / "checkpoints"
    root.mkdir()
    elsewhere = tmp_path / "elsewhere" / "step_00000002"
    shutil.copytree(saved, elsewhere)
    shutil.copytree(saved, root / "step_00000001")
    (root / "step_00000002").symlink_to(elsewhere)
    shutil.copytree(saved, root / "step_00000003")
    _prune(root, keep_last=1)
    assert sorted(p.name for p in root.iterdir()) == ["step_00000002", "step_00000003"]
    assert (root / "step_00000002").is_symlink() and (elsewhere / "meta.json").is_file()


@pytest.mark.parametrize("kind", ["fifo", "dev-zero"])
def test_a_shard_that_is_not_a_file_says_what_it_is(saved, tmp_path, kind) -> None:
    """Before: a FIFO or a /dev/zero link was reported as "missing"."""
    step = tmp_path / saved.name
    shutil.copytree(saved, step)
    manifest = integrity.read_manifest(step)
    shard = next(n for n in sorted(manifest["files"]) if n.startswith("dist/"))
    (step / shard).unlink()
    if kind == "fifo":
        os.mkfifo(step / shard)
        expected = "is a FIFO (named pipe), not a regular file"
    else:
        (step / shard).symlink_to("/dev/zero")
        expected = "is a symlink to '/dev/zero' (a character device), not a regular file"
    problems = integrity.verify_owned(step, manifest, 0, 1)
    assert problems == [
        f"{step / shard}: {expected} (the checkpoint wrote one; restore it from a copy)"
    ]
