"""Start-up pieces of a run, and the trainer's door to the checkpoint code.

Output directory checks, prompt data, SFT batches, the HF weight converter, and where a run's
weights and loop state come from (:func:`initialise_weights`): resume from the run directory's
``checkpoints/latest`` (``checkpoint.resume``; the config diff was checked before, by
:class:`~reco_megatron.trainer.lifecycle.config_history.ResumeCheck`), else initialise the engine
from ``checkpoint.init_megatron`` (a reco-megatron checkpoint, any TP/PP) or ``checkpoint.init_hf``
(a Hugging Face checkpoint), else keep the seeded initial weights. The other trainer modules
read checkpoints through :func:`saved_model_layout`; the run's life (``lifecycle``) has its
own small door for what a resume reads and the cleanup after an aborted save.
"""

from __future__ import annotations

import os
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from reco_megatron.config import ConfigError
from reco_megatron.data.chat import PromptFormatter
from reco_megatron.data.countdown import generate, write_splits
from reco_megatron.data.dataset import DatasetConfig, PromptDataset
from reco_megatron.data.sampler import PromptSampler
from reco_megatron.data.tokenizer import Tokenizer
from reco_megatron.megatron import (
    CheckpointError,
    CheckpointSpaceError,
    ReCoEngine,
    latest_checkpoint,
    load_checkpoint,
    read_meta,
    remove_partial_checkpoints,
    resume_latest,
    save_checkpoint,
    sft_checkpoint_name,
)
from reco_megatron.parallel.batch import RolloutBatch
from reco_megatron.trainer.config import CountdownConfig, TrainConfig
from reco_megatron.trainer.orchestration import PromptSource, RolloutClient
from reco_megatron.utils.logging import get_logger

if TYPE_CHECKING:
    from reco_megatron.eval.during_training import CoverageEvaluator

logger = get_logger(__name__)

MIN_FREE_BYTES = 64 * 1024 * 1024


def _nearest_existing(path: Path) -> Path:
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def prepare_output_dir(path: str | Path, *, remove_partials: bool = True, run_id: str = "") -> Path:
    """Create ``path`` and prove it is writable with room to spare, before any compute.

    ``remove_partials``: first remove the partial checkpoints an interrupted save of run
    ``run_id`` left (only the process holding the run directory's lock may: ``run_lock``;
    other ranks pass False).

    Raises:
        ConfigError: not writable, or under :data:`MIN_FREE_BYTES` free once the partial
            checkpoints of an interrupted save are removed; nothing is left behind (a
            directory this call created is removed again).
    """
    out = Path(path)
    # a save cut short (SIGKILL, full disk) leaves .tmp-step_*: it must not eat the space
    if remove_partials:
        remove_partial_checkpoints(out / "checkpoints", run_id=run_id)
    free = shutil.disk_usage(_nearest_existing(out)).free
    if free < MIN_FREE_BYTES:
        raise ConfigError(
            [
                f"trainer.output_dir={str(out)!r} has only {free // 2**20} MiB free; "
                "checkpoints need more: free space or choose another directory"
            ]
        )
    created = _nearest_existing(out) != out.absolute()
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".write_probe.{os.getpid()}"  # per process: ranks share the directory
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as exc:
        if created:
            shutil.rmtree(out, ignore_errors=True)
        raise ConfigError(
            [
                f"trainer.output_dir={str(out)!r} is not writable ({exc.strerror}): choose "
                "another directory with trainer.output_dir=..."
            ]
        ) from exc
    return out


def ensure_countdown_data(
    data_dir: Path, countdown: CountdownConfig, seed: int
) -> tuple[Path, Path]:
    """The countdown splits under ``data_dir`` (written once by global rank 0; the caller
    waits at a barrier). ``countdown``: the ``data.countdown`` section."""
    train, held_out = data_dir / "train.jsonl", data_dir / "eval.jsonl"
    if _global_rank() == 0 and not train.exists():
        write_splits(
            data_dir,
            n_train=countdown.n_train,
            n_eval=countdown.n_eval,
            seed=seed,
            **countdown.generate_kwargs(),
        )
    return train, held_out


def _global_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))


def load_prompts(path: Path, cfg: DatasetConfig, tokenizer: Tokenizer) -> PromptDataset:
    """The prompt dataset, validated row by row (errors name file and line)."""
    return PromptDataset(path, cfg, tokenizer=tokenizer)


def countdown_prompts(out: Path, cfg: TrainConfig, tokenizer: Tokenizer) -> PromptDataset:
    """The training split of the countdown task under ``out/data`` (generated once by global
    rank 0 while the others wait), loaded as the prompt dataset. Collective."""
    import torch.distributed as dist

    train_path, _ = ensure_countdown_data(out / "data", cfg.data.countdown, cfg.trainer.seed)
    dist.barrier()
    return load_prompts(train_path, cfg.prompt_dataset(), tokenizer)


