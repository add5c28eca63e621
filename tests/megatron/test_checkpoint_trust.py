"""A checkpoint is data: loading one never runs code from it, and its verification cannot be
switched off by deleting a file.

Each malicious pickle carries a payload that would create a directory (``os.mkdir``) when
unpickled by ``pickle.load`` / ``torch.load(weights_only=False)``; the tests assert the load is
refused *and* the directory does not exist, i.e. none of the payload ran. The checkpoints are
otherwise valid (manifest entries updated), as an attacker with write access would leave them.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from reco_megatron.megatron.checkpoint import (
    DamagedCheckpointError,
    UnsafeCheckpointError,
    integrity,
    load_checkpoint,
    save_checkpoint,
)
from reco_megatron.megatron.checkpoint.safe_pickle import (
    check_dcp_metadata,
    check_extra_state,
    load_dcp_metadata,
)
from reco_megatron.testing import run_distributed
from tests.megatron import _reco


class _Payload:
    """Unpickling this calls ``os.mkdir(marker)``: proof that code of the file ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def _refresh_manifest(step: Path, *names: str) -> None:
    """Update the manifest entries of ``names`` (what a careful attacker does)."""
    manifest = json.loads((step / "manifest.json").read_text())
    for name in names:
        size, crc = integrity.file_crc32(step / name)
        manifest["files"][name] = {"size": size, "crc32": crc}
    (step / "manifest.json").write_text(json.dumps(manifest))


def _save(rank, world_size, root):
    os.umask(0o002)  # a group-writable umask, common on shared project folders
    engine = _reco.build_engine()
    save_checkpoint(root, 1, engine, {"step": 1})


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("trust") / "checkpoints"
    run_distributed(_save, 1, args=(str(root),), timeout=180)
    return root / "step_00000001"


def _copy(saved: Path, tmp_path: Path) -> Path:
    step = tmp_path / "checkpoints" / saved.name
    shutil.copytree(saved, step)
    return step


