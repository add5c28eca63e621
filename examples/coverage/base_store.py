"""The SFT base of a unit experiment, kept in the repository so that every session trains
its units from the same weights.

Each session used to rebuild the base by the same seeded SFT. On CPUs of one vendor that gives
the same bits, but CPUs of two vendors give other bits even under the pinned kernels, so the
units of two sessions could start from two different bases (``long_units.base_note`` warns),
and the 800-step base of the long experiment costs 40+ minutes of a session each time.

:func:`save` packs the base (its latest checkpoint step, the ``latest`` pointer and the
countdown splits) into ``<store>/weights.tar.gz`` and writes ``<store>/manifest.json``: the
settings it was trained with, the archive's sha256, the tensors' digest
(``long_units.digest``) and where it was made. :func:`restore` unpacks it into a new ``--out``
instead of training: the archive is hostile input until checked, so its sha256 must match the
manifest, only plain files and directories under the base are extracted, and the restored
tensors must have the manifest's digest. A manifest of other settings is refused.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import platform
import shutil
import tarfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import long_units

from reco_megatron.utils.cpu_env import cpu_vendor
from reco_megatron.utils.logging import get_logger

ARCHIVE = "weights.tar.gz"
MANIFEST = "manifest.json"
log = get_logger("examples.coverage.base_store")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _members(base: Path) -> list[Path]:
    """What a restored base needs: the ``latest`` pointer, the step it names (every file) and
    the countdown splits, as paths relative to ``base``."""
    step = (base / "checkpoints" / "latest").read_text().strip()
    files = [Path("checkpoints/latest")]
    files += sorted(
        p.relative_to(base) for p in (base / "checkpoints" / step).rglob("*") if p.is_file()
    )
    files += sorted(p.relative_to(base) for p in (base / "data").glob("*.jsonl"))
    return files


def save(base: Path, store: Path, settings: dict[str, Any]) -> Path:
    """Pack ``base`` into ``store`` (byte-reproducible: sorted members, no times or owners) and
    write its manifest; returns the archive. An existing archive is kept (see :func:`restore`)."""
    store.mkdir(parents=True, exist_ok=True)
    archive = store / ARCHIVE
    tmp = store / f".{ARCHIVE}.{os.getpid()}.tmp"
    # mtime=0 in the gzip header too, so the same base gives the same bytes
    with (
        tmp.open("wb") as raw,
        gzip.GzipFile(fileobj=raw, mode="wb", mtime=0, compresslevel=9) as gz,
        tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as tar,
    ):
        for rel in _members(base):
            data = (base / rel).read_bytes()
            info = tarfile.TarInfo(rel.as_posix())
            info.size, info.mode, info.mtime = len(data), 0o644, 0
            tar.addfile(info, io.BytesIO(data))
    step = (base / "checkpoints" / "latest").read_text().strip()
    manifest = {
        "settings": settings,
        "sha256": _sha256(tmp),
        "bytes": tmp.stat().st_size,
        "digest": long_units.digest(base / "checkpoints" / step),
        "step": step,
        "made": {
            "date": time.strftime("%Y-%m-%d", time.gmtime()),
            "cpu_vendor": cpu_vendor(),
            "machine": platform.machine(),
        },
    }
    tmp.replace(archive)
    written = store / f".{MANIFEST}.{os.getpid()}.tmp"  # a manifest is whole or absent
    written.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    written.replace(store / MANIFEST)
    return archive


def check_same_task(path: Path, task: list[str], sft_steps: int) -> dict[str, Any]:
    """An existing ``--out`` keeps its base: refuse other task or SFT settings instead of
    mixing results of two bases. Returns the settings (what a stored base is checked against)."""
    settings = {"task": sorted(task), "sft_steps": sft_steps}
    if path.exists():
        old = json.loads(path.read_text())
        if old != settings:
            raise SystemExit(
                f"{path.parent} was made with {old}, this call asks for {settings}: use the "
                "same --task / --sft-steps, or a new --out"
            )
    else:
        path.write_text(json.dumps(settings))
    return settings


def read_manifest(store: Path) -> dict[str, Any] | None:
    """The manifest under ``store``, or None when no base is stored there."""
    path = store / MANIFEST
    if not path.exists():
        return None
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise SystemExit(f"{path} is not JSON ({e}): restore it from git, or delete {store}") from e
    missing = {"settings", "sha256", "digest", "step"} - set(manifest)
    if missing:
        raise SystemExit(f"{path} lacks {sorted(missing)}: restore it from git, or delete {store}")
    return manifest


def restore(store: Path, base: Path, settings: dict[str, Any]) -> str | None:
    """Unpack the stored base into ``base`` (which must not hold a finished base); returns its
    digest, or None when ``store`` holds none. A partial ``base`` (an interrupted SFT) is moved
    aside, not deleted. Every check failure is a one-line ``SystemExit`` naming the fix."""
    manifest = read_manifest(store)
    if manifest is None:
        return None
    if manifest["settings"] != settings:
        raise SystemExit(
            f"{store / MANIFEST} holds a base made with {manifest['settings']}, this call asks "
            f"for {settings}: use the same --task / --sft-steps, or another --units directory"
        )
    archive = store / ARCHIVE
    if not archive.exists():
        raise SystemExit(f"{archive} is missing (its manifest is there): restore it from git")
    if _sha256(archive) != manifest["sha256"]:
        raise SystemExit(
            f"{archive} does not have the sha256 of {store / MANIFEST} (a damaged or replaced "
            "file): restore both from git"
        )
    step = str(manifest["step"])
    if base.exists():
        aside = base.with_name(f"{base.name}.partial-{time.strftime('%Y%m%d-%H%M%S')}")
        base.rename(aside)
    staging = base.with_name(f".{base.name}.restoring-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    try:
        with tarfile.open(archive, mode="r:gz") as tar:
            for member in tar.getmembers():
                name = Path(member.name)
                if (
                    not (member.isfile() or member.isdir())
                    or name.is_absolute()
                    or ".." in name.parts
                ):
                    raise SystemExit(
                        f"{archive} holds {member.name!r}, not a plain file under the base: "
                        "restore it from git"
                    )
            tar.extractall(staging, filter="data")
        got = long_units.digest(staging / "checkpoints" / step)
        if got != manifest["digest"]:
            raise SystemExit(
                f"{archive} unpacks to tensors of digest {got}, its manifest says "
                f"{manifest['digest']}: restore both from git"
            )
        staging.rename(base)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return manifest["digest"]


def ensure(
    base: Path, store: Path | None, settings: dict[str, Any], build: Callable[[], None]
) -> None:
    """Make ``base`` hold the experiment's SFT base: restored from ``store`` when one is stored
    there, else built (``build``, the seeded SFT) and then stored. ``store=None``: built only.
    A finished ``base`` whose tensors are not the stored ones is refused (its units would not
    be comparable with the committed ones)."""
    latest = base / "checkpoints" / "latest"
    manifest = read_manifest(store) if store is not None else None
    if not latest.exists() and manifest is not None:
        restore(store, base, settings)
        log.info("restored the SFT base %s from %s", manifest["digest"], store / ARCHIVE)
    if not latest.exists():
        build()
    if store is None:
        return
    if manifest is None:
        archive = save(base, store, settings)
        log.info("stored the SFT base in %s (%d bytes): commit it", archive, archive.stat().st_size)
        return
    here = long_units.digest(base / "checkpoints" / latest.read_text().strip())
    if here != manifest["digest"]:
        raise SystemExit(
            f"{base} holds an SFT base of digest {here}, {store / MANIFEST} one of "
            f"{manifest['digest']}: use a new --out (the stored base is restored there)"
        )
