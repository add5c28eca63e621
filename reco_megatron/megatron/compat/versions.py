"""One place for the megatron-core API differences between 0.16 and 0.19.

Everything else in reco-megatron calls these wrappers instead of the moved or changed
megatron names, so supporting a new megatron-core version means editing this file only.

- ``PackedSeqParams``: import it from ``megatron.core.packed_seq_params`` (both versions).
- ``dist_checkpointing.save/load``: 0.16 accepts ``common_strategy``, 0.19 removed it.
- ``initialize_model_parallel``: 0.16 accepts ``create_all_gather_group``, 0.19 removed it.
- ``GPTModel``: current in 0.16; deprecated in 0.19 in favour of ``HybridModel`` (warns).
- MoE auxiliary-loss tracker: ``moe_utils.get_moe_layer_wise_logging_tracker()`` (a dict) in
  0.16, ``moe_logging.get_moe_metrics_tracker()`` (an object) in 0.19.
- MoE auxiliary loss with ``calculate_per_token_loss``: 0.16 multiplies it by the router's
  local token count, 0.19 by that count times the TP x CP size.
- MoE router without transformer-engine: 0.16's ``moe_utils`` tests ``te_general_gemm is not
  None`` but defines the name only when TE imports (``NameError``); :func:`build_gpt_model`
  defines it as None there (what 0.19 does).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import megatron.core
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.packed_seq_params import PackedSeqParams

from reco_megatron.utils.logging import get_logger

__all__ = [
    "MCORE_VERSION",
    "PackedSeqParams",
    "build_gpt_model",
    "clear_moe_aux_losses",
    "dist_checkpointing_load",
    "dist_checkpointing_save",
    "initialize_model_parallel",
    "mcore_at_least",
    "moe_aux_loss_counts_tp_cp",
    "moe_aux_losses",
]

logger = get_logger(__name__)


def _parse_version(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


MCORE_VERSION: tuple[int, ...] = _parse_version(getattr(megatron.core, "__version__", "0.0.0"))
"""The installed megatron-core as a tuple, e.g. ``(0, 19, 2)``."""


def mcore_at_least(major: int, minor: int, patch: int = 0) -> bool:
    """Whether the installed megatron-core is at least ``major.minor.patch``."""
    return (major, minor, patch) <= MCORE_VERSION


def _accepts(fn: Callable[..., Any], name: str) -> bool:
    return name in inspect.signature(fn).parameters


def _drop_unsupported(fn: Callable[..., Any], kwargs: dict[str, Any], what: str) -> None:
    """Remove keyword arguments ``fn`` lost; refuse to drop one set to a non-default value."""
    for key in list(kwargs):
        if _accepts(fn, key):
            continue
        value = kwargs.pop(key)
        if value not in (None, False):
            raise TypeError(
                f"{what}() of megatron-core {megatron.core.__version__} has no argument "
                f"{key!r} (got {value!r}); remove it from the call"
            )


def initialize_model_parallel(**kwargs: Any) -> None:
    """``parallel_state.initialize_model_parallel`` accepting the union of both APIs.

    ``create_all_gather_group`` (0.16 only; 0.19 creates the groups on demand) is passed
    through where it exists and dropped where it does not, if false.
    """
    fn = parallel_state.initialize_model_parallel
    _drop_unsupported(fn, kwargs, "initialize_model_parallel")
    fn(**kwargs)


def dist_checkpointing_save(
    sharded_state_dict: dict[str, Any], checkpoint_dir: str, **kwargs: Any
) -> Any:
    """``dist_checkpointing.save``; ``common_strategy`` is accepted only where supported."""
    _drop_unsupported(dist_checkpointing.save, kwargs, "dist_checkpointing.save")
    return dist_checkpointing.save(sharded_state_dict, checkpoint_dir, **kwargs)


def dist_checkpointing_load(
    sharded_state_dict: dict[str, Any], checkpoint_dir: str, **kwargs: Any
) -> Any:
    """``dist_checkpointing.load``; ``common_strategy`` is accepted only where supported."""
    _drop_unsupported(dist_checkpointing.load, kwargs, "dist_checkpointing.load")
    return dist_checkpointing.load(sharded_state_dict, checkpoint_dir, **kwargs)


class _DropGPTDeprecation(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "GPTModel IS DEPRECATED" not in record.getMessage()


_gpt_note_logged = False


@contextmanager
def _gpt_deprecation_silenced() -> Iterator[None]:
    """Drop 0.19's per-construction GPTModel deprecation warning; log our reason once."""
    global _gpt_note_logged
    if not mcore_at_least(0, 19):
        yield
        return
    if not _gpt_note_logged:
        logger.info(
            "megatron-core %s deprecates GPTModel for HybridModel; reco-megatron keeps GPTModel "
            "while it supports 0.16 (see docs/cpu-backend.md)",
            megatron.core.__version__,
        )
        _gpt_note_logged = True
    target = logging.getLogger("megatron.core.models.gpt.gpt_model")
    flt = _DropGPTDeprecation()
    target.addFilter(flt)
    try:
        yield
    finally:
        target.removeFilter(flt)


def build_gpt_model(**kwargs: Any) -> Any:
    """Construct ``megatron.core.models.gpt.GPTModel(**kwargs)`` on both versions.

    GPTModel is the one model class both 0.16 and 0.19 have; 0.19 logs a deprecation warning
    in favour of ``HybridModel`` on every construction, which is dropped here on purpose (and
    noted once in our log) rather than silenced globally.
    """
    from megatron.core.models.gpt import GPTModel

    if getattr(kwargs.get("config"), "num_moe_experts", None):
        _define_missing_te_gemm()
    with _gpt_deprecation_silenced():
        return GPTModel(**kwargs)


def _define_missing_te_gemm() -> None:
    """megatron-core 0.16's router gating reads ``moe_utils.te_general_gemm``, imported only
    with transformer-engine: without TE the name is missing (a NameError at the first
    forward). Define it as None, which selects the torch matmul as in 0.19."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def moe_aux_losses() -> dict[str, Any]:
    """Per-layer sums ``[num_layers]`` of megatron's MoE auxiliary losses recorded by this
    rank since the last clear, by name (``load_balancing_loss``...), each divided by its
    coefficient (what megatron logs)."""
    try:
        from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker
    except ImportError:  # 0.16
        from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

        tracker = get_moe_layer_wise_logging_tracker()
        return {name: entry["values"] for name, entry in tracker.items()}
    return {name: entry.values for name, entry in get_moe_metrics_tracker().metrics.items()}


def clear_moe_aux_losses() -> None:
    """Zero megatron's MoE auxiliary-loss tracker (both versions keep the entries)."""
    for values in moe_aux_losses().values():
        values.zero_()


def moe_aux_loss_counts_tp_cp() -> bool:
    """Whether megatron's per-token scaling of the MoE auxiliary loss multiplies the router's
    local token count by the TP x CP group size (0.19) or not (0.16), read from the router's
    code (the change is not tied to a documented version)."""
    from megatron.core.transformer.moe.router import TopKRouter

    source = inspect.getsource(TopKRouter.attach_and_log_load_balancing_loss)
    return "tp_cp_group.size()" in source
