"""The stored SFT base of the unit experiments (examples/coverage/base_store.py): a base is
packed byte-reproducibly, restored only when its archive and its tensors match the manifest,
and never mixed with another base."""

from __future__ import annotations

import io
import json
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples" / "coverage"))

import base_store  # noqa: E402

SETTINGS = {"task": ["data.countdown.n_eval=8"], "sft_steps": 3}


def _base(root: Path, weights: bytes = b"tensor-bytes") -> Path:
    """A finished base as the trainer leaves it (the files a restore needs, plus ones it
    does not: logs, the lock, an older step)."""
    base = root / "base"
    step = base / "checkpoints" / "step_00000000"
    (step / "dist").mkdir(parents=True)
    (step / "dist" / "__0_0.distcp").write_bytes(weights)
    (step / "dist" / ".metadata").write_bytes(b"run id 1234")
    (step / "meta.json").write_text("{}")
    (base / "checkpoints" / "step_old").mkdir()
    (base / "checkpoints" / "step_old" / "x").write_text("old")
    (base / "checkpoints" / "latest").write_text("step_00000000\n")
    (base / "data").mkdir()
    (base / "data" / "train.jsonl").write_text('{"q": 1}\n')
    (base / "data" / "eval.jsonl").write_text('{"q": 2}\n')
    (base / "trainer.lock").write_text("")
    return base


def test_save_then_restore_gives_the_same_base(tmp_path: Path) -> None:
    base, store = _base(tmp_path / "a"), tmp_path / "store"
    archive = base_store.save(base, store, SETTINGS)
    first = archive.read_bytes()
    manifest = json.loads((store / "manifest.json").read_text())
    assert manifest["settings"] == SETTINGS and manifest["bytes"] == len(first)
    # byte-reproducible: the same base packs to the same archive
    assert base_store.save(base, store, SETTINGS).read_bytes() == first
    fresh = tmp_path / "b" / "base"
    assert base_store.restore(store, fresh, SETTINGS) == manifest["digest"]
    names = sorted(p.relative_to(fresh).as_posix() for p in fresh.rglob("*") if p.is_file())
    assert names == [
        "checkpoints/latest",
        "checkpoints/step_00000000/dist/.metadata",
        "checkpoints/step_00000000/dist/__0_0.distcp",
        "checkpoints/step_00000000/meta.json",
        "data/eval.jsonl",
        "data/train.jsonl",
    ]
    assert (fresh / "checkpoints/step_00000000/dist/__0_0.distcp").read_bytes() == b"tensor-bytes"


def test_ensure_restores_instead_of_building_and_builds_when_nothing_is_stored(
    tmp_path: Path,
) -> None:
    built: list[Path] = []

    def build(base: Path):
        return lambda: built.append(_base(base.parent))

    store = tmp_path / "store"
    first = tmp_path / "one" / "base"
    base_store.ensure(first, store, SETTINGS, build(first))
    assert built == [first] and (store / "weights.tar.gz").exists()
    second = tmp_path / "two" / "base"
    base_store.ensure(second, store, SETTINGS, build(second))
    assert built == [first]  # restored, not trained
    assert (second / "data" / "train.jsonl").read_text() == '{"q": 1}\n'
    # the classic experiment (no store) only builds
    third = tmp_path / "three" / "base"
    base_store.ensure(third, None, SETTINGS, build(third))
    assert built == [first, third]


def test_a_finished_base_of_other_weights_is_refused(tmp_path: Path) -> None:
    store = tmp_path / "store"
    base_store.save(_base(tmp_path / "a"), store, SETTINGS)
    other = _base(tmp_path / "b", weights=b"other tensors")
    with pytest.raises(SystemExit, match=r"holds an SFT base of digest \w+, .* use a new --out"):
        base_store.ensure(other, store, SETTINGS, lambda: None)


def test_other_settings_are_refused(tmp_path: Path) -> None:
    store = tmp_path / "store"
    base_store.save(_base(tmp_path / "a"), store, SETTINGS)
    with pytest.raises(SystemExit, match=r"holds a base made with .*sft_steps.: 3.*--sft-steps"):
        base_store.restore(store, tmp_path / "b" / "base", {**SETTINGS, "sft_steps": 4})


def test_a_damaged_archive_is_refused_and_nothing_is_restored(tmp_path: Path) -> None:
    store = tmp_path / "store"
    archive = base_store.save(_base(tmp_path / "a"), store, SETTINGS)
    archive.write_bytes(archive.read_bytes()[:-10] + b"0123456789")
    fresh = tmp_path / "b" / "base"
    with pytest.raises(SystemExit, match=r"does not have the sha256 .* restore both from git"):
        base_store.restore(store, fresh, SETTINGS)
    assert not fresh.exists()


def test_an_archive_with_a_path_outside_the_base_is_refused(tmp_path: Path) -> None:
    """A hostile archive whose sha256 was put into the manifest too: the member check stops
    it before anything is written outside the staging directory."""
    store = tmp_path / "store"
    base_store.save(_base(tmp_path / "a"), store, SETTINGS)
    with tarfile.open(store / "weights.tar.gz", "w:gz") as tar:
        info = tarfile.TarInfo("../escaped")
        info.size = 3
        tar.addfile(info, io.BytesIO(b"bad"))
    manifest = json.loads((store / "manifest.json").read_text())
    manifest["sha256"] = base_store._sha256(store / "weights.tar.gz")
    (store / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(SystemExit, match=r"holds '\.\./escaped', not a plain file"):
        base_store.restore(store, tmp_path / "b" / "base", SETTINGS)
    assert not (tmp_path / "b" / "escaped").exists()


def test_tensors_that_do_not_match_the_manifest_are_refused(tmp_path: Path) -> None:
    store = tmp_path / "store"
    base_store.save(_base(tmp_path / "a"), store, SETTINGS)
    manifest = json.loads((store / "manifest.json").read_text())
    manifest["digest"] = "0" * 16
    (store / "manifest.json").write_text(json.dumps(manifest))
    fresh = tmp_path / "b" / "base"
    with pytest.raises(SystemExit, match=r"unpacks to tensors of digest \w+, its manifest says 0+"):
        base_store.restore(store, fresh, SETTINGS)
    assert not fresh.exists()


def test_a_partial_base_is_moved_aside_not_deleted(tmp_path: Path) -> None:
    store = tmp_path / "store"
    base_store.save(_base(tmp_path / "a"), store, SETTINGS)
    partial = tmp_path / "b" / "base"
    (partial / "data").mkdir(parents=True)
    (partial / "data" / "train.jsonl").write_text("interrupted SFT")
    base_store.restore(store, partial, SETTINGS)
    aside = [p for p in partial.parent.iterdir() if p.name.startswith("base.partial-")]
    assert len(aside) == 1 and (aside[0] / "data" / "train.jsonl").read_text() == "interrupted SFT"
    assert (partial / "checkpoints" / "latest").exists()


@pytest.mark.parametrize(
    ("text", "message"),
    [("{not json", r"is not JSON"), ('{"settings": {}}', r"lacks \['digest', 'sha256', 'step'\]")],
)
def test_a_broken_manifest_is_refused(tmp_path: Path, text: str, message: str) -> None:
    store = tmp_path / "store"
    store.mkdir()
    (store / "manifest.json").write_text(text)
    with pytest.raises(SystemExit, match=message):
        base_store.restore(store, tmp_path / "b" / "base", SETTINGS)
