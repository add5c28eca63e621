"""Misbehaving reward functions, loaded by import path inside RewardPool workers."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from reco_megatron.rewards.types import RewardResult


def exact(response: str, gold: str) -> float:
    """1.0 when the stripped response equals the gold."""
    return 1.0 if response.strip() == gold.strip() else 0.0


def hang_on_hang(response: str, gold: str) -> float:
    """Sleeps forever when the response is "hang", else behaves like :func:`exact`."""
    if response == "hang":
        while True:
            time.sleep(3600)
    return exact(response, gold)


def hog_on_hog(response: str, gold: str) -> float:
    """Allocates 8 GiB when the response is "hog" (must hit RLIMIT_AS), else :func:`exact`."""
    if response == "hog":
        block = bytearray(8 * 1024**3)
        return float(len(block))
    return exact(response, gold)


def die_on_die(response: str, gold: str) -> float:
    """Kills its own process with SIGKILL when the response is "die" (a hard crash)."""
    if response == "die":
        os.kill(os.getpid(), signal.SIGKILL)
    return exact(response, gold)


def raise_on_raise(response: str, gold: str) -> float:
    """Raises ValueError when the response is "raise"."""
    if response == "raise":
        raise ValueError("boom")
    return exact(response, gold)


def returns_string(response: str, gold: str) -> str:
    """Wrong return type: a string."""
    return "one"


def returns_nan_or_result(response: str, gold: str) -> object:
    """NaN for "nan", an explicit RewardResult otherwise."""
    if response == "nan":
        return float("nan")
    return RewardResult(0.5, "no_answer")


def one_arg(response: str) -> float:
    """Wrong arity."""
    return 0.0


NOT_CALLABLE = 3


def fails_by_command(response: str, gold: str) -> object:
    """Each failure kind on demand: the response names it ("raise", "nan", "inf", "none",
    "str", "memory", "hang", "die", "grader": the grader's own timeout, "huge": 1e39, beyond
    float32); "np_true" returns ``numpy.True_``; anything else behaves like :func:`exact`."""
    if response == "raise":
        raise KeyError("no such key")
    if response == "memory":
        raise MemoryError
    if response == "hang":
        time.sleep(3600)
    if response == "die":
        os._exit(3)
    if response == "np_true":
        import numpy as np

        return np.True_
    returns = {"nan": float("nan"), "inf": float("-inf"), "none": None, "str": "1.0", "huge": 1e39}
    returns["grader"] = RewardResult(0.0, "grader_timeout")
    if response in returns:
        return returns[response]
    return exact(response, gold)


def sleeps_on_sleep(response: str, gold: str) -> float:
    """Sleeps an hour when the response is "sleep" (a worker busy when its parent dies)."""
    if response == "sleep":
        time.sleep(3600)
    return exact(response, gold)


def _a_check(response: str, gold: str) -> bool:
    """The pool's start-up check ``("", "")`` or the pre-flight's trial call, which scores a
    real prompt's gold answer as its own response (a tiny test model never writes one)."""
    return response == gold


def nan_after_self_check(response: str, gold: str) -> float:
    """0.0 for the start-up checks (:func:`_a_check`), NaN for every item of the run (a reward
    that passes the checks and later breaks)."""
    return 0.0 if _a_check(response, gold) else float("nan")


def fails_on_some_targets(response: str, gold: str) -> object:
    """Countdown golds ``target=T numbers=...``: raises when T % 3 == 0, returns None when
    T % 3 == 1, else 0.0 (about two thirds of the items fail, in two kinds); 0.0 for the
    start-up checks (:func:`_a_check`)."""
    if _a_check(response, gold):
        return 0.0
    target = int(gold.split()[0].removeprefix("target="))
    if target % 3 == 0:
        raise ValueError(f"cannot grade target {target}")
    return None if target % 3 == 1 else 0.0


def alive_then_dead(response: str, gold: str) -> float:
    """1.0 for the first ``$RECO_TEST_ALIVE_ITEMS`` real items scored (counted across worker
    processes in the file ``$RECO_TEST_COUNTER``, one byte appended per item), 0.0 after:
    a run that learns, then dies. The start-up checks (:func:`_a_check`) are not counted."""
    if _a_check(response, gold):
        return 0.0
    fd = os.open(os.environ["RECO_TEST_COUNTER"], os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    try:
        os.write(fd, b".")
        count = os.fstat(fd).st_size
    finally:
        os.close(fd)
    return 1.0 if count <= int(os.environ["RECO_TEST_ALIVE_ITEMS"]) else 0.0


def forks_a_session(response: str, gold: str) -> float:
    """Forks a child that calls ``setsid`` (leaving the worker's group and session), ignores
    SIGTERM and sleeps; it appends its pid to the file ``gold``. Then, by ``response``:
    "crash" kills the worker with SIGKILL, "hang" sleeps forever, else 1.0."""
    if not gold:
        return 0.0  # the pool's start-up self-check
    if os.fork() == 0:
        try:
            os.setsid()
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            with open(gold, "a") as f:
                f.write(f"{os.getpid()}\n")
            while True:
                time.sleep(3600)
        finally:
            os._exit(0)
    deadline = time.monotonic() + 60
    while not (os.path.exists(gold) and Path(gold).read_text().endswith("\n")):
        if time.monotonic() > deadline:
            raise TimeoutError("the child never wrote its pid")
        time.sleep(0.01)
    if response == "crash":
        os.kill(os.getpid(), signal.SIGKILL)
    if response == "hang":
        while True:
            time.sleep(3600)
    return 1.0
