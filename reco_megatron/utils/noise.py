"""Known, harmless third-party warnings: one line each, once, on rank 0.

Starting a run imports megatron-core and torch, which warn about things that are expected
here (no transformer-engine or apex on CPU, no CUDA runtime, APIs megatron-core itself
deprecates); unhandled, that is about ten multi-line messages per rank per start, some in the
middle of the progress bar. :func:`quiet_known_warnings` (called first by ``reco-train``,
``reco-export`` and ``reco-eval``) replaces each message of :data:`KNOWN` by a one-line
summary logged once on rank 0, and sends every other Python warning through the package's
logger (one line, rank-tagged, above the progress bar).

The notes wait for the run's own first log line and come out just before it, so that an
entry point that stops on a configuration error prints the error and nothing else (the
notes of a run that stops with an error are dropped). An unknown warning is shown at once,
one line, with its source as ``package/module.py:line`` (no site-packages prefix).

The switch, ``RECO_KNOWN_WARNINGS``: ``once`` (default) as above, ``off`` drops the known
messages entirely, ``all`` leaves every warning as the libraries print it.
"""

from __future__ import annotations

import logging
import os
import re
import warnings
from typing import Any

from reco_megatron.utils.logging import get_logger, tqdm_aware_handler

logger = get_logger("reco_megatron.known_warnings")

KNOWN: tuple[tuple[str, str, str], ...] = (
    (
        "te-apex",
        r"(Transformer Engine and Apex are|Apex is) not installed",
        "transformer-engine / apex are not installed: megatron-core uses its torch fallbacks "
        "(expected on CPU; GPU containers have both)",
    ),
    (
        "absl",
        r"absl\.logging is not installed",
        "absl-py is not installed: megatron-core logs through the standard logging module",
    ),
    ("no-cuda", r"No CUDA runtime is found", "no CUDA runtime found: a CPU run"),
    (
        "mcore-deprecations",
        r"full scope is deprecated|MimoModelConfig is experimental|imports from "
        r"`dynamic_context\.py` will be removed|full_param_layout not provided",
        "megatron-core notes its own deprecated or experimental internals (cuda-graph scope, "
        "MIMO config, inference imports, DDP layout); nothing to change in the run",
    ),
    (
        "mcore-async-save",
        r"MCore's async save is deprecated",
        "megatron-core deprecates the async-save path its checkpointing uses (still supported "
        "in the versions reco-megatron pins)",
    ),
    (
        "torch-collectives",
        r"`torch\.distributed\.(reduce_scatter_tensor|all_gather_into_tensor)` is deprecated",
        "megatron-core calls torch collectives that torch deprecates (still supported)",
    ),
    (
        "dcp-single-process",
        r"torch\.distributed is disabled, unavailable or uninitialized, assuming the intent is "
        r"to load in a single process|The argument order of load has been changed|Please use "
        r"DTensor instead and we are deprecating ShardedTensor",
        "torch.distributed.checkpoint notes a single-process load and its own deprecations "
        "(reading a checkpoint outside a training run: export, eval, resume)",
    ),
    (
        "cuda-max-connections",
        r"recommended to set the environment variable CUDA_DEVICE_MAX_CONNECTIONS to 1",
        "megatron-core recommends CUDA_DEVICE_MAX_CONNECTIONS=1 for tensor-parallel overlap "
        "on GPUs (the Slurm scripts set it; no effect on CPU)",
    ),
    (
        "vllm-reduce-op",
        r"`torch\.distributed\.reduce_op` is deprecated",
        "vLLM's kernel dispatcher reads a deprecated torch.distributed alias while it imports "
        "(harmless)",
    ),
    (
        "non-leaf-grad",
        r"The \.grad attribute of a Tensor that is not a leaf Tensor is being accessed",
        "megatron-core's optimizer probes .grad of non-leaf tensors when zeroing gradients "
        "(harmless)",
    ),
)
"""``(key, regex on the message, one-line summary)`` of every known, harmless warning."""

_PATTERNS = [(key, re.compile(pattern), summary) for key, pattern, summary in KNOWN]
_seen: set[str] = set()
_state: dict[str, Any] = {}
_pending: list[str] = []
_SITE = re.compile(r".*[/\\](?:site|dist)-packages[/\\]")


def known(message: str) -> tuple[str, str] | None:
    """``(key, summary)`` when ``message`` is a known, harmless warning."""
    for key, pattern, summary in _PATTERNS:
        if pattern.search(message):
            return key, summary
    return None


def _note(key: str, summary: str) -> None:
    if _state.get("mode") == "once" and key not in _seen:
        _seen.add(key)
        _pending.append(summary)  # written before the run's next own log line


class _ReleaseNotes(logging.Filter):
    """On the package's handler: before a record of the run itself, the pending notes; before
    an error, nothing (the notes are dropped: the error is what matters)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if _pending and record.name != logger.name:
            notes = list(_pending)
            _pending.clear()
            if record.levelno < logging.ERROR:
                for summary in notes:
                    logger.info("known warning, harmless: %s", summary)
        return True


def release_notes() -> None:
    """Write the pending notes now (an entry point that has nothing else to say yet)."""
    for summary in list(_pending):
        logger.info("known warning, harmless: %s", summary)
    _pending.clear()


def short_source(filename: str) -> str:
    """``.../site-packages/torch/x.py`` -> ``torch/x.py``; other paths unchanged."""
    return _SITE.sub("", filename)


class _KnownFilter(logging.Filter):
    """On third-party loggers: a known record becomes its one-line note (once)."""

    def filter(self, record: logging.LogRecord) -> bool:
        hit = known(record.getMessage())
        if hit is None:
            return True
        _note(*hit)
        return False


def _showwarning(message, category, filename, lineno, file=None, line=None) -> None:
    text = str(message)
    hit = known(text)
    if hit is not None:
        _note(*hit)
        return
    first = text.strip().splitlines()[0] if text.strip() else repr(text)
    logger.warning("%s:%s: %s: %s", short_source(filename), lineno, category.__name__, first)


def quiet_known_warnings(mode: str | None = None) -> str:
    """Install the handling described in the module doc; returns the mode in effect.

    ``mode`` defaults to ``$RECO_KNOWN_WARNINGS`` (``once``). Idempotent.
    """
    mode = mode or os.environ.get("RECO_KNOWN_WARNINGS", "once")
    if mode not in ("once", "off", "all"):
        raise ValueError(f"RECO_KNOWN_WARNINGS must be once, off or all, got {mode!r}")
    _state["mode"] = mode
    if mode == "all" or _state.get("installed"):
        return mode
    warnings.showwarning = _showwarning
    for handler in logging.getLogger("reco_megatron").handlers:
        handler.addFilter(_ReleaseNotes())
    # torch logs its CUDA note on this logger itself: a logger filter sees it.
    logging.getLogger("torch.utils.cpp_extension").addFilter(_KnownFilter())
    # megatron-core's loggers have no handler: their warnings reach Python's last-resort
    # handler (raw lines, every rank, across the progress bar). The package's handler, with
    # the filter on it (a handler filter sees the records of every child logger), instead.
    handler = tqdm_aware_handler()
    handler.addFilter(_KnownFilter())
    megatron = logging.getLogger("megatron")
    megatron.addHandler(handler)
    megatron.propagate = False  # else a handler on the root logger would print the raw lines
    _state["installed"] = True
    return mode
