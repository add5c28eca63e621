"""Checkpoint integrity for real: flipped bytes in shards and RNG files are refused with the
file named and the previous checkpoint offered (or used, with ``on_damaged="fallback"``);
old checkpoints without a manifest still load; a full disk (a real tmpfs) gives a message
with free space, needed space and the path, and leaves no partial directory."""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
from pathlib import Path

import pytest

from reco_megatron.megatron.checkpoint import (
    CheckpointSpaceError,
    DamagedCheckpointError,
    LatestPointerError,
    integrity,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from reco_megatron.megatron.checkpoint.format import read_latest
from reco_megatron.megatron.checkpoint.ownership import mark_owner
from reco_megatron.megatron.checkpoint.resume import remove_partial_checkpoints, resume_latest
from reco_megatron.testing import run_distributed
from tests.megatron import _reco
from tests.tmpfs import fill, small_tmpfs


def _flip_blocks(path: Path, blocks: int = 20, size: int = 64) -> None:
    """Invert ``blocks`` blocks of ``size`` bytes spread over the file (as the fault trials did)."""
    data = bytearray(path.read_bytes())
    step = max(len(data) // (blocks + 1), size)
    for i in range(1, blocks + 1):
        at = min(i * step, len(data) - size)
        data[at : at + size] = bytes(b ^ 0xFF for b in data[at : at + size])
    path.write_bytes(bytes(data))


# ---------------------------------------------------------------- no processes, no megatron
def test_manifest_catches_flips_truncation_and_missing_files(tmp_path) -> None:
    (tmp_path / "dist").mkdir()
    (tmp_path / "rng").mkdir()
    for name, size in (("dist/__0_0.distcp", 5000), ("dist/__1_0.distcp", 300), ("meta.json", 9)):
        (tmp_path / name).write_bytes(os.urandom(size))
    (tmp_path / "rng/rank_00001.pt").write_bytes(b"rng")
    entries = {}
    for rank in (0, 1):
        entries |= integrity.hash_owned(tmp_path, rank, 2)
    assert set(entries) == set(integrity.list_files(tmp_path))
    manifest = {"files": entries}
    assert integrity.verify_owned(tmp_path, manifest, 0, 2) == []
    assert integrity.verify_owned(tmp_path, manifest, 1, 2) == []
    # rank 1 owns its shard and its RNG file; a 1-rank load verifies everything on rank 0
    assert integrity.owner("dist/__1_0.distcp", 2) == 1 == integrity.owner("rng/rank_00001.pt", 2)
    assert integrity.owner("dist/__1_0.distcp", 1) == 0 == integrity.owner("dist/.metadata", 2)

    _flip_blocks(tmp_path / "dist/__0_0.distcp", blocks=1, size=1)  # one byte
    (tmp_path / "rng/rank_00001.pt").write_bytes(b"rn")
    (tmp_path / "meta.json").unlink()
    problems = integrity.verify_owned(tmp_path, manifest, 0, 1)
    assert len(problems) == 3
    assert any("__0_0.distcp: crc32" in p for p in problems), problems
    assert any("rank_00001.pt: size 2 bytes, the manifest says 3" in p for p in problems)
    assert any("meta.json: missing" in p for p in problems)


def test_no_space_is_recognised_through_wrapping() -> None:
    full = OSError(errno.ENOSPC, "No space left on device")
    try:
        try:
            raise full
        except OSError as exc:
            raise RuntimeError("Worker failure") from exc
    except RuntimeError as wrapped:
        assert integrity.is_no_space(wrapped)
    # across ranks only the text survives pickling
    assert integrity.is_no_space(RuntimeError("Worker failure: [Errno 28] No space left on device"))
    assert not integrity.is_no_space(RuntimeError("Worker failure: [Errno 13] Permission denied"))


def test_write_durable_replaces_atomically(tmp_path) -> None:
    target = tmp_path / "latest"
    integrity.write_durable(target, "step_00000001\n")
    integrity.write_durable(target, "step_00000002\n")
    assert target.read_text() == "step_00000002\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest"]


def test_stale_partials_are_removed_at_start(tmp_path) -> None:
    (tmp_path / ".tmp-step_00000004" / "dist").mkdir(parents=True)
    mark_owner(tmp_path / ".tmp-step_00000004", "")  # as save_checkpoint does first
    (tmp_path / "latest.tmp").write_text("step_00000004\n")  # as write_durable leaves it
    (tmp_path / "step_00000003").mkdir()
    assert remove_partial_checkpoints(tmp_path) == [".tmp-step_00000004", "latest.tmp"]
    assert [p.name for p in tmp_path.iterdir()] == ["step_00000003"]


# ---------------------------------------------------------------- real saves and loads
def _save_two(rank, world_size, root):
    engine = _reco.build_engine()
    for step, seed in ((1, 1), (2, 2)):
        batch = _reco.dp_share(_reco.rollout_batch(seed=seed))
        prepared, _ = engine.prepare(batch)
        engine.train_on_rollout(prepared)
        save_checkpoint(root, step, engine, {"step": step}, keep_last=3)
    return _reco.full_params(engine)


def _resume(rank, world_size, root, on_damaged):
    engine = _reco.build_engine()
    try:
        path, state = resume_latest(root, engine, on_damaged=on_damaged)
    except DamagedCheckpointError as exc:
        return str(exc)
    return path.name, state, _reco.full_params(engine)


@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory):
    """Checkpoints of steps 1 and 2 written by 2 data-parallel ranks (each hashes its own)."""
    root = tmp_path_factory.mktemp("ckpt") / "checkpoints"
    run_distributed(_save_two, 2, args=(str(root),), timeout=240)
    return root


