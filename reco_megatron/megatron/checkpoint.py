"""Crash-safe training checkpoints: model, optimizer, scheduler, RNG and trainer state.

Layout of ``<root>``::

    latest                     # text: the name of the newest complete checkpoint
    step_00000012/
        meta.json              # step, trainer state, scheduler, model/parallel layout, version
        dist/                  # megatron dist_checkpointing (torch_dist) of model + optimizer
        rng/rank_00003.pt      # per-rank RNG states (python, numpy, torch, cuda, megatron)

A checkpoint is written to ``.tmp-step_...`` and renamed when every rank has finished, then
``latest`` is replaced atomically, then old checkpoints beyond ``keep_last`` are removed: a
crash (or a second preemption signal) at any point leaves the previous ``latest`` intact. The
model part reshards on load (another TP/PP is fine); the distributed optimizer state is saved
``dp_reshardable`` and must be loaded at the same data-parallel size, which is checked with a
message saying what differs.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from reco_megatron.megatron.checkpoint_compat import (
    load_model_and_optimizer,
    save_model_and_optimizer,
)
from reco_megatron.utils.logging import get_logger

logger = get_logger(__name__)

FORMAT_VERSION = 1
_PREFIX = "step_"


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, corrupted or incompatible with this run."""


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def checkpoint_name(step: int) -> str:
    """Directory name of the checkpoint after optimizer-loop step ``step``."""
    return f"{_PREFIX}{step:08d}"


def latest_checkpoint(root: str | Path) -> Path | None:
    """The newest complete checkpoint under ``root`` (via ``latest``), or None."""
    root = Path(root)
    pointer = root / "latest"
    if not pointer.exists():
        return None
    name = pointer.read_text().strip()
    path = root / name
    if not (path / "meta.json").exists():
        raise CheckpointError(
            f"{pointer} names {name!r} but {path}/meta.json does not exist: the checkpoint was "
            "removed or is incomplete; point 'latest' at another step_* directory or delete it"
        )
    return path


def _rng_state() -> dict[str, Any]:
    from megatron.core import tensor_parallel

    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": _numpy_state_to_tensors(np.random.get_state()),
        "torch": torch.get_rng_state(),
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _numpy_state_to_tensors(state: tuple) -> dict[str, Any]:
    """numpy's legacy RNG state as tensors/ints, loadable with ``torch.load(weights_only=True)``."""
    name, keys, pos, has_gauss, cached = state
    return {
        "name": name,
        "keys": torch.from_numpy(keys.astype(np.int64)),
        "pos": int(pos),
        "has_gauss": int(has_gauss),
        "cached": float(cached),
    }


def _numpy_state_from_tensors(state: dict[str, Any]) -> tuple:
    keys = state["keys"].numpy().astype(np.uint32)
    return (state["name"], keys, state["pos"], state["has_gauss"], state["cached"])


def _set_rng_state(state: dict[str, Any]) -> None:
    from megatron.core import tensor_parallel

    random.setstate(state["python"])
    np.random.set_state(_numpy_state_from_tensors(state["numpy"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _layout(engine: Any) -> dict[str, Any]:
    from megatron.core import parallel_state as ps

    return {
        "model": asdict(engine.model_cfg),
        "tensor_model_parallel_size": ps.get_tensor_model_parallel_world_size(),
        "pipeline_model_parallel_size": ps.get_pipeline_model_parallel_world_size(),
        "data_parallel_size": ps.get_data_parallel_world_size(),
        "world_size": dist.get_world_size() if dist.is_initialized() else 1,
    }


def save_checkpoint(
    root: str | Path, step: int, engine: Any, trainer_state: dict[str, Any], keep_last: int = 3
) -> Path:
    """Collective: every rank calls it. Returns the final checkpoint directory."""
    root = Path(root)
    final = root / checkpoint_name(step)
    tmp = root / f".tmp-{checkpoint_name(step)}"
    if _rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / "dist").mkdir(parents=True)
        (tmp / "rng").mkdir()
    _barrier()
    save_model_and_optimizer(str(tmp / "dist"), engine.unwrapped(), engine.optimizer)
    torch.save(_rng_state(), tmp / "rng" / f"rank_{_rank():05d}.pt")
    _barrier()
    if _rank() == 0:
        meta = {
            "format_version": FORMAT_VERSION,
            "step": step,
            "optimizer_steps": engine.optimizer_steps,
            "trainer_state": trainer_state,
            "scheduler": engine.scheduler.state_dict(),
            "layout": _layout(engine),
        }
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1, sort_keys=True))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        pointer_tmp = root / "latest.tmp"
        pointer_tmp.write_text(final.name + "\n")
        os.replace(pointer_tmp, root / "latest")
        _prune(root, keep_last)
        logger.info("saved checkpoint %s", final)
    _barrier()
    return final


