"""The address file as an attacker on the node would use it, and as a stale one misleads.

A worker (a real ``python -m reco_megatron.rollout_worker`` process) must refuse, in one line
and with exit 2, a file that is malformed, planted by another user, symlinked or readable by
others; a file naming a port that accepts and stays silent must end its wait within the
bound, naming what it waited for. The trainer's writer never follows a planted link and
always leaves mode 0600 in a 0700 directory.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from reco_megatron.rollout.address import ADDRESS_FILE, Address, AddressError, private_dir

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}
KEY = "x" * 40
GOOD = {"host": "127.0.0.1", "port": 1, "run_id": "r", "server_key": KEY,
        "client_public": KEY, "client_secret": KEY}  # fmt: skip


def _worker(address: Path, timeout: float = 5) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "reco_megatron.rollout_worker", "--address", str(address),
           "--worker-id", "0", "--connect-timeout", str(timeout)]  # fmt: skip
    return subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=timeout + 60)


def _one_line(done: subprocess.CompletedProcess) -> str:
    lines = [ln for ln in done.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, done.stderr[-3000:]
    return lines[0]


def _dir(tmp_path: Path) -> Path:
    return private_dir(tmp_path / "rollout")


MALFORMED = [
    ("list", [1, 2], "holds a list"),
    ("null", None, "holds a NoneType"),
    ("number", 7, "holds a int"),
    ("missing key", {k: v for k, v in GOOD.items() if k != "port"}, "has keys"),
    ("port as string", {**GOOD, "port": "80"}, "port must be an integer in 1..65535, got '80'"),
    ("port 70000", {**GOOD, "port": 70000}, "got 70000"),
    ("port -1", {**GOOD, "port": -1}, "got -1"),
    ("host as number", {**GOOD, "host": 5}, "host must be a non-empty string"),
    ("short key", {**GOOD, "server_key": "abc"}, "40-character z85"),
]


@pytest.mark.parametrize(("content", "needle"), [m[1:] for m in MALFORMED],
                         ids=[m[0] for m in MALFORMED])  # fmt: skip
@pytest.mark.dist
def test_a_malformed_address_file_is_refused_in_one_line(
    tmp_path: Path, content: object, needle: str
) -> None:
    path = _dir(tmp_path) / ADDRESS_FILE
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(content, f)
    done = _worker(path)
    line = _one_line(done)
    assert done.returncode == 2 and needle in line and str(path) in line, line


@pytest.mark.dist
def test_a_planted_symlinked_or_open_address_file_is_refused(tmp_path: Path) -> None:
    d = _dir(tmp_path)
    path = d / ADDRESS_FILE
    Address(**GOOD).write(path)
    os.chmod(path, 0o644)
    done = _worker(path)
    assert done.returncode == 2 and "mode 0644, open to other users" in _one_line(done)
    os.chmod(path, 0o600)
    elsewhere = tmp_path / "theirs.json"
    os.replace(path, elsewhere)
    path.symlink_to(elsewhere)
    done = _worker(path)
    assert done.returncode == 2 and "is a symbolic link" in _one_line(done)
    path.unlink()
    if os.getuid() == 0:  # root can plant a file as another user, as that user would
        Address(**GOOD).write(path)
        os.chown(path, 12345, 12345)
        done = _worker(path)
        assert done.returncode == 2 and "belongs to user id 12345" in _one_line(done)
    os.chmod(d, 0o777)  # a directory others can write: anyone could plant the file
    done = _worker(path)
    assert done.returncode == 2 and "the directory has mode 0777" in _one_line(done)


def test_the_writer_never_follows_a_planted_link_and_writes_0600(tmp_path: Path) -> None:
    d = _dir(tmp_path)
    target = tmp_path / "victim"
    target.write_text("untouched")
    (d / ADDRESS_FILE).symlink_to(target)
    old = os.umask(0)
    try:
        Address(**GOOD).write(d / ADDRESS_FILE)
    finally:
        os.umask(old)
    assert target.read_text() == "untouched"
    st = os.lstat(d / ADDRESS_FILE)
    assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
    assert [p.name for p in d.iterdir()] == [ADDRESS_FILE]  # no temporary file left behind
    assert Address.read(d / ADDRESS_FILE) == Address(**GOOD)
    with pytest.raises(AddressError, match="is not JSON"):
        (d / ADDRESS_FILE).unlink()
        (d / ADDRESS_FILE).write_text("{")
        os.chmod(d / ADDRESS_FILE, 0o600)
        Address.read(d / ADDRESS_FILE)


@pytest.mark.dist
def test_a_silent_port_behind_a_stale_address_file_ends_the_wait_in_one_line(
    tmp_path: Path,
) -> None:
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)  # accepts (the kernel completes the handshake) and never answers
        path = _dir(tmp_path) / ADDRESS_FILE
        Address(**{**GOOD, "port": silent.getsockname()[1]}).write(path)
        done = _worker(path, timeout=4)
    line = _one_line(done)
    assert done.returncode == 3, done.stderr[-2000:]
    assert "no trainer to connect to within 4 s" in line and "did not answer" in line, line


def test_the_old_worker_entry_exits_2_naming_the_new_one(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "reco_megatron.rollout.worker", "--address", "x"]
    done = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "python -m reco_megatron.rollout_worker" in _one_line(done)
