"""The supervised warm-up before RL, resumable like the RL loop.

The SFT batches are built up front from the seed (``setup.sft_batches``), so a warm-up can
restart at any step. After each SFT step the ranks agree on whether a stop signal arrived
(``stop_signals``): if so, a checkpoint ``sft_<n>`` (model, optimizer, RNG, the step reached)
is saved and the run exits 75; the next start loads it and continues with step ``n + 1``.
At the end of the warm-up ``step_00000000`` is saved: the base the RL run starts from (and
is compared with; ``keep_last`` never removes it), so a stop during RL step 1 does not redo
the warm-up.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from reco_megatron.data.tokenizer import Tokenizer
from reco_megatron.parallel.batch import RolloutBatch, data_parallel_share
from reco_megatron.trainer import setup
from reco_megatron.trainer.config import TrainConfig
from reco_megatron.trainer.lifecycle import StopSignals, stop_agreed
from reco_megatron.trainer.reporting import sft_progress
from reco_megatron.utils.logging import get_logger

__all__ = ["Warmup", "run_warmup"]

logger = get_logger(__name__)


class SFTEngine(Protocol):
    """What the warm-up needs of the training engine (``ReCoEngine``)."""

    def sft_step(self, batch: RolloutBatch, lr: float) -> dict[str, float]:
        """One supervised step on this rank's share of a batch; its metrics."""
        ...


@dataclass(frozen=True)
class Warmup:
    """How a warm-up call ended."""

    stopped: bool
    """A stop signal ended it early (its ``sft_<n>`` checkpoint is saved)."""
    seconds: float
    """Wall time of this call's SFT steps."""


def run_warmup(
    cfg: TrainConfig,
    engine: SFTEngine,
    tokenizer: Tokenizer,
    signals: StopSignals,
    save: Callable[..., None],
    *,
    start: int,
    dp_rank: int,
    dp_size: int,
    rank: int,
) -> Warmup:
    """SFT steps ``start + 1 .. sft.steps`` on ``engine``, then ``step_00000000``.

    ``save(sft_step=n)`` writes the checkpoint ``sft_<n>`` when a stop signal arrives after
    step ``n`` (then the warm-up returns), ``save()`` the ``step_00000000`` that ends it.
    This data-parallel rank (``dp_rank`` of ``dp_size``) trains on its share of each batch;
    global ``rank`` 0 shows the progress."""
    sft = cfg.sft
    batches = setup.sft_batches(
        tokenizer,
        cfg.data.template,
        steps=sft.steps,
        batch_size=sft.batch_size,
        solutions_per_problem=sft.solutions_per_problem,
        seed=cfg.trainer.seed,
        max_len=cfg.model.max_position_embeddings,
        countdown=cfg.data.countdown,
    )
    if start:
        logger.info("sft warm-up: resuming after step %d/%d", start, len(batches))
    began = time.perf_counter()
    progress = sft_progress(len(batches), rank == 0, cfg.trainer.progress, start)
    try:
        for i in range(start, len(batches)):
            share = data_parallel_share(batches[i], dp_rank, dp_size, 1)
            metrics = engine.sft_step(share, sft.lr)
            progress.update({"nll": metrics.get("loss", float("nan"))})
            if i < len(batches) - 1 and stop_agreed(signals):
                _stop(signals, save, i + 1, len(batches))
                return Warmup(stopped=True, seconds=time.perf_counter() - began)
    finally:
        progress.close()
    seconds = time.perf_counter() - began
    logger.info("sft warm-up: %d steps in %.1f s", len(batches) - start, seconds)
    save()  # step_00000000: the end of the warm-up, kept by every keep_last
    return Warmup(stopped=False, seconds=seconds)


def _stop(signals: StopSignals, save: Callable[..., None], step: int, steps: int) -> None:
    """Save ``sft_<step>`` after a stop signal and say so."""
    signals.saving = True
    save(sft_step=step)
    signals.saved = True
    logger.warning(
        "stopped by signal %s during the SFT warm-up after step %d/%d; checkpoint saved, "
        "exit 75 (resume by running the same command)",
        signals.name or "(on another rank)",
        step,
        steps,
    )
