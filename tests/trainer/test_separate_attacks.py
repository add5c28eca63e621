"""Separate placement under attack, end to end: the trainer and its worker as real processes
on loopback, the attacker this test.

* During start-up, a port scan's connect-and-close, a keyless connection held open and a
  pickle that would create a file are sent to the trainer's control port: the run trains to
  the end, the file never appears, no process of the run listens on every interface, and
  another user cannot write into the weight group's rendezvous store.
* A trainer that pushes buckets of another size than the plan it agreed with its worker
  (``_bad_push/sitecustomize.py``): the worker refuses the push before it reads a bucket and
  the run stops resumably (exit 75, a checkpoint, one line naming the worker); one whose
  stream names a tensor the plan does not stops the same way before sending it.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import socket
import struct
import subprocess
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from tests.trainer.test_separate_placement import ENV, ROOT, SEPARATE, _cmd, _workers

pytestmark = pytest.mark.slow


class _Touch:
    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def _wait_for(path: Path, proc: subprocess.Popen, within: float = 120) -> None:
    deadline = time.monotonic() + within
    while not path.exists():
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


def _listening(pids: list[int]) -> list[str]:
    out = []
    for pid in pids:
        try:
            conns = psutil.Process(pid).net_connections("inet")
        except psutil.Error:
            continue
        out += [c.laddr.ip for c in conns if c.status == psutil.CONN_LISTEN]
    return out


def _write_as_another_user(path: Path) -> str:
    """What another user's process gets when it writes a key into ``path``: ``refused``, or
    what let it in. As root the test writes as ``nobody`` (uid 65534); otherwise it checks
    the modes the kernel would apply."""
    if os.getuid() != 0:
        private = (path.stat().st_mode & 0o077, path.parent.stat().st_mode & 0o077) == (0, 0)
        return "refused" if private else "open modes"
    code = f"open({str(path)!r}, 'ab').write(b'reco-weights/x/0')"
    done = subprocess.run(["python3", "-c", code], user=65534, capture_output=True, timeout=30)
    return "refused" if b"PermissionError" in done.stderr else f"written (rc {done.returncode})"


def test_a_port_scan_an_idle_connection_and_a_pickle_during_start_up_change_nothing(
    tmp_path: Path,
) -> None:
    # a directory other users can enter (pytest's own is 0700): only the run's modes protect
    base = Path(tempfile.mkdtemp(prefix="reco-attack-"))
    base.chmod(0o755)
    out, marker = base / "run", tmp_path / "pwned"
    cmd = _cmd(out, "trainer.max_steps=3", *SEPARATE, "rollout.max_staleness=0")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    idle = None
    try:
        address = out / "rollout" / "address.json"
        _wait_for(address, proc)
        port = json.loads(address.read_text())["port"]
        for _ in range(10):
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
        idle = socket.create_connection(("127.0.0.1", port), timeout=5)
        payload = pickle.dumps(_Touch(marker))
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(struct.pack("!i", len(payload)) + payload)
        seen: list[str] = []
        stores: list[str] = []
        while proc.poll() is None and not (out / "metrics.jsonl").exists():
            seen += _listening([proc.pid, *(p.pid for p in _workers(proc.pid))])
            for store in (out / "rollout").glob("weights-*.store"):
                stores.append(_write_as_another_user(store))
            time.sleep(0.5)
        _, err = proc.communicate(timeout=600)
    finally:
        if idle is not None:
            idle.close()
        if proc.poll() is None:
            proc.kill()
        metrics = (out / "metrics.jsonl").read_text() if (out / "metrics.jsonl").exists() else ""
        shutil.rmtree(base, ignore_errors=True)
    assert proc.returncode == 0, err[-3000:]
    assert len(metrics.splitlines()) == 3
    assert not marker.exists()
    assert seen and not {"0.0.0.0", "::"} & set(seen), seen
    assert "refused a connection" in err  # logged, rate-limited
    assert stores and set(stores) == {"refused"}, stores  # the weight group's rendezvous


@pytest.mark.parametrize(
    ("how", "needle"),
    [
        ("buckets", "differ from the plan agreed at setup"),
        ("name", "where the plan has"),
    ],
)
def test_a_push_that_disagrees_with_the_plan_stops_the_run_resumably(
    tmp_path: Path, how: str, needle: str
) -> None:
    out = tmp_path / "run"
    env = {**ENV, "PYTHONPATH": f"{ROOT / 'tests/trainer/_bad_push'}:{ROOT}",
           "RECO_TEST_BAD_PUSH": f"2:{how}"}  # fmt: skip
    cmd = _cmd(out, "trainer.max_steps=4", *SEPARATE, "rollout.max_staleness=0",
               "rollout.worker_timeout_s=30")  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 75, done.stderr[-3000:]
    assert sorted((out / "checkpoints").glob("step_*")), "stopped with a checkpoint"
    stops = [ln for ln in done.stderr.splitlines() if "reco-train: " in ln and "stopping" in ln]
    assert len(stops) == 1, done.stderr[-3000:]
    assert needle in stops[0], stops[0]  # the line says why
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
