"""``reco-train --nproc-per-node N``: N local training processes, one command, one answer.

Started this way, ``reco-train`` does what ``torchrun --standalone --nproc-per-node N`` does
for one node (each process gets ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``; ``OMP_NUM_THREADS`` = CPUs / N unless
set) and then waits for them, so that what a person sees is what one process would show:

- the exit status is the trainer's own (0; 2 for a configuration that cannot run, written
  once, by local rank 0; 3 for a stability stop; 75 after a signal and its checkpoint),
  never torchrun's exit 1 with a ``ChildFailedError`` traceback;
- a signal to this process (Ctrl-C, SIGTERM, SIGUSR1) reaches every rank exactly once (the
  ranks run in their own process group, so the terminal's Ctrl-C is not delivered twice);
- a rank that crashes stops the others (those stuck in a collective would wait forever):
  after :data:`GRACE_S` seconds they are killed, and one line names the rank that failed.

Multi-node jobs keep using ``torchrun`` (``slurm/``), after the layout check.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence

GRACE_S = 20.0
"""Seconds the other ranks get to finish on their own after one rank failed."""

RESUMABLE = 75
"""The trainer's exit status after a stop signal and its checkpoint."""

EXIT_BAD_CONFIG = 2
"""The trainer's exit status for a configuration that cannot run."""

_FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)


def split_nproc(argv: Sequence[str]) -> tuple[int | None, list[str]]:
    """``(N, the other arguments)`` for ``--nproc-per-node N`` / ``--nproc-per-node=N``;
    ``(None, argv)`` without it. Raises ``ValueError`` for a missing or bad N."""
    args, nproc, rest = list(argv), None, []
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--nproc-per-node" or arg.startswith("--nproc-per-node="):
            if "=" in arg:
                value = arg.split("=", 1)[1]
            elif i + 1 < len(args):
                value, i = args[i + 1], i + 1
            else:
                value = ""
            if not value.isdigit() or int(value) < 1:
                raise ValueError(
                    f"--nproc-per-node needs a number of processes >= 1, got {value!r}"
                )
            nproc = int(value)
        else:
            rest.append(arg)
        i += 1
    return nproc, rest


def check_then_launch(
    nproc: int, args: Sequence[str], report: Callable[[str, Exception], None]
) -> int:
    """Check the config and the layout of ``nproc`` local processes here, once (exit 2 with
    the trainer's one message, written by ``report(kind, exc)``), then :func:`launch` them."""
    from reco_megatron.config import ConfigError, parse_cli
    from reco_megatron.launch_check import check_layout

    if "LOCAL_RANK" in os.environ:
        sys.stderr.write(
            "reco-train: --nproc-per-node inside torchrun (or another launcher) would start "
            "processes per rank: drop it, or run reco-train directly\n"
        )
        return EXIT_BAD_CONFIG
    try:
        config_path, overrides = parse_cli(list(args))
        import torch

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        check_layout(
            None if config_path is None else str(config_path),
            overrides,
            nnodes=1,
            nproc_per_node=nproc,
            gpus_per_node=gpus,
        )
    except (ConfigError, ValueError) as exc:
        report("invalid configuration", exc)
        return EXIT_BAD_CONFIG
    return launch(nproc, args)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def rank_env(rank: int, nproc: int, port: int, base: dict[str, str]) -> dict[str, str]:
    """The environment of local rank ``rank`` of ``nproc`` (torchrun's variables)."""
    env = dict(base)
    env.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        GROUP_RANK="0",
        WORLD_SIZE=str(nproc),
        LOCAL_WORLD_SIZE=str(nproc),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    return env


def _new_group_dying_with_parent() -> None:  # pragma: no cover - runs in the child
    os.setpgrp()
    try:  # Linux: a rank gets SIGTERM (checkpoint, exit 75) if this launcher dies
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def launch(nproc: int, args: Sequence[str], module: str = "reco_megatron.train") -> int:
    """Run ``python -m module args...`` as ``nproc`` ranks; returns the exit status."""
    port = _free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", module, *args],
            env=rank_env(rank, nproc, port, dict(os.environ)),
            preexec_fn=_new_group_dying_with_parent,
        )
        for rank in range(nproc)
    ]

    def forward(signum: int, _frame: object) -> None:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in _FORWARDED}
    try:
        return _wait(procs)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def _wait(procs: list[subprocess.Popen]) -> int:
    failed: tuple[int, int] | None = None  # (rank, code) of the first rank that failed
    deadline = None
    while True:
        codes = [proc.poll() for proc in procs]
        if all(code is not None for code in codes):
            break
        if failed is None:
            for rank, code in enumerate(codes):
                if code not in (None, 0, RESUMABLE):
                    failed, deadline = (rank, code), time.monotonic() + GRACE_S
                    break
        if deadline is not None and time.monotonic() > deadline:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
            for proc in procs:
                proc.wait()
            break
        time.sleep(0.2)
    codes = [proc.returncode for proc in procs]
    if all(code == 0 for code in codes):
        return 0
    if failed is None:
        failed = next((r, c) for r, c in enumerate(codes) if c != 0)
    rank, code = failed
    if code in (2, 3, RESUMABLE) and all(c in (code, 0) or c < 0 for c in codes):
        return code  # the ranks said why themselves (a config error once, by local rank 0)
    if code < 0:
        what = f"was killed by {signal.Signals(-code).name}"
    else:
        what = f"exited with status {code}"
    sys.stderr.write(
        f"reco-train: rank {rank} {what} (its messages are above); the other ranks were "
        f"stopped (exit statuses by rank: {codes})\n"
    )
    return code if code > 0 else 1
