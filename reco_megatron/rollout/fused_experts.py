"""Checkpoint-named expert tensors into transformers' fused expert parameters.

A mixture-of-experts checkpoint (and the trainer's weight stream, what vLLM loads) names one
tensor per expert: ``model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight``. transformers
5 keeps the experts of a layer in two 3-D parameters instead (converting on
``from_pretrained``): ``model.layers.L.mlp.experts.gate_up_proj [N, 2F, H]`` (gate rows, then
up rows) and ``...experts.down_proj [N, H, F]``. :func:`fused_slot` says where a checkpoint
tensor goes in such a model; transformers 4 models keep per-expert names and need none of this.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def fused_slot(
    name: str, targets: Mapping[str, torch.Tensor]
) -> tuple[str, tuple[int, slice]] | None:
    """``(fused parameter name, index)`` receiving the checkpoint tensor ``name``, or None
    when ``name`` is not a per-expert tensor or the model does not fuse its experts."""
    match = _EXPERT.match(name)
    if match is None:
        return None
    prefix, expert, kind = match.group(1), int(match.group(2)), match.group(3)
    if kind == "down_proj":
        key = f"{prefix}.down_proj"
        if key not in targets:
            return None
        return key, (expert, slice(None))
    key = f"{prefix}.gate_up_proj"
    if key not in targets:
        return None
    half = targets[key].shape[1] // 2
    rows = slice(0, half) if kind == "gate_proj" else slice(half, 2 * half)
    return key, (expert, rows)


def slots_per_fused(targets: Mapping[str, torch.Tensor]) -> dict[str, int]:
    """How many checkpoint tensors fill each fused parameter: ``2 N`` for ``gate_up_proj``,
    ``N`` for ``down_proj``."""
    out = {}
    for key, tensor in targets.items():
        if key.endswith(".mlp.experts.gate_up_proj"):
            out[key] = 2 * tensor.shape[0]
        elif key.endswith(".mlp.experts.down_proj"):
            out[key] = tensor.shape[0]
    return out
