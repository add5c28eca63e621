"""The checks of a run's configuration that need the job or its files, before any compute.

:func:`preflight` runs at the top of :class:`~reco_megatron.trainer.loop.Trainer`, before the
output directory, the process group or the model exist. The config alone was checked when it
was loaded (each section's ``__post_init__``, and every check relating two sections in
:class:`~reco_megatron.trainer.config.TrainConfig`); what stays here needs more than the
config: the layout against the world size (``WORLD_SIZE`` from torchrun) and against the model
on this machine (heads and layers over TP / PP; CUDA or not), every batch split that depends
on the data-parallel size (prompts over mini-batches and ranks, sequences over micro-batches,
a virtual pipeline's share, the SFT batch), the tokenizer (and the vocabulary against it), the
prompt files (read and validated row by row, so a bad row is reported with its file and line),
the held-out file, the reward spec (importable), the environment (``rollout.env``, importable)
and the initial checkpoint (read from disk).
All problems found are raised together as one :class:`~reco_megatron.config.ConfigError`,
which ``reco-train`` turns into exit status 2 and its message, with no output directory left
behind.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from reco_megatron.config import ConfigError, config_to_dict
from reco_megatron.data.dataset import DatasetError, PromptDataset
from reco_megatron.data.tokenizer import HFTokenizer, SentencePieceTokenizer, Tokenizer
from reco_megatron.trainer.config import TrainConfig


@dataclass
class Checked:
    """What the checks built on the way and the trainer reuses."""

    world_size: int
    """Ranks of the job."""
    data_parallel_size: int
    """World size / (TP x PP x CP)."""
    tokenizer: Tokenizer
    """The loaded tokenizer."""
    dataset: PromptDataset | None
    """The validated prompt file (None when the countdown task is generated at start)."""


def _world_size() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def load_tokenizer(spec: str) -> Tokenizer:
    """A SentencePiece ``.model`` file or a Hugging Face tokenizer directory.

    Raises:
        ConfigError: the path does not exist or is neither kind, naming ``data.tokenizer``.
    """
    path = Path(spec)
    try:
        if path.suffix == ".model":
            return SentencePieceTokenizer(path)
        if path.is_dir():
            return HFTokenizer(path)
    except Exception as exc:  # every library error for a bad file is one line
        reason = " ".join(str(exc).split())[:600]
        raise ConfigError([f"data.tokenizer={spec!r}: cannot load it ({reason})"]) from exc
    raise ConfigError(
        [
            f"data.tokenizer={spec!r} is neither a SentencePiece .model file nor a tokenizer "
            "directory: pass e.g. examples/tiny/countdown_sp.model or a local HF model directory"
        ]
    )


def _layout(cfg: TrainConfig, world: int, problems: list[str]) -> int:
    par = cfg.parallel
    try:
        dp = par.data_parallel_size(world)
    except ValueError as exc:
        problems.append(f"parallel: {exc}")
        dp = 1
    try:
        par.validate_for_model(cfg.model, cfg.model.num_layers, on_gpu=torch.cuda.is_available())
    except ValueError as exc:
        problems.append(f"parallel/model: {exc}")
    return dp


def _pipeline_share(cfg: TrainConfig, per_mini: int | None, problems: list[str]) -> None:
    """A virtual pipeline with a token budget needs a multiple of PP micro-batches, at most one
    per sequence: enough sequences per rank and mini-batch (that share depends on the data-
    parallel size). The budget against the longest sequence is :class:`TrainConfig`'s check."""
    pp = cfg.parallel.pipeline_model_parallel_size
    if cfg.parallel.virtual_pipeline_model_parallel_size and per_mini is not None and per_mini < pp:
        problems.append(
            f"with a virtual pipeline every mini-batch needs a multiple of PP = {pp} "
            f"micro-batches, but a rank holds only {per_mini} sequences per mini-batch: raise "
            "rollout.prompts_per_step or lower update.minibatches_per_rollout"
        )


def _batches(cfg: TrainConfig, dp: int, problems: list[str]) -> None:
    r, m, mbs = cfg.rollout, cfg.update.minibatches_per_rollout, cfg.parallel.micro_batch_size
    budget = cfg.update.max_tokens_per_microbatch is not None
    per_mini = None
    if r.prompts_per_step % (m * dp):
        problems.append(
            f"rollout.prompts_per_step={r.prompts_per_step} must be a multiple of "
            f"update.minibatches_per_rollout x data-parallel size = {m} x {dp} = {m * dp}"
        )
    else:
        per_mini = r.prompts_per_step // (m * dp) * r.group_size
        if per_mini % mbs and not budget:
            problems.append(
                f"parallel.micro_batch_size={mbs} must divide the sequences of one mini-batch on "
                f"one rank: prompts_per_step / (minibatches_per_rollout x DP) x group_size = "
                f"{r.prompts_per_step} / ({m} x {dp}) x {r.group_size} = {per_mini}"
            )
    if budget:
        _pipeline_share(cfg, per_mini, problems)
    if cfg.sft.steps > 0:
        b = cfg.sft.batch_size
        step = dp if budget else dp * mbs  # a token budget forms its own micro-batches
        if b % step:
            what = "" if budget else f" x parallel.micro_batch_size = {dp} x {mbs}"
            problems.append(
                f"sft.batch_size={b} must be a multiple of data-parallel size{what} = {step}"
            )