def _prune(root: Path, keep_last: int) -> None:
    if keep_last <= 0:
        return
    done = sorted(p for p in root.glob(f"{_PREFIX}*") if (p / "meta.json").exists())
    for old in done[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)


def read_meta(path: str | Path) -> dict[str, Any]:
    """``meta.json`` of a checkpoint, with a clear error when it is missing or unreadable."""
    meta_path = Path(path) / "meta.json"
    if not meta_path.exists():
        raise CheckpointError(
            f"{path} is not a reco-megatron checkpoint (no meta.json): pass a step_* directory "
            "written by save_checkpoint, or its parent holding a 'latest' file"
        )
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{meta_path} is corrupted ({exc}); use an older checkpoint") from exc
    if meta.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{path} has format_version {meta.get('format_version')!r}, this version reads "
            f"{FORMAT_VERSION}"
        )
    return meta


def check_compatible(meta: dict[str, Any], engine: Any, with_optimizer: bool) -> None:
    """Refuse a checkpoint whose model (or, for the optimizer, DP size) differs from ours."""
    saved, current = meta["layout"], _layout(engine)
    diffs = [
        f"model.{k}: checkpoint {saved['model'].get(k)!r} vs config {v!r}"
        for k, v in current["model"].items()
        if k not in ("params_dtype", "init_method_std") and saved["model"].get(k) != v
    ]
    if with_optimizer and saved["data_parallel_size"] != current["data_parallel_size"]:
        diffs.append(
            f"data-parallel size: checkpoint {saved['data_parallel_size']} vs run "
            f"{current['data_parallel_size']} (the distributed optimizer state is sharded by DP; "
            "resume with the same DP size, or load the model weights only)"
        )
    if diffs:
        raise CheckpointError("checkpoint does not match this run:\n  " + "\n  ".join(diffs))


def load_checkpoint(
    path: str | Path, engine: Any, *, load_optimizer: bool = True, load_rng: bool = True
) -> dict[str, Any]:
    """Load a checkpoint into ``engine``; returns the saved trainer state (collective)."""
    path = Path(path)
    meta = read_meta(path)
    check_compatible(meta, engine, with_optimizer=load_optimizer)
    try:
        load_model_and_optimizer(
            str(path / "dist"), engine.unwrapped(), engine.optimizer if load_optimizer else None
        )
    # dist_checkpointing raises many types for damaged files; torch's CheckpointException
    # derives from BaseException.
    except (Exception, CheckpointException) as exc:
        raise CheckpointError(
            f"could not read the weights of {path} ({type(exc).__name__}: {exc}); the "
            "checkpoint is damaged or was written by another model: use an older one"
        ) from exc
    if load_optimizer:
        engine.scheduler.load_state_dict(meta["scheduler"])
        engine.optimizer_steps = meta["optimizer_steps"]
    else:
        engine.optimizer.reload_model_params()
    engine.sync_reference()
    if load_rng:
        rng_file = path / "rng" / f"rank_{_rank():05d}.pt"
        if not rng_file.exists():
            raise CheckpointError(
                f"{rng_file} is missing: the checkpoint was written with another world size "
                f"({meta['layout']['world_size']} ranks); resume with that many, or pass "
                "load_rng=False"
            )
        _set_rng_state(torch.load(rng_file, weights_only=True))
    _barrier()
    logger.info("loaded checkpoint %s (step %d)", path, meta["step"])
    return meta["trainer_state"]