def _poison_metadata(step: Path, marker: Path) -> None:
    with open(step / "dist" / ".metadata", "rb") as f:
        metadata = pickle.load(f)  # our own, trusted file
    metadata.storage_meta.modules = [_Payload(marker)]
    with open(step / "dist" / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    _refresh_manifest(step, "dist/.metadata")


def _poison_byte_item(step: Path, marker: Path) -> None:
    """Point a non-tensor item (torch.load'ed by DCP) at a torch.save of the payload appended
    to its shard."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    with open(step / "dist" / ".metadata", "rb") as f:
        metadata = pickle.load(f)
    kinds = metadata.state_dict_metadata
    index = next(i for i in metadata.storage_data if isinstance(kinds[i.fqn], BytesStorageMetadata))
    info = metadata.storage_data[index]
    buf = io.BytesIO()
    torch.save([_Payload(marker)], buf)
    shard = step / "dist" / info.relative_path
    offset = shard.stat().st_size
    with open(shard, "ab") as f:
        f.write(buf.getvalue())
    metadata.storage_data[index] = _StorageInfo(info.relative_path, offset, len(buf.getvalue()))
    with open(step / "dist" / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    _refresh_manifest(step, "dist/.metadata", f"dist/{info.relative_path}")


def _poison_common(step: Path, marker: Path) -> None:
    """megatron-core 0.16 keeps the common state in ``dist/common.pt`` (``torch.load``)."""
    if not (step / "dist" / "common.pt").exists():
        pytest.skip("this megatron-core keeps the common state inside DCP (the 'bytes' case)")
    torch.save({"x": _Payload(marker)}, step / "dist" / "common.pt")
    _refresh_manifest(step, "dist/common.pt")


def _load(rank, world_size, path, verify):
    from reco_megatron.megatron.checkpoint.megatron_state import load_model_and_optimizer

    engine = _reco.build_engine()
    try:
        if verify:
            load_checkpoint(path, engine)
        else:  # the loader itself, without the up-front check (as a race would leave it)
            load_model_and_optimizer(str(Path(path) / "dist"), engine.unwrapped(), engine.optimizer)
    except UnsafeCheckpointError as exc:
        return f"unsafe: {exc}"
    except Exception as exc:
        return f"other: {type(exc).__name__}: {exc}"
    return "loaded"


# ---------------------------------------------------------------- no processes
def test_metadata_that_names_code_is_refused_before_it_runs(saved, tmp_path) -> None:
    check_dcp_metadata(saved / "dist" / ".metadata")  # what we write passes the allow-list
    step = _copy(saved, tmp_path)
    marker = tmp_path / "pwned"
    _poison_metadata(step, marker)
    with pytest.raises(UnsafeCheckpointError, match=r"asks to import posix\.mkdir"):
        check_dcp_metadata(step / "dist" / ".metadata")
    assert not marker.exists()
    with pytest.raises(UnsafeCheckpointError):
        load_dcp_metadata(io.BytesIO(pickle.dumps({"x": _Payload(marker)})))
    assert not marker.exists()


def test_transformer_engine_extra_state_is_checked_before_te_unpickles_it(tmp_path) -> None:
    marker = tmp_path / "pwned"

    def as_tensor(obj) -> torch.Tensor:
        return torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)

    benign = {"scale_fwd": torch.ones(3), "amax_history_fwd": torch.zeros(2, 3), "step": 4}
    check_extra_state({"decoder.linear._extra_state": as_tensor(benign)}, "ckpt")
    with pytest.raises(UnsafeCheckpointError, match=r"posix\.mkdir"):
        check_extra_state({"decoder.linear._extra_state": as_tensor(_Payload(marker))}, "ckpt")
    assert not marker.exists()


# ---------------------------------------------------------------- real loads
@pytest.mark.dist
@pytest.mark.parametrize(
    ("where", "verify"),
    [("metadata", True), ("metadata", False), ("bytes", False), ("common", False)],
)
def test_poisoned_checkpoint_loads_nothing_and_runs_nothing(saved, tmp_path, where, verify) -> None:
    step = _copy(saved, tmp_path)
    marker = tmp_path / "pwned"
    poison = {"metadata": _poison_metadata, "bytes": _poison_byte_item, "common": _poison_common}
    poison[where](step, marker)
    result = run_distributed(_load, 1, args=(str(step), verify), timeout=180)[0]
    assert result.startswith("unsafe: "), result
    assert "posix.mkdir" in result or "never code" in result, result
    assert not marker.exists(), "the checkpoint's payload ran"


@pytest.mark.dist
@pytest.mark.parametrize("how", ["manifest_deleted", "entry_removed"])
def test_verification_cannot_be_switched_off_by_deleting_a_file(saved, tmp_path, how) -> None:
    step = _copy(saved, tmp_path)
    shard = sorted((step / "dist").glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # a flipped weight byte
    shard.write_bytes(bytes(data))
    if how == "manifest_deleted":
        (step / "manifest.json").unlink()
        expected = "manifest.json: missing"
    else:
        manifest = json.loads((step / "manifest.json").read_text())
        del manifest["files"][f"dist/{shard.name}"]
        (step / "manifest.json").write_text(json.dumps(manifest))
        expected = f"{shard.name}: not in the manifest"
    result = run_distributed(_load, 1, args=(str(step), True), timeout=180)[0]
    assert result.startswith("other: DamagedCheckpointError"), result
    assert expected in result and "nothing was loaded" in result
    assert issubclass(DamagedCheckpointError, Exception)


def test_checkpoint_files_are_not_group_writable(saved) -> None:
    """Saved under umask 002: still nothing group- or other-writable (a group member could
    otherwise replace a file of the owner's next resume)."""
    root = saved.parent
    for path in [root, *root.rglob("*")]:
        assert not path.stat().st_mode & 0o022, f"{path} is group/other-writable"


@pytest.mark.dist
def test_reco_export_refuses_a_poisoned_checkpoint(saved, tmp_path) -> None:
    step = _copy(saved, tmp_path)
    marker = tmp_path / "pwned"
    _poison_metadata(step, marker)
    root = Path(__file__).resolve().parents[2]
    tokenizer = str(root / "examples/tiny/countdown_sp.model")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "reco_megatron.export",
            str(step),
            str(tmp_path / "hf"),
            "--tokenizer",
            tokenizer,
        ],
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert "posix.mkdir" in done.stderr and "Traceback" not in done.stderr
    assert not marker.exists()
