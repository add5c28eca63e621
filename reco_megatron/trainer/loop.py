"""The ReCo RL loop.

Each step: sample ``prompts_per_step`` prompts (identically on every rank) -> this data-parallel
rank generates G responses for *its* groups (seeded per prompt, so the responses do not depend
on the parallel layout) -> rewards in the isolated pool (on the first rank of each model-parallel
group, then broadcast) -> group advantages -> the engine's old-policy pass and response weights
-> ``minibatches_per_rollout`` optimizer steps -> weights streamed to the rollout engine ->
one row of ``metrics.jsonl``.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from reco_megatron.algo import group_advantages
from reco_megatron.config import dump_config
from reco_megatron.config.dump import config_to_dict
from reco_megatron.data.chat import PromptFormatter
from reco_megatron.data.sampler import PromptSampler
from reco_megatron.megatron import (
    CheckpointSpaceError,
    ReCoEngine,
    initialize_parallel,
    rank_layout,
    save_checkpoint,
    sft_checkpoint_name,
)
from reco_megatron.parallel.collectives import collective_device
from reco_megatron.rewards.pool import RewardPool
from reco_megatron.trainer import setup
from reco_megatron.trainer.config import TrainConfig
from reco_megatron.trainer.lifecycle import (
    CONFIG_HEADER,
    EXIT_RESUMABLE,
    DeadRunGuard,
    ResumeCheck,
    RunLock,
    StabilityGuard,
    StopSignals,
    stop_here,
    take_run_directory,
    unparsable_count,
)
from reco_megatron.trainer.orchestration import (
    PromptSource,
    RolloutSource,
    WorkerLost,
    build_rollout_batch,
    build_rollout_source,
)
from reco_megatron.trainer.preflight import Checked, preflight
from reco_megatron.trainer.reporting import (
    MetricsWriter,
    announce_startup,
    global_row,
    plot_training_curves,
    reward_health,
    rollout_counters,
    truncate_jsonl,
)
from reco_megatron.trainer.setup import initialise_weights
from reco_megatron.trainer.sft_warmup import run_warmup
from reco_megatron.utils.logging import get_logger

logger = get_logger(__name__)


class Trainer:
    """Build everything from a :class:`TrainConfig`; :meth:`run` trains to ``max_steps``."""

    def __init__(self, cfg: TrainConfig, signals: StopSignals | None = None) -> None:
        self.cfg = cfg
        self.phases: dict[str, float] = {}  # seconds per phase, for the end-of-run summary
        self.config_plain = config_to_dict(cfg)  # as loaded: what checkpoints record
        self._own_signals = signals is None  # the CLI passes its own; tests may not
        self.signals = signals or StopSignals()
        self.lock: RunLock | None = None
        self.rewards: RewardPool | None = None
        self.rollout: RolloutSource | None = None
        self.writer: MetricsWriter | None = None
        checked = preflight(cfg)  # ConfigError before anything is created or computed
        # Stop signals are handled from here on: during the pure checks above there is nothing
        # to save, and a rank that torchrun stops because another failed them dies quietly.
        self.signals.install()
        announce_startup(cfg)
        initialize_parallel(cfg.parallel, seed=cfg.trainer.seed)
        self.layout = rank_layout()
        self.rank = self.layout.rank
        self.dp_rank = self.layout.dp_rank
        self.dp_size = self.layout.dp_size
        # one trainer per run directory, before anything is written to it
        self.lock, self.run_id = take_run_directory(cfg.trainer.output_dir, self.rank)
        try:
            self._build(checked)
        except BaseException:  # an unusable checkpoint, a refused resume, a second Ctrl-C
            self.close(failed_start=True)
            raise

    def _build(self, checked: Checked) -> None:
        cfg = self.cfg
        self.out = setup.prepare_output_dir(
            cfg.trainer.output_dir, remove_partials=self.rank == 0, run_id=self.run_id
        )
        dist.barrier()  # no rank looks at checkpoints/ while rank 0 clears partial saves
        self.resume = ResumeCheck(cfg, self.config_plain, self.out, self.rank)
        self.tokenizer = checked.tokenizer
        if checked.dataset is None:
            checked.dataset = setup.countdown_prompts(self.out, cfg, self.tokenizer)
        self.dataset = checked.dataset
        self.formatter = PromptFormatter(tokenizer=self.tokenizer, template=cfg.data.template)
        self.sampler = PromptSampler(
            len(self.dataset), cfg.rollout.prompts_per_step, seed=cfg.trainer.seed
        )
        total_updates = (
            cfg.trainer.max_steps
            * cfg.update.minibatches_per_rollout
            * (cfg.update.epochs_per_rollout)
        )
        self.engine = ReCoEngine(
            cfg.model,
            cfg.parallel,
            cfg.loss,
            cfg.optimizer,
            cfg.update,
            total_optimizer_steps=total_updates,
            seed=cfg.trainer.seed,
            response_weight_policy=cfg.response_weight_policy,
        )
        self.converter = setup.hf_converter(cfg, on_gpu=self.engine.on_gpu)
        prompts = PromptSource(cfg, self.dataset, self.tokenizer, self.formatter, self.sampler)
        self.rollout = build_rollout_source(
            cfg, self.tokenizer, self.engine, self.converter, prompts, self.layout, self.out,
            self.run_id,
        )  # fmt: skip
        self.rewards = RewardPool(cfg.reward) if self.layout.first_of_replica else None
        self.unsaved_progress = False  # trained since the last checkpoint (or the start)
        self.guard = StabilityGuard(cfg.stability, c_max=cfg.loss.c_max)
        ck = cfg.checkpoint
        self.dead_run = DeadRunGuard(
            cfg.stability,
            self.ckpt_root,
            ck.init_megatron or ck.init_hf or None,
            save_interval=ck.save_interval,
            keep_last=ck.keep_last,
        )
        start = initialise_weights(
            cfg,
            self.engine,
            self.ckpt_root,
            self.resume,
            self.sampler,
            self.rollout,
            self.converter,
        )
        self.step = start.step
        self.sft_from = start.sft_from  # the SFT step to continue from, None: no warm-up
        if self.sft_from is None:
            self.rollout.start(self.step)
        if self.rank == 0:
            self.resume.record(self.step, start.resumed)
            dump_config(cfg, self.out / "config.yaml", header=CONFIG_HEADER)
            for name in ("metrics.jsonl", "eval.jsonl"):  # rows after the resumed step are redone
                truncate_jsonl(self.out / name, self.step)
        self.coverage = setup.coverage_evaluator(
            cfg,
            self.out,
            self.tokenizer,
            self.formatter,
            here=self.rank == 0 and self.rewards is not None,
        )
        self.writer = (
            MetricsWriter(
                self.out,
                cfg.trainer.max_steps,
                loggers=cfg.trainer.loggers,
                project=cfg.trainer.project,
                run_config=self.config_plain,
                progress=cfg.trainer.progress and self.step < cfg.trainer.max_steps,
                initial_step=self.step,
                log_interval=cfg.trainer.log_interval,
            )
            if self.rank == 0
            else None
        )

    # ------------------------------------------------------------------ set-up
    @property
    def ckpt_root(self) -> Path:
        return self.out / "checkpoints"

    # ------------------------------------------------------------------ one step
    def _score(
        self, texts: list[str], golds: list[str]
    ) -> tuple[torch.Tensor, dict[str, float], dict[str, float]]:
        """Scores ``[B]`` (from the first rank of this model-parallel group), the pool's
        metrics (that rank's), and the step's global reward-failure columns."""
        n = len(texts)
        scores = torch.zeros(n, dtype=torch.float64)
        metrics: dict[str, float] = {}
        statuses = None
        if self.rewards is not None:
            batch = self.rewards.score(texts, golds)
            scores = torch.tensor(batch.scores, dtype=torch.float64)
            metrics, statuses = dict(batch.metrics), batch.statuses
        group = self.layout.mp_group
        unparsable = torch.tensor([unparsable_count(statuses)], dtype=torch.float64)
        buf = torch.cat([scores, reward_health.local_counts(statuses, n), unparsable])
        buf = buf.to(collective_device(group))
        if dist.get_world_size(group) > 1:
            dist.broadcast(buf, src=dist.get_global_rank(group, 0), group=group)
        counts = buf[n:].clone()
        if self.dp_size > 1:
            dist.all_reduce(counts, group=self.layout.dp_group)
        counts = counts.cpu()
        row = reward_health.failure_row(counts[:-1])
        row["reward_unparsable_frac"] = float(counts[-1]) / max(float(counts[-2]), 1.0)
        return buf[:n].cpu().float(), metrics, row

    def train_step(self) -> dict[str, Any]:
        cfg = self.cfg
        logger.debug("step %d begins", self.step + 1)  # after the last step's stop check
        g = cfg.rollout.group_size
        times: dict[str, float] = {}
        t0 = step_start = time.perf_counter()
        assert self.rollout is not None
        got = self.rollout.next_step(self.step)
        prompts, completions, golds = got.prompts, got.completions, got.golds
        responses = [c.token_ids for group in completions for c in group]
        logprobs = [c.logprobs for group in completions for c in group]
        times["time_rollout"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        texts = [self.tokenizer.decode(ids) for ids in responses]
        rewards, reward_metrics, failures = self._score(
            texts, [gold for gold in golds for _ in range(g)]
        )
        reward_health.check_failures(
            self.step + 1, failures, cfg.reward.max_failed_frac, cfg.reward.reward
        )
        advantages, adv_metrics = group_advantages(
            rewards, g, cfg.loss.advantage_mode, eps=cfg.loss.advantage_eps
        )
        times["time_reward"] = time.perf_counter() - t0

        batch = build_rollout_batch(
            prompts,
            responses,
            logprobs,
            advantages,
            g,
            self.tokenizer.pad_id,
            routed_experts=[c.routed_experts for group in completions for c in group],
        )
        self.rollout.before_update()
        prepared, prep = self.engine.prepare(batch)
        times["time_old_logprob"] = prep.pop("time_old_logprob", float("nan"))
        t0 = time.perf_counter()
        steps = self.engine.train_on_rollout(prepared, self.guard.decide)
        times["time_train"] = time.perf_counter() - t0
        self.step += 1
        times.update(self.rollout.after_update(self.step))  # the new weights to the rollouts

        local = rollout_counters(rewards, completions, g)
        local["rollout_mp_divergence_sum"] = float(got.diverged)
        row = global_row(
            self.step, local, steps, prep, reward_metrics, adv_metrics, self.engine, self.layout
        )
        row.update(failures)
        row.update(times)
        row.update(got.metrics)
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
            "config": self.config_plain,
            "inputs": self.resume.inputs,
        }
        try:
            save_checkpoint(
                self.ckpt_root,
                self.step,
                self.engine,
                state,
                keep_last=self.cfg.checkpoint.keep_last,
                name=sft_checkpoint_name(sft_step) if sft_step is not None else None,
                group_writable=self.cfg.checkpoint.group_writable,
                run_id=self.run_id,
            )
        except CheckpointSpaceError as exc:  # the message says it all: no traceback
            raise SystemExit(f"reco-train: {exc}") from None
        self.unsaved_progress = False

    def run(self) -> int:
        """Train until ``trainer.max_steps``; returns the process exit status (0, or
        :data:`EXIT_RESUMABLE` after a stop signal and its checkpoint)."""
        cfg = self.cfg
        rl_start: float | None = None
        try:
            if self.sft_from is not None:
                if self._warm_up(self.sft_from):
                    return EXIT_RESUMABLE
                self.sft_from = None
                self.rollout.start(self.step)
            rl_start = time.perf_counter()
            if self.step >= cfg.trainer.max_steps > 0:  # resumed with no step left
                logger.info(
                    "nothing to do: the checkpoint is at step %d, trainer.max_steps=%d (raise it "
                    "to train on, or choose a new trainer.output_dir)",
                    self.step,
                    cfg.trainer.max_steps,
                )
            self._evaluate_coverage()
            if self._stop_here():  # a signal during start-up or the step-0 evaluation
                return EXIT_RESUMABLE
            while self.step < cfg.trainer.max_steps:
                try:
                    row = self.train_step()
                except WorkerLost as exc:  # every rank raises it at the same step
                    logger.error("reco-train: %s; stopping resumably at step %d", exc, self.step)
                    if self.unsaved_progress:
                        self.save()
                    return EXIT_RESUMABLE
                self.unsaved_progress = True
                if self.writer is not None:
                    self.writer.write(row)
                self.dead_run.observe(row)
                self._evaluate_coverage()
                interval = cfg.checkpoint.save_interval
                if interval and self.step % interval == 0 and self.step < cfg.trainer.max_steps:
                    self.save()
                if self._stop_here():
                    return EXIT_RESUMABLE
            if not (self.ckpt_root / f"step_{self.step:08d}").exists():
                self.save()
        finally:
            if rl_start is not None:
                self.phases["rl"] = time.perf_counter() - rl_start
            self.close()
        if self.rank == 0 and (self.out / "metrics.jsonl").exists():
            plot_training_curves(self.out / "metrics.jsonl", self.out / "training_curves.png")
        if self.coverage is not None:
            self.coverage.finish()
        return 0

    def _stop_here(self) -> bool:
        save = self.save if self.unsaved_progress else None
        return stop_here(self.signals, step=self.step, save=save)

    def _warm_up(self, start: int) -> bool:
        """The SFT warm-up from step ``start``; True when a stop signal ended it (saved)."""
        self.unsaved_progress = True
        warmup = run_warmup(
            self.cfg,
            self.engine,
            self.tokenizer,
            self.signals,
            self.save,
            start=start,
            dp_rank=self.dp_rank,
            dp_size=self.dp_size,
            rank=self.rank,
        )
        self.phases["sft"] = warmup.seconds
        return warmup.stopped

    # ------------------------------------------------------------------ coverage eval
    def _evaluate_coverage(self) -> None:
        """pass@k on the held-out prompts with the rollout engine's current weights (rank 0)."""
        if self.coverage is None or self.rewards is None:
            return
        rewards = self.rewards
        self.coverage.maybe_run(
            self.step,
            self.cfg.trainer.max_steps,
            self.rollout.engine,
            lambda texts, golds: rewards.score(texts, golds).scores,
        )

    def close(self, *, failed_start: bool = False) -> None:
        """Stop the workers and release the run directory (idempotent)."""
        from reco_megatron.megatron import shutdown_async_writer

        if self.writer is not None:
            self.writer.close()
        if self.rewards is not None:
            self.rewards.close()
        if self.rollout is not None:
            self.rollout.close()
        shutdown_async_writer()
        if self.lock is not None:
            self.lock.release(failed_start=failed_start)
        if self._own_signals:
            self.signals.restore()
