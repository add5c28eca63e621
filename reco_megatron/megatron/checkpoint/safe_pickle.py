"""Reading the pickled parts of a checkpoint without running code from it.

A checkpoint is data. Three of its parts are pickles that megatron-core and torch read with
``pickle.load`` or ``torch.load(weights_only=False)``, and a pickle can name any callable to
run while it loads:

* ``dist/.metadata``: torch DCP's ``FileSystemReader.read_metadata`` (``pickle.load``);
* the non-tensor items inside ``dist/*.distcp`` (optimizer param groups, ``common_state``,
  ``_extra_state``): torch's ``DefaultLoadPlanner.load_bytes`` (``weights_only=False``);
* transformer-engine's ``_extra_state`` (FP8 scaling state): the bytes of that uint8 tensor
  are a pickle, which megatron-core 0.19 reads with its own allow-list but 0.16 hands to TE's
  ``set_extra_state`` (``pickle.loads``).

So every load of a checkpoint (resume, ``checkpoint.init_megatron``, ``reco-export``,
``reco-eval``: all go through ``megatron_state.load_model_and_optimizer``) runs under
:func:`restricted_loads`: DCP metadata goes through an unpickler that resolves only the
classes DCP metadata is made of (:data:`DCP_METADATA_GLOBALS`), and ``torch.load`` is forced
to ``weights_only=True`` (torch's own restricted unpickler: tensors, containers, numbers).
TE's extra state is unpickled with the same kind of allow-list before TE sees it
(:func:`check_extra_state`). A pickle that names anything else is refused with
:class:`~reco_megatron.megatron.checkpoint.format.UnsafeCheckpointError` *before* the name is
resolved, so none of its code runs. ``load.verify_checkpoint`` also checks ``.metadata``
up front (:func:`check_dcp_metadata`), so the refusal names the file before any loading starts.
"""

from __future__ import annotations

import contextlib
import functools
import io
import pickle
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

import torch

from reco_megatron.megatron.checkpoint.format import UnsafeCheckpointError

__all__ = [
    "DCP_METADATA_GLOBALS",
    "REFUSAL",
    "check_dcp_metadata",
    "check_extra_state",
    "load_dcp_metadata",
    "restricted_loads",
]

REFUSAL = "a checkpoint may hold data, never code"
"""In every refusal message: torch's DCP turns a reader's exception into text inside an
``AssertionError`` of a ``CheckpointException``, so :func:`refusal_in` looks for it."""
_REFUSED = re.compile(
    r"(\S+ (?:asks to import \S+?|uses a persistent id)[,:]|a non-tensor item .*?\))"
)
_DCP = "torch.distributed.checkpoint"
DCP_METADATA_GLOBALS: frozenset[tuple[str, str]] = frozenset(
    {
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("collections", "OrderedDict"),
        ("builtins", "set"),
        ("builtins", "frozenset"),
        *(
            (f"{_DCP}.metadata", name)
            for name in (
                "Metadata",
                "MetadataIndex",
                "TensorStorageMetadata",
                "BytesStorageMetadata",
                "ChunkStorageMetadata",
                "TensorProperties",
                "StorageMeta",
                "_MEM_FORMAT_ENCODING",
            )
        ),
        *(
            (f"{_DCP}.planner", name)
            for name in (
                "SavePlan",
                "WriteItem",
                "WriteItemType",
                "TensorWriteData",
                "LoadPlan",
                "ReadItem",
                "LoadItemType",
            )
        ),
        (f"{_DCP}.filesystem", "_StorageInfo"),
        (f"{_DCP}.filesystem", "_StoragePrefix"),
    }
)
"""``(module, name)`` pairs a torch DCP ``.metadata`` pickle may name (torch 2.13 and 2.14,
megatron-core 0.16 and 0.19 write only these), plus every ``torch.<dtype>``. They are data
classes, enums, ``torch.Size`` and torch's layout lookup: none runs code of the file's choice."""

_TENSOR_GLOBALS: frozenset[tuple[str, str]] = frozenset(
    {
        ("torch._utils", "_rebuild_tensor_v2"),
        ("torch._utils", "_rebuild_parameter"),
        ("torch._tensor", "_rebuild_from_type_v2"),
        ("torch", "device"),
        ("torch", "Tensor"),
        ("torch", "Size"),
        ("collections", "OrderedDict"),
        ("builtins", "set"),
        ("builtins", "frozenset"),
        ("builtins", "slice"),
        ("builtins", "complex"),
    }
)
_TE_RECIPES = "transformer_engine.common.recipe"
_LOAD_FROM_BYTES = {
    ("torch.storage", "_load_from_bytes"),
    ("megatron.core.safe_globals", "safe_load_from_bytes"),  # megatron-core 0.19 patches torch
}
_EXTRA_STATE_GLOBALS = _TENSOR_GLOBALS | {
    ("megatron.core.extensions.transformer_engine", "TEDelayedScaling"),
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "_reconstruct"),
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
}


def _is_dtype(module: str, name: str) -> bool:
    return module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)


def _load_storage_from_bytes(data: bytes) -> Any:
    """What ``torch.storage._load_from_bytes`` does, with torch's restricted unpickler."""
    return torch.load(io.BytesIO(data), weights_only=True)


