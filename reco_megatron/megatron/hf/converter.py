"""Who maps Hugging Face weights for this run: our converter or Megatron-Bridge.

``checkpoint.hf_converter`` picks who maps Hugging Face tensors to Megatron parameters when
importing ``checkpoint.init_hf`` and when streaming the policy into the rollout engine:

* ``builtin``: our mapping (:mod:`reco_megatron.megatron.hf.convert`), which works everywhere.
* ``megatron_bridge``: NVIDIA Megatron-Bridge's ``AutoBridge``
  (:mod:`reco_megatron.megatron.hf.bridge`); an error naming the reason when it cannot be
  used here.
* ``auto`` (default): Megatron-Bridge when it imports (GPU containers) and the model is in the
  range where it gives exactly our tensors, else ours, with the reason logged once.

This module owns the choice; :mod:`~reco_megatron.megatron.hf.bridge` and
:mod:`~reco_megatron.megatron.hf.checkpoint` are used by it and never import it. The bridge
module is imported inside the functions, so importing this module loads no Megatron-Bridge code.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from reco_megatron.megatron.hf.checkpoint import all_stage_hf_weights, load_hf_checkpoint
from reco_megatron.megatron.model.config import ModelConfig

HFConverter = Literal["auto", "builtin", "megatron_bridge"]
HF_CONVERTERS: tuple[str, ...] = ("auto", "builtin", "megatron_bridge")


@dataclass(frozen=True)
class ConverterChoice:
    """Who maps the weights, and why (logged at start-up)."""

    name: Literal["builtin", "megatron_bridge"]
    reason: str


def choose_converter(
    setting: str,
    model_cfg: ModelConfig,
    *,
    tp: int,
    pp: int,
    vpp: int = 1,
    on_gpu: bool,
    importing: bool,
) -> ConverterChoice:
    """Resolve ``checkpoint.hf_converter`` for this run (see the module docstring)."""
    if setting not in HF_CONVERTERS:
        raise ValueError(f"checkpoint.hf_converter must be one of {HF_CONVERTERS}, got {setting!r}")
    if setting == "builtin":
        return ConverterChoice("builtin", "checkpoint.hf_converter=builtin")
    from reco_megatron.megatron.hf import bridge

    problem = bridge.bridge_import_error()
    limits = (
        []
        if problem
        else bridge.bridge_limits(
            model_cfg, tp=tp, pp=pp, vpp=vpp, on_gpu=on_gpu, importing=importing
        )
    )
    if setting == "megatron_bridge":
        if problem:
            raise RuntimeError(
                f"checkpoint.hf_converter=megatron_bridge but Megatron-Bridge does not import "
                f"({problem}); install it in a GPU container (pip install megatron-bridge) or "
                "use checkpoint.hf_converter=builtin"
            )
        if limits:
            raise ValueError(
                "checkpoint.hf_converter=megatron_bridge cannot give the right tensors here: "
                + "; ".join(limits)
                + ". Use checkpoint.hf_converter=builtin (or auto)"
            )
        return ConverterChoice("megatron_bridge", "checkpoint.hf_converter=megatron_bridge")
    if problem:
        return ConverterChoice("builtin", f"Megatron-Bridge not importable ({problem})")
    if limits:
        return ConverterChoice("builtin", "Megatron-Bridge importable but " + "; ".join(limits))
    return ConverterChoice("megatron_bridge", "Megatron-Bridge importable and the model fits it")


def load_hf_into_engine(hf_dir: str | Path, engine: Any, converter: str = "builtin") -> None:
    """Load a Hugging Face directory into a ``ReCoEngine`` (any object with ``unwrapped()``,
    ``model_cfg``, ``optimizer`` and ``sync_reference()``) with the chosen converter, then
    refresh the optimizer's fp32 main params and the reference model from the loaded weights.
    Collective: every rank calls it."""
    if converter == "megatron_bridge":
        from reco_megatron.megatron.hf.bridge import bridge_load_hf

        bridge_load_hf(hf_dir, engine.unwrapped(), engine.model_cfg)
    else:
        load_hf_checkpoint(hf_dir, engine.unwrapped(), engine.model_cfg)
    engine.optimizer.reload_model_params()
    engine.sync_reference()


def policy_hf_weights(
    model_chunks: list[Any], model_cfg: ModelConfig, converter: str = "builtin"
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every HF ``(name, tensor)`` pair of the policy on every rank, from the chosen converter
    (collective: every rank exhausts the stream). A tied ``lm_head.weight`` is never sent."""
    if converter == "megatron_bridge":
        from reco_megatron.megatron.hf.bridge import bridge_hf_weights

        return bridge_hf_weights(model_chunks, model_cfg)
    return all_stage_hf_weights(model_chunks, model_cfg)
