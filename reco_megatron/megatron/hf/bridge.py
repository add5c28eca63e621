"""Megatron-Bridge (NVIDIA's HF <-> Megatron converter) as an optional weight mapping.

This module only drives Megatron-Bridge; who maps the weights for a run (``builtin``,
``megatron_bridge`` or ``auto``) is decided by :mod:`reco_megatron.megatron.hf.converter`,
which calls in here. ``megatron.bridge`` itself is imported inside the functions only.

Written against Megatron-Bridge **0.6.2**, read from its source and run against our
local-spec models on CPU (``tests/megatron/test_bridge_crosscheck.py``: import and the weight
stream are bit-identical to ours for Llama and Qwen2 at TP 1/2 and PP 2). Where 0.6.2 would
give something else (:func:`bridge_limits`), ``auto`` keeps ours:

* padded vocabulary (Megatron pads to a multiple of ``make_vocab_size_divisible_by * TP``): the
  bridge exports the padded rows (``[V_padded, H]`` instead of ``[V, H]``) and its import at
  TP 1 rejects the shape;
* import at TP > 1 without CUDA: the bridge moves norm weights with ``torch.cuda.current_device()``;
* tied embeddings at PP > 1 and virtual pipelines: not verified.

Also, the bridge's import skips a tensor missing from the checkpoint with a warning (the
parameter keeps its random init), so our own config and key-set checks always run first
(:func:`reco_megatron.megatron.hf.checkpoint.check_hf_checkpoint`). The bridge never writes
export directories here: ``reco-export`` keeps our streamed safetensors writer.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from reco_megatron.megatron.hf.checkpoint import check_hf_checkpoint
from reco_megatron.megatron.hf.config import hf_config_from_model_config
from reco_megatron.megatron.hf.convert import LM_HEAD
from reco_megatron.megatron.model.config import ModelConfig
from reco_megatron.utils.logging import get_logger, quiet_third_party_import

logger = get_logger(__name__)


@functools.cache
def bridge_import_error() -> str | None:
    """``None`` when ``from megatron.bridge import AutoBridge`` works, else why not.

    Any exception counts: a bridge whose pinned ``transformers`` or transformer-engine is
    missing fails with ``ModuleNotFoundError`` or ``AttributeError`` deep in its imports. The
    probe prints nothing and leaves the process's logging as it was.
    """
    try:
        with quiet_third_party_import():  # it logs tracebacks at INFO and sets up logging
            from megatron.bridge import AutoBridge  # noqa: F401
    except Exception as err:  # any import failure means "not usable here"
        return f"{type(err).__name__}: {err}"
    return None


def bridge_limits(
    model_cfg: ModelConfig, *, tp: int, pp: int, vpp: int, on_gpu: bool, importing: bool
) -> list[str]:
    """Why Megatron-Bridge 0.6.2 would not give exactly our tensors for this run ([] = fine)."""
    out = []
    padded = model_cfg.padded_vocab_size(tp)
    if padded != model_cfg.vocab_size:
        out.append(
            f"the vocabulary is padded ({model_cfg.vocab_size} -> {padded} at TP {tp}) and the "
            "bridge exports the padded rows; set model.make_vocab_size_divisible_by so that "
            "it divides vocab_size / TP to avoid padding"
        )
    if importing and tp > 1 and not on_gpu:
        out.append("the bridge's import at TP > 1 needs CUDA (torch.cuda.current_device())")
    if model_cfg.tie_word_embeddings and pp > 1:
        out.append("tied embeddings at PP > 1 are not verified with the bridge")
    if vpp > 1:
        out.append("virtual pipelines are not verified with the bridge")
    return out


def _prepare(model_chunks: list[Any], model_cfg: ModelConfig) -> None:
    """The bridge reads the tie flag from ``config.share_embeddings_and_output_weights``, which
    our ``TransformerConfig`` does not carry (``GPTModel`` takes it as an argument)."""
    for chunk in model_chunks:
        config = _unwrapped(chunk).config
        config.share_embeddings_and_output_weights = model_cfg.tie_word_embeddings


def _unwrapped(chunk: Any) -> Any:
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def bridge_hf_weights(
    model_chunks: list[Any], model_cfg: ModelConfig
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every HF ``(name, tensor)`` pair on every rank, through ``AutoBridge.export_hf_weights``
    (it gathers TP shards and PP stages itself; collective: every rank exhausts it). The same
    stream as :func:`reco_megatron.megatron.hf.checkpoint.all_stage_hf_weights`: a tied
    ``lm_head.weight`` is dropped, as ours never sends it."""
    import transformers
    from megatron.bridge import AutoBridge

    _prepare(model_chunks, model_cfg)
    fields = hf_config_from_model_config(model_cfg)
    hf_config = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
    bridge = AutoBridge.from_hf_config(hf_config)
    stream = bridge.export_hf_weights(
        model_chunks, cpu=False, show_progress=False, merge_adapter_weights=False
    )
    for name, tensor in stream:
        if model_cfg.tie_word_embeddings and name == LM_HEAD:
            continue
        yield name, tensor


def bridge_load_hf(hf_dir: str | Path, model_chunks: list[Any], model_cfg: ModelConfig) -> None:
    """Load a checkpoint through ``AutoBridge.load_hf_weights`` after our own checks of
    ``config.json`` and the tensor set (the bridge would skip a missing tensor silently).
    Collective: every rank calls it."""
    from megatron.bridge import AutoBridge

    check_hf_checkpoint(hf_dir, model_cfg)
    _prepare(model_chunks, model_cfg)
    AutoBridge.from_hf_pretrained(str(hf_dir)).load_hf_weights(model_chunks)
    logger.info("loaded %s through Megatron-Bridge", hf_dir)