def batch_problems(cfg: TrainConfig, data_parallel_size: int) -> list[str]:
    """The problems of ``cfg``'s batch splits (prompts over mini-batches and data-parallel
    ranks, sequences over micro-batches, a virtual pipeline's share of a token budget, the
    SFT batch) at ``data_parallel_size``: what the launch check adds to the layout checks."""
    problems: list[str] = []
    _batches(cfg, data_parallel_size, problems)
    return problems


def _path_problem(key: str, value: str, *, directory: bool = False) -> str | None:
    path = Path(value)
    if not path.exists():
        return f"{key}={value!r} does not exist (relative paths start at {os.getcwd()})"
    if directory and not path.is_dir():
        return f"{key}={value!r} is not a directory"
    if not directory and not path.is_file():
        return f"{key}={value!r} is not a file"
    return None


def _data(
    cfg: TrainConfig, tokenizer: Tokenizer | None, problems: list[str]
) -> PromptDataset | None:
    d = cfg.data
    if tokenizer is not None and tokenizer.vocab_size > cfg.model.vocab_size:
        problems.append(
            f"model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's "
            f"{tokenizer.vocab_size} tokens: set model.vocab_size to at least that"
        )
    if d.eval_path and (bad := _path_problem("data.eval_path", d.eval_path)):
        problems.append(bad)
    if not d.train_path:
        return None
    if bad := _path_problem("data.train_path", d.train_path):
        problems.append(bad)
        return None
    if tokenizer is None:
        return None
    try:
        return PromptDataset(Path(d.train_path), cfg.prompt_dataset(), tokenizer=tokenizer)
    except DatasetError as exc:
        if exc.kind != "too_long":
            problems.append(f"data.train_path: {exc}")
            return None
    unbounded = replace(cfg.prompt_dataset(), max_prompt_len=None)
    prompts = [r.prompt for r in PromptDataset(Path(d.train_path), unbounded, tokenizer=tokenizer)]
    problems.append(_too_long(f"data.train_path={d.train_path!r}", prompts, cfg, tokenizer))
    return None


def _too_long(where: str, prompts: list[str], cfg: TrainConfig, tokenizer: Tokenizer) -> str:
    """The one line for prompts over ``rollout.max_prompt_len``: how many, the longest."""
    limit = cfg.rollout.max_prompt_len
    lengths = [len(tokenizer.encode(p)) for p in prompts]
    over = sum(n > limit for n in lengths)
    longest = max(lengths)
    skip = ", or data.dataset.on_bad_row=skip to drop them" if cfg.data.train_path else ""
    return (
        f"{where}: {over} of {len(lengths)} prompts are longer than rollout.max_prompt_len="
        f"{limit} (the longest has {longest} tokens): set rollout.max_prompt_len={longest} "
        f"(model.max_position_embeddings must hold it plus rollout.max_new_tokens){skip}"
    )


def _countdown(cfg: TrainConfig, tokenizer: Tokenizer, problems: list[str]) -> str | None:
    """The generated task (no ``data.train_path``) against ``rollout.max_prompt_len``, as the
    run will write it; returns the first problem's gold answer, for the reward's trial."""
    from reco_megatron.data.countdown import generate

    c = cfg.data.countdown
    tasks = generate(c.n_train, seed=cfg.trainer.seed, **c.generate_kwargs())
    prompts = [t.prompt for t in tasks]
    if max(len(tokenizer.encode(p)) for p in prompts) > cfg.rollout.max_prompt_len:
        problems.append(_too_long("the countdown task (data.countdown)", prompts, cfg, tokenizer))
    return tasks[0].gold if tasks else None


PLACEHOLDER = "/path/to/"
"""How the examples mark a path the user must set (``# EDIT`` beside it)."""


def _placeholders(cfg: TrainConfig) -> list[str]:
    """Dotted keys whose value still holds the examples' ``/path/to/...`` placeholder."""
    found: list[str] = []

    def walk(node: object, prefix: str) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                walk(value, f"{prefix}{key}.")
        elif isinstance(node, str) and PLACEHOLDER in node:
            found.append(f"{prefix[:-1]}={node!r}")

    walk(config_to_dict(cfg), "")
    return found


def _reward(cfg: TrainConfig, gold: str | None, problems: list[str]) -> None:
    """Import, signature, and (a custom reward) one trial call on a real prompt, whose gold
    answer is also the response: a non-number or an exception is refused."""
    from reco_megatron.rewards.trial import reward_problem

    if bad := reward_problem(cfg.reward, response=gold or "", gold=gold or ""):
        problems.append(bad)