def prompt_source(
    cfg: TrainConfig, out: Path, tokenizer: Tokenizer, dataset: PromptDataset | None
) -> PromptSource:
    """The run's prompts: ``dataset`` as the pre-flight loaded it, else the countdown task
    generated under ``out/data`` (collective), with their chat formatting and the seeded
    sampler of ``prompts_per_step`` groups per step."""
    if dataset is None:
        dataset = countdown_prompts(out, cfg, tokenizer)
    formatter = PromptFormatter(tokenizer=tokenizer, template=cfg.data.template)
    sampler = PromptSampler(len(dataset), cfg.rollout.prompts_per_step, seed=cfg.trainer.seed)
    return PromptSource(cfg, dataset, tokenizer, formatter, sampler)


def build_engine(cfg: TrainConfig) -> ReCoEngine:
    """The Megatron engine (model, optimizer, loss layers) of this rank, with the learning-rate
    schedule over every optimizer step the run will take."""
    u = cfg.update
    total_updates = cfg.trainer.max_steps * u.minibatches_per_rollout * u.epochs_per_rollout
    return ReCoEngine(
        cfg.model,
        cfg.parallel,
        cfg.loss,
        cfg.optimizer,
        cfg.update,
        total_optimizer_steps=total_updates,
        seed=cfg.trainer.seed,
        response_weight_policy=cfg.response_weight_policy,
    )


