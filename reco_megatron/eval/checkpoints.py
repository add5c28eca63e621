"""Turn a checkpoint argument into a generation engine holding its weights.

A checkpoint is either a Hugging Face directory (``config.json`` + safetensors) or a
reco-megatron checkpoint (a ``step_*`` directory with ``meta.json``, or a root with
``latest``). The latter is exported in-process to a Hugging Face directory with
:func:`reco_megatron.export.export_checkpoint` (into ``cache_dir``, reused when already there)
and then treated like the former. Engines: ``embedded`` (``transformers`` on CPU or one GPU;
the weights stream through :meth:`EmbeddedEngine.update_weights`) and ``vllm`` (loads the
directory itself, ``load_format="auto"``).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Literal

from reco_megatron.rollout.base import RolloutEngine
from reco_megatron.rollout.engines import STANDALONE_GPU_MEMORY_UTILIZATION, EngineName
from reco_megatron.rollout.engines import build_engine as build_rollout_engine
from reco_megatron.utils.logging import get_logger

logger = get_logger(__name__)


class CheckpointNotFoundError(FileNotFoundError):
    """The checkpoint argument is neither an HF directory nor a reco-megatron checkpoint."""


def checkpoint_kind(path: str | Path) -> Literal["hf", "megatron"]:
    """``"hf"`` for a directory with ``config.json``, ``"megatron"`` for a ``step_*`` directory
    (``meta.json``) or a checkpoint root (``latest``); :class:`CheckpointNotFoundError` else."""
    p = Path(path)
    if not p.exists():
        raise CheckpointNotFoundError(f"checkpoint {str(p)!r} does not exist")
    if not p.is_dir():
        raise CheckpointNotFoundError(f"checkpoint {str(p)!r} is a file; pass a directory")
    if (p / "config.json").is_file():
        return "hf"
    if (p / "meta.json").is_file() or (p / "latest").exists():
        return "megatron"
    raise CheckpointNotFoundError(
        f"{str(p)!r} is neither a Hugging Face model directory (no config.json) nor a "
        "reco-megatron checkpoint (no meta.json / latest): pass e.g. runs/x/checkpoints or an "
        "exported HF directory"
    )


def as_hf_dir(path: str | Path, cache_dir: str | Path) -> Path:
    """The Hugging Face directory of ``path``, exporting a Megatron checkpoint when needed.

    The export lands in ``cache_dir/<name>-<hash of the resolved step path>`` and is reused by
    later calls (an export is complete once ``config.json`` exists, which is written last).
    """
    if checkpoint_kind(path) == "hf":
        return Path(path)
    from reco_megatron.export import export_checkpoint, resolve_checkpoint

    step_dir = resolve_checkpoint(path).resolve()
    tag = hashlib.sha256(str(step_dir).encode()).hexdigest()[:10]
    out = Path(cache_dir) / f"{step_dir.parent.parent.name}-{step_dir.name}-{tag}"
    if (out / "config.json").is_file():
        return out
    logger.info("exporting %s -> %s", step_dir, out)
    return export_checkpoint(step_dir, out, overwrite=True)


def build_engine(
    hf_dir: str | Path,
    *,
    engine: EngineName = "embedded",
    max_model_len: int,
    eos_token_ids: tuple[int, ...],
    seed: int = 0,
    device: str = "cpu",
    max_batch_size: int = 64,
    tensor_parallel_size: int = 1,
    gpu_memory_utilization: float = STANDALONE_GPU_MEMORY_UTILIZATION,
) -> RolloutEngine:
    """A rollout engine loaded with the weights of the HF directory ``hf_dir``
    (:func:`reco_megatron.rollout.engines.build_engine`, the factory training uses too)."""
    hf_dir = Path(hf_dir)
    config: dict[str, Any] = json.loads((hf_dir / "config.json").read_text(encoding="utf-8"))
    if engine == "embedded" and not any(hf_dir.glob("*.safetensors")):
        raise CheckpointNotFoundError(f"{hf_dir} has no *.safetensors weights")
    return build_rollout_engine(
        engine,
        hf_config=config,
        model_dir=hf_dir,
        checkpoint=True,
        max_model_len=max_model_len,
        eos_token_ids=eos_token_ids,
        seed=seed,
        device=device,
        max_batch_size=max_batch_size,
        tensor_parallel_size=tensor_parallel_size,
        gpu_memory_utilization=gpu_memory_utilization,
    )
