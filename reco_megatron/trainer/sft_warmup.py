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
from typing import Any

from reco_megatron.megatron import data_parallel_share
from reco_megatron.trainer import setup
from reco_megatron.trainer.progress import sft_progress
from reco_megatron.trainer.stop_signals import stop_agreed
from reco_megatron.utils.logging import get_logger

__all__ = ["run_warmup"]

logger = get_logger(__name__)


def run_warmup(trainer: Any, start: int) -> bool:
    """SFT steps ``start + 1 .. sft.steps`` on ``trainer``'s engine, then ``step_00000000``.

    Returns True when a stop signal ended the warm-up early (its checkpoint is saved), False
    when it completed. ``trainer``: the :class:`~reco_megatron.trainer.loop.Trainer` (its
    config, tokenizer, engine, data-parallel rank, signals and ``save``)."""
    cfg = trainer.cfg
    sft = cfg.sft
    batches = setup.sft_batches(
        trainer.tokenizer,
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
    progress = sft_progress(len(batches), trainer.rank == 0, cfg.trainer.progress, start)
    try:
        for i in range(start, len(batches)):
            if _step(trainer, batches, i, progress):
                return True
    finally:
        progress.close()
        trainer.phases["sft"] = time.perf_counter() - began
    logger.info("sft warm-up: %d steps in %.1f s", len(batches) - start, trainer.phases["sft"])
    trainer.save()  # step_00000000: the end of the warm-up, kept by every keep_last
    return False


def _step(trainer: Any, batches: list[Any], i: int, progress: Any) -> bool:
    """SFT step ``i + 1``; True when a stop signal ended the warm-up after it (saved)."""
    share = data_parallel_share(batches[i], trainer.dp_rank, trainer.dp_size, 1)
    metrics = trainer.engine.sft_step(share, trainer.cfg.sft.lr)
    trainer.unsaved_progress = True
    progress.update({"nll": metrics.get("loss", float("nan"))})
    if i < len(batches) - 1 and stop_agreed(trainer.signals):
        trainer.signals.saving = True
        trainer.save(sft_step=i + 1)
        trainer.signals.saved = True
        logger.warning(
            "stopped by signal %s during the SFT warm-up after step %d/%d; checkpoint saved, "
            "exit 75 (resume by running the same command)",
            trainer.signals.name or "(on another rank)",
            i + 1,
            len(batches),
        )
        return True
    return False