def _env(cfg: TrainConfig, problems: list[str]) -> None:
    """``rollout.env`` imports and names an environment class (built in the workers later)."""
    if cfg.rollout.env:
        from reco_megatron.envs import EnvSpecError, resolve_env

        try:
            resolve_env(cfg.rollout.env)
        except EnvSpecError as exc:
            problems.append(str(exc))


def _checkpoint(cfg: TrainConfig, problems: list[str]) -> None:
    from reco_megatron.trainer.setup import saved_model_layout

    c = cfg.checkpoint
    if c.init_hf:
        bad = _path_problem("checkpoint.init_hf", c.init_hf, directory=True)
        if bad is None and not (Path(c.init_hf) / "config.json").is_file():
            bad = f"checkpoint.init_hf={c.init_hf!r} holds no config.json (not an HF model)"
        if bad:
            problems.append(bad)
        else:
            _hf_architecture(cfg, problems)
    if c.init_megatron:
        if bad := _path_problem("checkpoint.init_megatron", c.init_megatron, directory=True):
            problems.append(bad)
            return
        saved, why = saved_model_layout(Path(c.init_megatron))
        if saved is None:
            problems.append(f"checkpoint.init_megatron={c.init_megatron!r}: {why}")
            return
        diffs = [
            f"{k} {saved.get(k)!r} vs {getattr(cfg.model, k)!r}"
            for k in ("family", "num_layers", "hidden_size", "vocab_size")
            if k in saved and saved.get(k) != getattr(cfg.model, k, None)
        ]
        if diffs:
            problems.append(
                f"checkpoint.init_megatron={c.init_megatron!r} holds another model (checkpoint "
                f"vs model.*: {'; '.join(diffs)})"
            )


def _hf_architecture(cfg: TrainConfig, problems: list[str]) -> None:
    """``model.*`` set in the config against ``checkpoint.init_hf``'s config.json (the loader
    took every key the user left out from there: ``TrainConfig.complete_raw``)."""
    from reco_megatron.megatron import HFConfigError, architecture_mismatches, model_config_from_hf

    hf_dir = cfg.checkpoint.init_hf
    try:
        diffs = architecture_mismatches(cfg.model, model_config_from_hf(hf_dir))
    except HFConfigError as exc:
        problems.append(f"checkpoint.init_hf={hf_dir!r}: {exc}")
        return
    if diffs:
        listed = "; ".join(
            f"model.{d.replace(': ', '=', 1).replace(' vs ', ', config.json ')}" for d in diffs
        )
        problems.append(
            f"checkpoint.init_hf={hf_dir!r}: the config sets model.* that disagree with its "
            f"config.json ({listed}): delete those keys (the architecture comes from "
            "config.json) or start from another checkpoint"
        )


def preflight(cfg: TrainConfig) -> Checked:
    """Check ``cfg`` against the job and the files it names; build the tokenizer and data.

    Raises:
        ConfigError: every problem found, one line each, naming the key and the fix.
    """
    world = _world_size()
    problems: list[str] = []
    dp = _layout(cfg, world, problems)
    _batches(cfg, dp, problems)
    tokenizer, dataset = _files(cfg, problems)
    if problems:
        raise ConfigError(problems)
    assert tokenizer is not None
    return Checked(world_size=world, data_parallel_size=dp, tokenizer=tokenizer, dataset=dataset)


def file_problems(cfg: TrainConfig) -> list[str]:
    """The checks of :func:`preflight` that do not need the world (placeholders, paths, the
    tokenizer, the prompts, the reward, the initial checkpoint): what ``launch_check`` and
    the Slurm dry run add to the layout, so that a queued job cannot fail on them."""
    problems: list[str] = []
    _files(cfg, problems)
    return problems


def _files(cfg: TrainConfig, problems: list[str]) -> tuple[Tokenizer | None, PromptDataset | None]:
    if placeholders := _placeholders(cfg):  # the examples' /path/to/...: nothing else is known
        problems.append(
            f"{', '.join(placeholders)}: still the example's placeholder; set "
            f"{'it' if len(placeholders) == 1 else 'them'} to your files (the lines marked "
            "# EDIT in the config, or key=value after it)"
        )
        return None, None
    tokenizer = None
    try:
        tokenizer = load_tokenizer(cfg.data.tokenizer)
    except ConfigError as exc:
        problems.extend(exc.problems)
    dataset = _data(cfg, tokenizer, problems)
    gold = dataset[0].answer if dataset is not None else None
    if tokenizer is not None and not cfg.data.train_path:
        gold = _countdown(cfg, tokenizer, problems)
    _checkpoint(cfg, problems)
    _env(cfg, problems)
    if not problems:  # a trial call only on a run that could otherwise start
        _reward(cfg, gold, problems)
    return tokenizer, dataset
