"""A rank-aware logger: the package never prints.

``get_logger(__name__)`` returns a standard :mod:`logging` logger whose records carry the
process rank (from ``torch.distributed`` when initialised, else ``RANK`` from the environment)
and which, by default, lets only rank 0 emit INFO and below; warnings and errors pass on
every rank so a failure on rank 3 is never hidden.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator

_ROOT = "reco_megatron"
_configured = False


def current_rank() -> int:
    """Global rank of this process: torch.distributed if initialised, else ``$RANK``, else 0."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    except ImportError:  # pragma: no cover - torch is a hard dependency
        pass
    return int(os.environ.get("RANK", "0"))


class _RankFilter(logging.Filter):
    """Adds ``record.rank``; drops records below WARNING on ranks other than 0."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = current_rank()
        all_ranks = os.environ.get("RECO_LOG_ALL_RANKS", "0") == "1"
        return all_ranks or record.rank == 0 or record.levelno >= logging.WARNING


class _TqdmAwareHandler(logging.StreamHandler):
    """Writes through ``tqdm.write`` so that a line never lands inside a progress bar (tqdm
    clears the bar, prints the line, redraws the bar); a plain stream write without tqdm."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            from tqdm import tqdm
        except ImportError:  # pragma: no cover - tqdm is a dependency
            super().emit(record)
            return
        try:
            tqdm.write(self.format(record), file=self.stream)
            self.flush()
        except Exception:  # the logging contract: never raise from emit
            self.handleError(record)


def tqdm_aware_handler() -> logging.Handler:
    """A handler to stderr in the package's format (time, rank, level, logger), with the rank
    filter (INFO and below on rank 0 only), that keeps progress bars intact."""
    handler = _TqdmAwareHandler(sys.stderr)
    fmt = "[%(asctime)s rank%(rank)s %(levelname)s %(name)s] %(message)s"
    handler.setFormatter(logging.Formatter(fmt, "%H:%M:%S"))
    handler.addFilter(_RankFilter())
    return handler


def _configure() -> None:
    global _configured
    if _configured:
        return
    root = logging.getLogger(_ROOT)
    root.addHandler(tqdm_aware_handler())
    root.setLevel(os.environ.get("RECO_LOG_LEVEL", "INFO").upper())
    root.propagate = False
    _configured = True


def get_logger(name: str) -> logging.Logger:
    """Logger under the ``reco_megatron`` hierarchy with the rank filter installed once."""
    _configure()
    if not name.startswith(_ROOT):
        name = f"{_ROOT}.{name}"
    return logging.getLogger(name)


@contextlib.contextmanager
def quiet_third_party_import() -> Iterator[None]:
    """Import an optional library without letting it take over the process's logging.

    Some libraries configure logging when imported: Megatron-Bridge imports
    ``megatron.training``, which calls ``logging.basicConfig`` (every INFO record of every
    library to stdout from then on), and logs each optional symbol it cannot find with a full
    traceback at INFO. Inside this block, records at INFO and below are dropped (warnings
    still pass), and the root logger's handlers and level are put back afterwards, so probing
    whether such a library is usable prints nothing and changes nothing. Meant for a short
    import at setup: INFO records of other threads in that window are dropped too.
    """
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    disabled = logging.root.manager.disable
    logging.disable(max(disabled, logging.INFO))
    try:
        yield
    finally:
        logging.disable(disabled)
        root.handlers[:] = handlers
        root.setLevel(level)