def sft_batches(
    tokenizer: Tokenizer,
    template: str,
    *,
    steps: int,
    batch_size: int,
    solutions_per_problem: int,
    seed: int,
    max_len: int,
    countdown: CountdownConfig,
) -> list[RolloutBatch]:
    """Countdown SFT data: prompt + the response (``"Answer: <expr>"``, or its worked steps
    first with ``data.countdown.style=worked``) + EOS, several solutions a problem.

    Every batch is built identically on every rank (seeded), so data-parallel ranks can take
    their share with :func:`reco_megatron.parallel.batch.data_parallel_share`.
    """
    rng = random.Random(seed)
    problems = generate(countdown.n_train, seed=seed, **countdown.generate_kwargs())
    examples = []
    for problem in problems:
        chosen = rng.sample(
            list(problem.solutions), min(solutions_per_problem, len(problem.solutions))
        )
        for solution in chosen:
            prompt = tokenizer.encode(template.format(prompt=problem.prompt))
            answer = [*tokenizer.encode(problem.response(solution)), tokenizer.eos_id]
            if len(prompt) + len(answer) <= max_len:
                examples.append((prompt, answer))
    rng.shuffle(examples)
    batches = []
    for i in range(steps):
        chunk = [examples[(i * batch_size + j) % len(examples)] for j in range(batch_size)]
        length = max(len(p) + len(a) for p, a in chunk)
        length = -(-(length - 1) // 8) * 8 + 1
        tokens = torch.full((batch_size, length), tokenizer.pad_id, dtype=torch.long)
        mask = torch.zeros(batch_size, length)
        for row, (p, a) in enumerate(chunk):
            tokens[row, : len(p) + len(a)] = torch.tensor(p + a)
            mask[row, len(p) : len(p) + len(a)] = 1.0
        batches.append(
            RolloutBatch(
                tokens=tokens, response_mask=mask, advantages=torch.zeros(batch_size), group_size=1
            )
        )
    return batches


def hf_converter(cfg: TrainConfig, *, on_gpu: bool) -> str:
    """Resolve ``checkpoint.hf_converter`` for this run, once, and log the choice and why."""
    from reco_megatron.megatron import choose_converter

    par = cfg.parallel
    choice = choose_converter(
        cfg.checkpoint.hf_converter,
        cfg.model,
        tp=par.tensor_model_parallel_size,
        pp=par.pipeline_model_parallel_size,
        vpp=par.virtual_pipeline_model_parallel_size or 1,
        on_gpu=on_gpu,
        importing=bool(cfg.checkpoint.init_hf),
    )
    logger.info("HF weight mapping: %s (%s)", choice.name, choice.reason)
    return choice.name


def coverage_evaluator(
    cfg: TrainConfig, out: Path, tokenizer: Tokenizer, formatter: PromptFormatter, *, here: bool
) -> CoverageEvaluator | None:
    """The periodic pass@k evaluator (``eval.interval``) when ``here`` (global rank 0, which
    scores rewards), else None; None too when the evaluation is off. Every rank calls it, so a
    missing held-out set stops all of them (no rank waits for a failed one)."""
    from reco_megatron.eval.during_training import CoverageEvaluator, held_out_path
    from reco_megatron.rewards.registry import answer_key_spec, resolve_answer_key

    if not cfg.eval.interval:
        return None
    path = held_out_path(cfg.data.eval_path, out)
    if path is None:
        raise SystemExit("eval.interval is set but there is no held-out set: set data.eval_path")
    if not here:
        return None
    return CoverageEvaluator(
        cfg.eval,
        path,
        out,
        tokenizer,
        formatter,
        max_new_tokens=cfg.rollout.max_new_tokens,
        max_prompt_len=cfg.rollout.max_prompt_len,
        answer_key=resolve_answer_key(answer_key_spec(cfg.reward.reward)),
    )


# ------------------------------------------------------------------ the weights it starts from
class LoadedCheck(Protocol):
    """What :func:`initialise_weights` needs of the resume check
    (:class:`~reco_megatron.trainer.lifecycle.config_history.ResumeCheck`)."""

    def check_loaded(self, name: str, state: dict[str, Any]) -> None:
        """Check the config against the trainer state of the checkpoint actually loaded."""


@dataclass(frozen=True, kw_only=True)
class Start:
    """Where the loop starts."""

    step: int
    """RL steps already done (0 for a fresh run)."""
    sft_from: int | None
    """The SFT warm-up step to continue after (0: from the start); None: no warm-up to run."""
    resumed: str | None
    """The name of the checkpoint resumed from; None when the run did not resume."""


def initialise_weights(
    cfg: TrainConfig,
    engine: ReCoEngine,
    ckpt_root: Path,
    resume: LoadedCheck,
    sampler: PromptSampler,
    rollout: RolloutClient,
    converter: str,
) -> Start:
    """Load the weights the run starts from into ``engine`` and restore the loop state it
    resumes (``sampler``'s position, ``rollout``'s state); returns where the loop starts.

    ``rollout`` is the rollout client (its ``load_state_dict``), ``converter`` the HF weight
    converter for ``init_hf`` (:func:`hf_converter`).
    """
    ck = cfg.checkpoint
    resumed = resume_latest(ckpt_root, engine, on_damaged=ck.on_damaged) if ck.resume else None
    step, sft_from = 0, None
    if resumed is not None:
        latest, state = resumed
        resume.check_loaded(latest.name, state)  # a fallback loaded an older one
        step = int(state["step"])
        sampler.load_state_dict(state["sampler"])
        if state.get("rollout") is not None:
            rollout.load_state_dict(state["rollout"])
        if state.get("phase") == "sft":
            sft_from = int(state["sft_step"])
        logger.info("resumed from %s at step %d", latest, step)
    elif ck.init_megatron:
        load_checkpoint(_resolve(ck.init_megatron), engine, load_optimizer=False, load_rng=False)
    elif ck.init_hf:
        from reco_megatron.megatron import load_hf_into_engine

        load_hf_into_engine(ck.init_hf, engine, converter)
    if resumed is None and cfg.sft.steps > 0:
        sft_from = 0
    return Start(
        step=step, sft_from=sft_from, resumed=resumed[0].name if resumed is not None else None
    )


def _resolve(path: str) -> Path:
    """A checkpoint directory, or a root holding a ``latest`` pointer."""
    p = Path(path)
    latest = latest_checkpoint(p) if (p / "latest").exists() else None
    return latest or p


# ------------------------------------------------------------------ reading checkpoints
def saved_model_layout(path: Path) -> tuple[dict[str, Any] | None, str | None]:
    """The model layout (``meta.json``'s ``layout.model``) of the checkpoint at ``path`` (or
    of the one its ``latest`` names): ``(layout, None)``, or ``(None, why it cannot be read)``."""
    try:
        if (path / "latest").exists():
            path = latest_checkpoint(path) or path
        return read_meta(path)["layout"]["model"], None
    except (CheckpointError, KeyError, TypeError) as exc:
        return None, str(exc)


def save_step(
    cfg: TrainConfig,
    engine: ReCoEngine,
    state: dict[str, Any],
    *,
    sft_step: int | None,
    run_id: str,
) -> None:
    """Checkpoint ``state["step"]`` of the run under ``trainer.output_dir/checkpoints`` (the
    SFT warm-up's ``sft_<n>`` when ``sft_step`` is set); a full disk ends the run with one line."""
    ck = cfg.checkpoint
    try:
        save_checkpoint(
            Path(cfg.trainer.output_dir) / "checkpoints",
            state["step"],
            engine,
            state,
            keep_last=ck.keep_last,
            name=sft_checkpoint_name(sft_step) if sft_step is not None else None,
            group_writable=ck.group_writable,
            run_id=run_id,
        )
    except CheckpointSpaceError as exc:  # the message says it all: no traceback
        raise SystemExit(f"reco-train: {exc}") from None
