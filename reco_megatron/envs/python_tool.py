"""The ``python`` environment: the policy runs Python code as a tool, in a sandbox.

The policy writes ``<python>code</python>``; the action ends on the last token of
``</python>`` (the environment's stop id); the environment runs the code and appends
``<output>what it printed</output>`` as tokens (at most :data:`MAX_OUTPUT_CHARS`, the end
kept). An action that stopped on that token without closing a call goes on with no
observation; any other action (the answer, end-of-sequence, the budget) ends the episode,
which the reward function (e.g. ``reward.reward=math``) scores. Pair it with a tokenizer
that can write the tags (a Hugging Face one; the tiny SentencePiece model has no ``/``).

The sandbox, per call: a fresh ``python -I`` (no user site, no ``PYTHON*`` variables) with an
empty environment and a temporary working directory, in new user and network namespaces (no
network: only a loopback that is down), with ``RLIMIT_AS`` (:data:`MEMORY_LIMIT_MB`),
``RLIMIT_CPU``, ``RLIMIT_FSIZE`` (1 MiB) and no core dumps, killed after
:data:`TIMEOUT_S` seconds (the output then reads ``timeout``). It runs inside an environment
worker (``reco_megatron.envs.pool``), so whatever it starts dies with the worker, and the
worker's own ``rollout.env_step_timeout_s`` bounds the call. Where the kernel refuses
unprivileged namespaces the environment refuses to start (no silent fallback to a networked
sandbox).
"""

from __future__ import annotations

import ctypes
import os
import resource
import subprocess
import sys
import tempfile
from collections.abc import Sequence

from reco_megatron.envs.contract import Env, Step

OPEN, CLOSE = "<python>", "</python>"
TIMEOUT_S = 5.0
"""Wall-clock limit of one run (keep it below ``rollout.env_step_timeout_s``)."""
MEMORY_LIMIT_MB = 1024
"""Address-space limit of one run."""
MAX_OUTPUT_CHARS = 512
"""Longest output returned (the end of what it printed, stderr after stdout)."""
CLONE_NEWUSER, CLONE_NEWNET = 0x10000000, 0x40000000


def _isolate() -> None:
    """In the child before ``exec``: no network, limits, no core dumps."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWUSER | CLONE_NEWNET) != 0:
        os._exit(97)  # the parent reads 97 as "no sandbox"
    limit = MEMORY_LIMIT_MB * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    cpu = int(TIMEOUT_S) + 1
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def run_sandboxed(code: str) -> str:
    """What ``code`` prints (stdout, then stderr), or ``timeout``; raises ``RuntimeError``
    when the sandbox cannot be made."""
    with tempfile.TemporaryDirectory(prefix="reco_py_") as cwd:
        try:
            done = subprocess.run(
                [sys.executable, "-I", "-c", code],
                cwd=cwd,
                env={"PATH": "/usr/bin:/bin"},
                stdin=subprocess.DEVNULL,
                capture_output=True,
                timeout=TIMEOUT_S,
                preexec_fn=_isolate,
            )
        except subprocess.TimeoutExpired:
            return "timeout"
    if done.returncode == 97 and not done.stdout and not done.stderr:
        raise RuntimeError("cannot create the sandbox: unprivileged user namespaces are off")
    out = (done.stdout + done.stderr).decode("utf-8", "replace")
    return out[-MAX_OUTPUT_CHARS:]


class PythonEnv(Env):
    """Run ``<python>...</python>`` calls in the sandbox (see the module doc)."""

    def __init__(self, tokenizer) -> None:
        super().__init__(tokenizer)
        if tokenizer is None:
            raise ValueError("the python environment needs the run's tokenizer")
        close = tokenizer.encode(CLOSE)
        if tokenizer.decode(close) != CLOSE:
            raise ValueError(f"the tokenizer cannot write {CLOSE!r} (it gives {close})")
        self.stop_ids = (close[-1],)
        run_sandboxed("pass")  # refuse to start where the sandbox cannot be made

    def step(self, action_ids: Sequence[int], finish: str) -> Step:
        text = self.tokenizer.decode(list(action_ids))
        if finish != "stop" or not action_ids or action_ids[-1] not in self.stop_ids:
            return Step((), done=True)
        if not text.endswith(CLOSE) or OPEN not in text:
            return Step((), done=False)  # the stop token inside something else: go on
        code = text[text.rindex(OPEN) + len(OPEN) : -len(CLOSE)]
        output = run_sandboxed(code)
        return Step(self.tokenizer.encode(f"<output>{output}</output>"), done=False)
