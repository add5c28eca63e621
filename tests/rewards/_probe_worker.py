"""A stand-in worker for ``start_worker(..., module=...)``: it answers the first message with
what it sees of its own start (session, process group, environment, stdin), then exits.
Run as ``python -m tests.rewards._probe_worker FD PARENT_PID``, as the keeper is."""

from __future__ import annotations

import os
import sys
from multiprocessing.connection import Connection

if __name__ == "__main__":
    conn = Connection(int(sys.argv[1]))
    name = conn.recv()
    stdin, null = os.fstat(0), os.stat(os.devnull)
    conn.send(
        {
            "first_message": name,
            "parent_pid": int(sys.argv[2]),
            "session": os.getsid(0),
            "group": os.getpgrp(),
            "env": dict(os.environ),
            "stdin_is_devnull": (stdin.st_dev, stdin.st_ino) == (null.st_dev, null.st_ino),
        }
    )
    conn.close()
