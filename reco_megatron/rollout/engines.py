"""The one factory of the rollout engines that hold their own copy of the weights
(``embedded``: transformers; ``vllm``), for training and evaluation alike.

Training (``reco_megatron.trainer.orchestration.engines``) builds them from the policy's
architecture without weights (the first weight sync fills them) and
colocated with Megatron on the same GPUs; evaluation (``reco-eval``) builds them from a
Hugging Face directory's weights, alone on its GPUs. The ``megatron`` engine decodes on the
trainer's own model chunks and is built by the trainer (this layer never imports megatron).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import torch

from reco_megatron.rollout.base import RolloutEngine

EngineName = Literal["embedded", "vllm"]

STANDALONE_GPU_MEMORY_UTILIZATION = 0.85
"""vLLM's share of GPU memory when it has the GPU to itself (evaluation). Training shares the
GPU with Megatron and uses ``rollout.gpu_memory_utilization`` (default 0.5) instead."""


def build_engine(
    kind: EngineName,
    *,
    hf_config: dict[str, Any],
    model_dir: str | Path | None,
    checkpoint: bool,
    max_model_len: int,
    eos_token_ids: tuple[int, ...],
    seed: int,
    device: str,
    max_batch_size: int,
    tensor_parallel_size: int,
    gpu_memory_utilization: float,
    dtype: str | None = None,
    return_routed_experts: bool = False,
) -> RolloutEngine:
    """A rollout engine of ``kind`` for the architecture ``hf_config`` (a Hugging Face
    ``config.json`` as a dict).

    ``model_dir``: a directory holding that ``config.json`` (vLLM builds from it; unused by
    the embedded engine). ``checkpoint``: start from the ``*.safetensors`` weights in
    ``model_dir`` (evaluation); else the engine starts with placeholder weights (vLLM's dummy
    ones, the embedded engine's initial ones) and the caller pushes the policy with
    ``update_weights`` (training). ``device`` places the embedded engine (vLLM places itself)
    and ``max_batch_size`` bounds its rows per forward. ``tensor_parallel_size``,
    ``gpu_memory_utilization``, ``dtype`` (None: vLLM's default) and ``return_routed_experts``
    are vLLM's.
    """
    if checkpoint and model_dir is None:
        raise ValueError("checkpoint=True needs model_dir, the directory of the weights")
    if kind == "embedded":
        from reco_megatron.rollout.embedded import EmbeddedEngine
        from reco_megatron.rollout.embedded_config import EmbeddedEngineConfig

        engine = EmbeddedEngine(
            hf_config,
            EmbeddedEngineConfig(
                max_model_len=max_model_len,
                max_batch_size=max_batch_size,
                seed=seed,
                device=device,
                eos_token_ids=eos_token_ids,
            ),
        )
        if checkpoint:
            engine.update_weights(load_safetensors(Path(model_dir)))
        return engine
    if kind == "vllm":
        from reco_megatron.rollout.vllm_config import VLLMEngineConfig
        from reco_megatron.rollout.vllm_engine import VLLMEngine

        if model_dir is None:
            raise ValueError("the vllm engine needs model_dir (a directory with config.json)")
        extra = {} if dtype is None else {"dtype": "float32" if dtype == "float32" else dtype}
        return VLLMEngine(
            VLLMEngineConfig(
                model=str(model_dir),
                tensor_parallel_size=tensor_parallel_size,
                max_model_len=max_model_len,
                gpu_memory_utilization=gpu_memory_utilization,
                load_format="auto" if checkpoint else "dummy",
                seed=seed,
                return_routed_experts=return_routed_experts,
                **extra,
            )
        )
    raise ValueError(f"engine must be 'embedded' or 'vllm', got {kind!r}")


def load_safetensors(hf_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every ``(name, tensor)`` of the directory's ``*.safetensors`` files (none: an error
    raised on the first ``next``)."""
    from safetensors.torch import load_file

    files = sorted(hf_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{hf_dir} has no *.safetensors weights")
    for file in files:
        yield from load_file(str(file)).items()