class _RestrictedUnpickler(pickle.Unpickler):
    """Resolves only allow-listed globals; refuses everything else before importing it."""

    def __init__(self, file: BinaryIO, what: str, allowed: Callable[[str, str], bool]) -> None:
        super().__init__(file)
        self.what, self.allowed = what, allowed

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _LOAD_FROM_BYTES and self.allowed(module, name):
            return _load_storage_from_bytes
        if self.allowed(module, name):
            return super().find_class(module, name)
        raise UnsafeCheckpointError(
            f"{self.what} asks to import {module}.{name}, which checkpoint data never needs: "
            f"refusing to load it ({REFUSAL}). Someone or something "
            "replaced this file; use a checkpoint you trust (docs/stability.md, trust model)"
        )

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeCheckpointError(
            f"{self.what} uses a persistent id ({str(pid)[:60]!r}), which DCP metadata never "
            f"holds: refusing to load it ({REFUSAL})"
        )


def _dcp_allowed(module: str, name: str) -> bool:
    return (module, name) in DCP_METADATA_GLOBALS or _is_dtype(module, name)


def _unpickle(file: BinaryIO, what: str, allowed: Callable[[str, str], bool]) -> Any:
    try:
        return _RestrictedUnpickler(file, what, allowed).load()
    except UnsafeCheckpointError:
        raise
    except Exception as exc:  # truncated, not a pickle, a class that changed: unreadable
        raise pickle.UnpicklingError(
            f"{what} is not readable ({type(exc).__name__}: {exc})"
        ) from exc


def load_dcp_metadata(file: BinaryIO, what: str = "dist/.metadata") -> Any:
    """Unpickle a torch DCP ``.metadata`` with :data:`DCP_METADATA_GLOBALS` only."""
    return _unpickle(file, what, _dcp_allowed)


def check_dcp_metadata(path: str | Path) -> None:
    """Raise :class:`UnsafeCheckpointError` when the ``.metadata`` at ``path`` names anything
    outside :data:`DCP_METADATA_GLOBALS` (nothing of it runs); other read errors propagate."""
    with open(path, "rb") as f:
        load_dcp_metadata(f, str(path))


class _PickleForDCP:
    """Stands in for the ``pickle`` module inside torch's DCP filesystem reader: ``load`` is
    restricted, everything else (``dump`` for saves) is the real module's."""

    def __init__(self, what: str) -> None:
        self.what = what

    def load(self, file: BinaryIO, *args: Any, **kwargs: Any) -> Any:
        name = getattr(file, "name", None)
        return load_dcp_metadata(file, f"{name}" if isinstance(name, str) else self.what)

    def __getattr__(self, name: str) -> Any:
        return getattr(pickle, name)


@contextlib.contextmanager
def restricted_loads(what: str) -> Iterator[None]:
    """Within this block, torch DCP reads ``.metadata`` with :func:`load_dcp_metadata` and
    every ``torch.load`` runs with ``weights_only=True`` (DCP's byte items, megatron's common
    state), whatever the caller asked for. ``what``: the checkpoint, for messages."""
    from torch.distributed.checkpoint import filesystem

    original_load = torch.load

    @functools.wraps(original_load)
    def weights_only_load(*args: Any, **kwargs: Any) -> Any:
        kwargs["weights_only"] = True
        try:
            return original_load(*args, **kwargs)
        except pickle.UnpicklingError as exc:
            if "Weights only load failed" in str(exc) or "Unsupported" in str(exc):
                raise UnsafeCheckpointError(
                    f"a non-tensor item of {what} holds a pickle that names code (torch's "
                    f"restricted loader refused it: {str(exc).splitlines()[0][:200]}); refusing "
                    f"to load it ({REFUSAL})"
                ) from exc
            raise

    saved_pickle = filesystem.pickle
    filesystem.pickle = _PickleForDCP(f"{what}/dist/.metadata")  # type: ignore[assignment]
    torch.load = weights_only_load  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.load = original_load  # type: ignore[assignment]
        filesystem.pickle = saved_pickle


def _extra_state_allowed(module: str, name: str) -> bool:
    if (module, name) in _EXTRA_STATE_GLOBALS or (module, name) in _LOAD_FROM_BYTES:
        return True
    return _is_dtype(module, name) or (module == _TE_RECIPES and "." not in name)


def refusal_in(exc: BaseException) -> str | None:
    """The refusal inside ``exc`` (an :class:`UnsafeCheckpointError` anywhere in its chain,
    or its message turned into text by torch DCP), or None."""
    from reco_megatron.megatron.checkpoint.integrity import chain

    for e in chain(exc):
        if isinstance(e, UnsafeCheckpointError):
            return str(e)
    for e in chain(exc):
        if REFUSAL in str(e):
            found = _REFUSED.search(str(e))
            what = found.group(1).rstrip(",:") if found else "a pickle in the checkpoint names code"
            return f"{what}: refusing to load it ({REFUSAL})"
    return None


def check_extra_state(state_dict: dict[str, Any], what: str) -> None:
    """Unpickle every ``*._extra_state`` that is a uint8 tensor (transformer-engine's FP8
    state, which TE itself reads with ``pickle.loads``) with an allow-list of tensor rebuild
    functions and TE's recipe classes; raise :class:`UnsafeCheckpointError` for anything else,
    so TE never unpickles a payload that names code."""
    for key, value in state_dict.items():
        if not key.endswith("_extra_state") or not isinstance(value, torch.Tensor):
            continue
        if value.dtype != torch.uint8 or value.numel() == 0:
            continue
        data = value.detach().cpu().numpy().tobytes()
        _unpickle(io.BytesIO(data), f"{key} of {what}", _extra_state_allowed)
