"""``scripts/find_python.sh``, which the README's install commands use: it finds a Python
>= 3.12 whatever it is called, including a pyenv version that is installed but not selected
(where ``python3.12`` is a shim that fails), and says what to do when there is none."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "find_python.sh"


def _fake(bin_dir: Path, name: str, body: str) -> None:
    path = bin_dir / name
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(0o755)


def _run(bin_dir: Path) -> subprocess.CompletedProcess:
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin"}
    return subprocess.run(["sh", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=60)


def _old_pythons(bin_dir: Path) -> None:
    # What a pyenv machine with 3.11 selected looks like: python3.12 fails, python3 is 3.11.
    _fake(bin_dir, "python3.12", 'echo "pyenv: python3.12: command not found" >&2; exit 127')
    for name in ("python3", "python"):
        _fake(bin_dir, name, 'echo ""')  # answers the version probe: "not >= 3.12"


@pytest.mark.skipif(sys.version_info < (3, 12), reason="needs a Python >= 3.12 to point at")
def test_finds_an_installed_but_unselected_pyenv_version(tmp_path: Path) -> None:
    _old_pythons(tmp_path)
    prefix = Path(sys.prefix)  # a real >= 3.12 installation (or venv) with bin/python3
    _fake(
        tmp_path,
        "pyenv",
        f'case "$1" in versions) printf "3.11.7\\n3.12.0\\n3.12.1\\n3.13.0\\n";; '
        f'prefix) [ "$2" = 3.12.1 ] && echo {prefix};; esac',
    )
    proc = _run(tmp_path)
    assert proc.returncode == 0, proc.stderr
    found = proc.stdout.strip()
    version = subprocess.run(
        [found, "-c", "import sys; print(sys.version_info >= (3, 12))"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert version.stdout.strip() == "True"


def test_says_what_to_do_when_there_is_none(tmp_path: Path) -> None:
    _old_pythons(tmp_path)
    proc = _run(tmp_path)
    if proc.returncode == 0:  # /usr/bin itself has a Python >= 3.12
        pytest.skip(f"this machine's /usr/bin has a Python >= 3.12 ({proc.stdout.strip()})")
    assert proc.returncode == 1 and proc.stdout == ""
    assert "no Python >= 3.12 found" in proc.stderr and "pyenv install 3.12" in proc.stderr
