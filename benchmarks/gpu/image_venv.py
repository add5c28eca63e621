"""Build a virtual environment that holds only what the lent GPU image holds: the rehearsal's
stand-in for that machine's Python, minus the GPU.

The image (one H200, Python 3.12, no network) has torch, triton, transformers and numpy with
their own runtime dependencies, and pip; it has no megatron-core, transformer-engine, apex,
vLLM, and may lack hypothesis, pyarrow, psutil, sentencepiece and pytest. Installing a second
CUDA torch for the rehearsal would cost gigabytes and minutes, so the environment borrows the
packages from a donor environment that has them (the CI's main venv): a fresh venv, with no
packages, whose site-packages holds symbolic links to exactly the files of those
distributions and of the distributions they require (the requirement closure from their
metadata, extras followed, markers evaluated for this interpreter). Everything else the donor
has (megatron-core, pytest, hypothesis, psutil, sentencepiece, pyarrow, ...) is absent, and
``check.sh`` must bring it as carried wheels, as on the real machine.

Run with the donor's interpreter::

    .venv312/bin/python benchmarks/gpu/image_venv.py .venv-image
    .venv-image/bin/python -c "import torch, transformers"       # works
    .venv-image/bin/python -c "import megatron.core"             # ModuleNotFoundError

Limits of the stand-in: its versions are the donor's (torch 2.14.1, triton 3.8 and
transformers 5.24 in CI), not the image's (torch 2.11.0+cu130, triton 3.6, transformers 5.17),
and it has no GPU, so CUDA-only code paths skip or run on the CPU.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

IMAGE_ROOTS = ("torch", "triton", "transformers", "numpy", "pip")
"""What the image provides (with the closure of their requirements)."""

NEVER = (
    "megatron-core",
    "pytest",
    "hypothesis",
    "psutil",
    "sentencepiece",
    "pyarrow",
    "pyzmq",
    "msgpack",
)
"""What the rehearsal must not have unless carried: refused even if a requirement names it."""


def closure(roots: tuple[str, ...], dists: dict[str, md.Distribution]) -> dict[str, str]:
    """Canonical name -> version of ``roots`` and everything they require (no optional
    extras unless a requirement asks for one)."""
    env = default_environment()
    todo = [(canonicalize_name(r), frozenset()) for r in roots]
    seen: set[tuple[str, frozenset]] = set()
    out: dict[str, str] = {}
    while todo:
        name, extras = todo.pop()
        if (name, extras) in seen:
            continue
        seen.add((name, extras))
        if name not in dists:
            raise SystemExit(f"the donor environment lacks {name!r}, which the image needs")
        dist = dists[name]
        out[name] = dist.version
        for line in dist.requires or []:
            req = Requirement(line)
            wanted = ("", *extras)
            if req.marker and not any(req.marker.evaluate({**env, "extra": e}) for e in wanted):
                continue
            todo.append((canonicalize_name(req.name), frozenset(req.extras)))
    bad = sorted(set(out) & {canonicalize_name(n) for n in NEVER})
    if bad:
        raise SystemExit(f"the image's requirement closure pulls in {bad}: widen NEVER's doc")
    return out


def _owners(dists: dict[str, md.Distribution]) -> dict[tuple[str, ...], set[str]]:
    """Every path prefix inside site-packages -> the distributions with files under it."""
    owners: dict[tuple[str, ...], set[str]] = {}
    for name, dist in dists.items():
        for f in dist.files or []:
            parts = Path(f).parts
            if not parts or parts[0] == "..":  # console scripts in bin/
                continue
            for depth in range(1, len(parts) + 1):
                owners.setdefault(parts[:depth], set()).add(name)
    return owners


def link_tree(src: Path, dst: Path, keep: set[str], owners: dict) -> int:
    """Link into ``dst`` every entry of ``src`` owned only by ``keep``; descend into entries
    shared with other distributions (namespace folders). Returns the number of links."""
    made = 0

    def visit(prefix: tuple[str, ...]) -> None:
        nonlocal made
        for entry in sorted((src.joinpath(*prefix)).iterdir()):
            path = (*prefix, entry.name)
            who = owners.get(path)
            if not who or not (who & keep):
                continue
            target = dst.joinpath(*path)
            if who <= keep:
                target.symlink_to(entry)
                made += 1
            elif entry.is_dir():
                target.mkdir()
                visit(path)

    visit(())
    return made


def build(dest: Path, donor_site: Path, roots: tuple[str, ...]) -> dict[str, str]:
    dists = {
        canonicalize_name(d.metadata["Name"]): d for d in md.distributions(path=[str(donor_site)])
    }
    keep = closure(roots, dists)
    if dest.exists():
        shutil.rmtree(dest)
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", "--without-pip", str(dest)], check=True)
    purelib = "import sysconfig; print(sysconfig.get_path('purelib'))"
    site = Path(
        subprocess.check_output([str(dest / "bin" / "python"), "-c", purelib], text=True).strip()
    )
    owners = _owners(dists)
    links = link_tree(donor_site, site, set(keep), owners)
    listing = "".join(f"{n}=={v}\n" for n, v in sorted(keep.items()))
    (dest / "image-packages.txt").write_text(listing)
    print(f"{dest}: {len(keep)} distributions from {donor_site} ({links} links)", flush=True)
    return keep


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dest", type=Path, help="the venv to (re)create")
    parser.add_argument(
        "--donor-site",
        type=Path,
        default=Path(sysconfig.get_path("purelib")),
        help="site-packages to borrow from (default: this interpreter's)",
    )
    parser.add_argument("--roots", nargs="+", default=list(IMAGE_ROOTS))
    args = parser.parse_args()
    build(args.dest.absolute(), args.donor_site.resolve(), tuple(args.roots))
    os.environ.pop("PYTHONPATH", None)
    probe = (
        "import importlib.util as u, sys\n"
        "have = [m for m in ('torch', 'triton', 'transformers', 'numpy') if not u.find_spec(m)]\n"
        "extra = [m for m in ('megatron', 'pytest', 'hypothesis', 'psutil', 'sentencepiece', "
        "'pyarrow') if u.find_spec(m)]\n"
        "sys.exit(f'missing {have}, present {extra}' if have or extra else 0)\n"
    )
    subprocess.run([str(args.dest / "bin" / "python"), "-I", "-c", probe], check=True)


if __name__ == "__main__":
    main()
