"""The ReCo RL loop.

Each step: sample ``prompts_per_step`` prompts (identically on every rank) -> this data-parallel
rank generates G responses for *its* groups (seeded per prompt, so the responses do not depend
on the parallel layout) -> rewards in the isolated pool (on the first rank of each model-parallel
group, then broadcast) -> group advantages -> the engine's old-policy pass and response weights
-> ``minibatches_per_rollout`` optimizer steps -> weights streamed to the rollout engine ->
one row of ``metrics.jsonl``.

:class:`Trainer` puts the rooms together (``docs/package-map.md``): the run's life
(:class:`~reco_megatron.trainer.lifecycle.RunLife`), where the groups come from and what they
score (``orchestration``), what the run reports
(:class:`~reco_megatron.trainer.reporting.RunReport`), and the engine the update runs on.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

from reco_megatron.algo import group_advantages
from reco_megatron.megatron import initialize_parallel, rank_layout, shutdown_async_writer
from reco_megatron.trainer import setup
from reco_megatron.trainer.config import TrainConfig
from reco_megatron.trainer.lifecycle import EXIT_RESUMABLE, RunLife, StopSignals
from reco_megatron.trainer.orchestration import (
    PushMismatch,
    RolloutSource,
    StepScorer,
    WorkerLost,
    build_rollout_source,
    completions_batch,
)
from reco_megatron.trainer.preflight import Checked, preflight
from reco_megatron.trainer.reporting import (
    RunReport,
    announce_startup,
    global_row,
    rollout_counters,
)
from reco_megatron.trainer.sft_warmup import run_warmup
from reco_megatron.utils.logging import get_logger

logger = get_logger(__name__)


class Trainer:
    """Build everything from a :class:`TrainConfig`; :meth:`run` trains to ``max_steps``."""

    def __init__(self, cfg: TrainConfig, signals: StopSignals | None = None) -> None:
        self.cfg = cfg
        self.phases: dict[str, float] = {}  # seconds per phase, for the end-of-run summary
        self.life = RunLife(cfg, signals)
        self.rollout: RolloutSource | None = None
        self.scorer: StepScorer | None = None
        self.report: RunReport | None = None
        checked = preflight(cfg)  # ConfigError before anything is created or computed
        self.life.install_signals()
        announce_startup(cfg)
        initialize_parallel(cfg.parallel, seed=cfg.trainer.seed)
        self.layout = rank_layout()
        self.rank = self.layout.rank
        self.life.take_directory(self.rank)
        try:
            self._build(checked)
        except BaseException:  # an unusable checkpoint, a refused resume, a second Ctrl-C
            self.close(failed_start=True)
            raise

    def _build(self, checked: Checked) -> None:
        cfg = self.cfg
        self.out = setup.prepare_output_dir(
            cfg.trainer.output_dir, remove_partials=self.rank == 0, run_id=self.life.run_id
        )
        dist.barrier()  # no rank looks at checkpoints/ while rank 0 clears partial saves
        resume = self.life.check_resume(self.out, self.rank)
        self.tokenizer = checked.tokenizer
        prompts = setup.prompt_source(cfg, self.out, self.tokenizer, checked.dataset)
        self.engine = setup.build_engine(cfg)
        converter = setup.hf_converter(cfg, on_gpu=self.engine.on_gpu)
        self.rollout = build_rollout_source(
            cfg, self.tokenizer, self.engine, converter, prompts, self.layout, self.out,
            self.life.run_id,
        )  # fmt: skip
        self.scorer = StepScorer(cfg.reward, self.layout)
        self.life.arm_guards(self.ckpt_root)
        start = setup.initialise_weights(
            cfg, self.engine, self.ckpt_root, resume, prompts.sampler, self.rollout, converter
        )
        self.step = start.step
        self.sft_from = start.sft_from  # the SFT step to continue from, None: no warm-up
        if self.sft_from is None:
            self.rollout.start(self.step)
        if self.rank == 0:
            self.life.record_start(self.out, self.step, start.resumed)
        self.report = RunReport(
            cfg, self.out, step=self.step, rank=self.rank, run_config=self.life.config_plain,
            phases=self.phases,
        )  # fmt: skip
        self.coverage = setup.coverage_evaluator(
            cfg, self.out, self.tokenizer, prompts.formatter,
            here=self.rank == 0 and self.scorer.pool is not None,
        )  # fmt: skip

    @property
    def ckpt_root(self) -> Path:
        return self.out / "checkpoints"

    # ------------------------------------------------------------------ one step
    def train_step(self) -> dict[str, Any]:
        """One RL step: groups -> rewards -> advantages -> updates -> new weights out."""
        cfg, g = self.cfg, self.cfg.rollout.group_size
        logger.debug("step %d begins", self.step + 1)  # after the last step's stop check
        times: dict[str, float] = {}
        t0 = step_start = time.perf_counter()
        got = self.rollout.next_step(self.step)
        completions = [c for group in got.completions for c in group]
        times["time_rollout"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        texts = [self.tokenizer.decode(c.token_ids) for c in completions]
        golds = [gold for gold in got.golds for _ in range(g)]
        rewards, reward_metrics, failures = self.scorer.score(self.step + 1, texts, golds)
        rewards = got.episode_rewards(rewards)  # multi-turn: per-turn rewards, failed -> 0
        advantages, adv_metrics = group_advantages(
            rewards, g, cfg.loss.advantage_mode, eps=cfg.loss.advantage_eps
        )
        times["time_reward"] = time.perf_counter() - t0

        batch = completions_batch(got.prompts, completions, advantages, g, self.tokenizer.pad_id)
        self.rollout.before_update()
        prepared, prep = self.engine.prepare(batch)
        times["time_old_logprob"] = prep.pop("time_old_logprob", float("nan"))
        t0 = time.perf_counter()
        steps = self.engine.train_on_rollout(prepared, self.life.guard.decide)
        times["time_train"] = time.perf_counter() - t0
        self.step += 1
        times.update(self.rollout.after_update(self.step))  # the new weights to the rollouts

        local = rollout_counters(rewards, got.completions, g) | got.counters
        local["rollout_mp_divergence_sum"] = float(got.diverged)
        row = global_row(
            self.step, local, steps, prep, reward_metrics, adv_metrics, self.engine, self.layout
        )
        for part in (failures, times, got.metrics):
            row.update(part)
        trained = row["response_len_mean"] * cfg.rollout.prompts_per_step * g
        row["tokens_per_s"] = trained / (time.perf_counter() - step_start)
        return row

    # ------------------------------------------------------------------ the run
    def save(self, *, sft_step: int | None = None) -> None:
        """Checkpoint of the current step (``sft_step``: inside the SFT warm-up)."""
        state = {
            "step": self.step,
            "phase": "sft" if sft_step is not None else "rl",
            "sft_step": sft_step,
            "sampler": self.rollout.sampler_state(),
            "rollout": self.rollout.state_dict(),
            "config": self.life.config_plain,
            "inputs": self.life.resume.inputs,
        }
        setup.save_step(self.cfg, self.engine, state, sft_step=sft_step, run_id=self.life.run_id)
        self.life.unsaved_progress = False

    def run(self) -> int:
        """Train until ``trainer.max_steps``; returns the process exit status (0, or
        :data:`EXIT_RESUMABLE` after a stop signal and its checkpoint)."""
        max_steps = self.cfg.trainer.max_steps
        rl_start: float | None = None
        try:
            if self.sft_from is not None:
                if self._warm_up(self.sft_from):
                    return EXIT_RESUMABLE
                self.sft_from = None
                self.rollout.start(self.step)
            rl_start = time.perf_counter()
            self.report.restart_clock()  # the first RL step's time leaves the warm-up out
            if self.step >= max_steps > 0:  # resumed with no step left
                logger.info(
                    "nothing to do: the checkpoint is at step %d, trainer.max_steps=%d (raise it "
                    "to train on, or choose a new trainer.output_dir)", self.step, max_steps,
                )  # fmt: skip
            self._evaluate_coverage()
            if self.life.stop_here(self.step, self.save):  # during start-up or step-0 eval
                return EXIT_RESUMABLE
            while self.step < max_steps:
                try:
                    row = self.train_step()
                except (WorkerLost, PushMismatch) as exc:  # every rank, at the same step
                    logger.error("reco-train: %s; stopping resumably at step %d", exc, self.step)
                    if self.life.unsaved_progress:
                        self.save()
                    return EXIT_RESUMABLE
                self.report.write(row)
                self.life.observe(row)
                self._evaluate_coverage()
                interval = self.cfg.checkpoint.save_interval
                if interval and self.step % interval == 0 and self.step < max_steps:
                    self.save()
                if self.life.stop_here(self.step, self.save):
                    return EXIT_RESUMABLE
            if not (self.ckpt_root / f"step_{self.step:08d}").exists():
                self.save()
        finally:
            if rl_start is not None:
                self.phases["rl"] = time.perf_counter() - rl_start
            self.close()
        self.report.draw_curves()
        if self.coverage is not None:
            self.coverage.finish()
        return 0

    def _warm_up(self, start: int) -> bool:
        """The SFT warm-up from step ``start``; True when a stop signal ended it (saved)."""
        self.life.unsaved_progress = True
        layout = self.layout
        warmup = run_warmup(
            self.cfg, self.engine, self.tokenizer, self.life.signals, self.save, start=start,
            dp_rank=layout.dp_rank, dp_size=layout.dp_size, rank=self.rank,
        )  # fmt: skip
        self.phases["sft"] = warmup.seconds
        return warmup.stopped

    def _evaluate_coverage(self) -> None:
        """pass@k on the held-out prompts with the rollout engine's current weights (rank 0)."""
        if self.coverage is not None and self.scorer.pool is not None:
            self.coverage.maybe_run(
                self.step, self.cfg.trainer.max_steps, self.rollout.engine, self.scorer.score_here
            )

    def close(self, *, failed_start: bool = False) -> None:
        """Stop the workers and release the run directory (idempotent)."""
        for part in (self.report, self.scorer, self.rollout):
            if part is not None:
                part.close()
        shutdown_async_writer()
        self.life.close(failed_start=failed_start)