@pytest.mark.dist
def test_every_file_is_in_the_manifest(two_checkpoints) -> None:
    step = two_checkpoints / "step_00000002"
    manifest = json.loads((step / "manifest.json").read_text())
    assert set(manifest["files"]) == set(integrity.list_files(step))
    assert {"rng/rank_00000.pt", "rng/rank_00001.pt", "meta.json"} <= set(manifest["files"])
    assert any(name.endswith(".distcp") for name in manifest["files"])


@pytest.mark.dist
@pytest.mark.parametrize("target", ["shard", "rng"])
def test_damaged_checkpoint_is_refused_then_fallback(two_checkpoints, target, tmp_path) -> None:
    root = tmp_path / "checkpoints"
    shutil.copytree(two_checkpoints, root)  # a fresh copy per case
    step2 = root / "step_00000002"
    damaged = sorted((step2 / "dist").glob("*.distcp"))[0] if target == "shard" else None
    damaged = damaged or step2 / "rng" / "rank_00001.pt"
    _flip_blocks(damaged)

    message = run_distributed(_resume, 2, args=(str(root), "stop"), timeout=240)[0]
    assert isinstance(message, str), "a damaged checkpoint was loaded"
    assert str(damaged) in message and "crc32" in message
    assert "previous complete checkpoint is" in message and "step_00000001" in message
    assert "checkpoint.on_damaged=fallback" in message
    assert latest_checkpoint(root) == step2  # refusing changes nothing

    results = run_distributed(_resume, 2, args=(str(root), "fallback"), timeout=240)
    for name, state, _ in results:
        assert (name, state) == ("step_00000001", {"step": 1})
    assert latest_checkpoint(root) == root / "step_00000001"
    assert (root / "damaged-step_00000002").is_dir() and not step2.exists()


def _load_weights(rank, world_size, path):
    engine = _reco.build_engine()  # 1 rank: the DP-sharded optimizer state stays unloaded
    return load_checkpoint(path, engine, load_optimizer=False, load_rng=False)


@pytest.mark.dist
def test_checkpoint_without_manifest_loads_with_a_warning(two_checkpoints, tmp_path, caplog):
    root = tmp_path / "checkpoints"
    shutil.copytree(two_checkpoints, root)
    step = root / "step_00000002"  # as written before checksums: format 1, no manifest
    meta = json.loads((step / "meta.json").read_text())
    (step / "meta.json").write_text(json.dumps({**meta, "format_version": 1}))
    (step / "manifest.json").unlink()
    state = run_distributed(_load_weights, 1, args=(str(root / "step_00000002"),), timeout=120)
    assert state[0] == {"step": 2}
    with caplog.at_level(logging.WARNING):
        from reco_megatron.megatron.checkpoint import verify_checkpoint

        assert verify_checkpoint(root / "step_00000002") is False
    assert "loading it unverified" in caplog.text


def _resume_or_message(rank, world_size, root, on_damaged):
    engine = _reco.build_engine()
    try:
        path, state = resume_latest(root, engine, on_damaged=on_damaged)
    except (LatestPointerError, DamagedCheckpointError) as exc:
        return str(exc)
    return path.name, state


@pytest.mark.dist
def test_fallback_over_a_damaged_latest_and_a_damaged_newest(two_checkpoints, tmp_path) -> None:
    root = tmp_path / "checkpoints"
    shutil.copytree(two_checkpoints, root)
    (root / "latest").write_bytes(b"step_0000\xe90002\n")
    _flip_blocks(sorted((root / "step_00000002" / "dist").glob("*.distcp"))[0])
    message = run_distributed(_resume_or_message, 2, args=(str(root), "stop"), timeout=240)[0]
    assert isinstance(message, str) and "non-ASCII" in message
    results = run_distributed(_resume_or_message, 2, args=(str(root), "fallback"), timeout=240)
    assert results == [("step_00000001", {"step": 1})] * 2
    assert read_latest(root) == "step_00000001"  # the pointer names what was loaded
    assert (root / "damaged-step_00000002").is_dir()


def _save_into(rank, world_size, root):
    engine = _reco.build_engine()
    try:
        save_checkpoint(root, 3, engine, {"step": 3})
    except CheckpointSpaceError as exc:
        return str(exc)
    return None


@pytest.mark.dist
def test_disk_full_during_save_says_so(tmp_path) -> None:
    mount = tmp_path / "small"
    with small_tmpfs(mount, "4m"):
        root = mount / "checkpoints"
        fill(mount, leave_bytes=200 * 1024)  # the tiny checkpoint needs ~250 KiB
        message = run_distributed(_save_into, 1, args=(str(root),), timeout=120)[0]
        assert message is not None, "the save did not fail on a full disk"
        assert f"no space left on the device of {root}" in message
        assert "MiB free" in message and "it needs at least" in message
        assert "Worker failure" not in message.split("(")[0]
        assert not list(root.glob(".tmp-*")) and not (root / "latest").exists()
