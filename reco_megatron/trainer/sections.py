"""The sections of the run configuration that belong to the trainer alone.

``data`` (with ``data.countdown`` and ``data.dataset``), ``sft``, ``trainer`` and
``checkpoint``; each checks its own values in ``__post_init__``. The sections of the other
layers are theirs (``model``, ``parallel``, ``update``, ``optimizer`` of the adapter, ``loss``
of ``algo``, ...), and every check that relates two sections is
:class:`~reco_megatron.trainer.config.TrainConfig`'s.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Literal

from reco_megatron.data.countdown import CountdownStyle
from reco_megatron.data.dataset import DatasetConfig

Action = Literal["warn", "skip", "stop"]

LoggerName = Literal["tensorboard", "wandb", "mlflow"]
LOGGERS: tuple[str, ...] = ("tensorboard", "wandb", "mlflow")
MODULES: dict[str, str] = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}
"""The module each logger needs."""
INSTALL: dict[str, str] = {
    "tensorboard": "pip install tensorboard",
    "wandb": 'pip install wandb (or pip install -e ".[loggers]")',
    "mlflow": 'pip install mlflow-skinny (or pip install -e ".[loggers]")',
}


def missing(names: Sequence[str]) -> list[str]:
    """The loggers of ``names`` whose package cannot be imported, with how to install it."""
    return [f"{n}: {INSTALL[n]}" for n in names if importlib.util.find_spec(MODULES[n]) is None]


@dataclass(kw_only=True)
class StabilityConfig:
    """Thresholds on per-step ReCo quantities and the action taken when one is crossed."""

    max_consecutive_skips: int = 5
    """Stop the run after this many consecutive skipped optimizer steps (NaN/Inf or guards)."""
    token_ratio_max: float | None = None
    """Largest raw ReCo token ratio c (before any cap) allowed; ``None`` (default): the loss's
    ``c_max``, so a warning whenever the value cap binds. A raw c far above 1 means a
    near-certain token (p_old near 1) lost probability: ``c = r (1-p)/(1-p_old)``."""
    token_ratio_action: Action = "warn"
    """Action when ``token_ratio_max`` is exceeded."""
    ratio_max: float = 1e3
    """Largest importance ratio r = p / p_old before the clip; a blow-up means a policy jump."""
    ratio_action: Action = "skip"
    """Action when ``ratio_max`` is exceeded."""
    weight_ess_min: float = 0.05
    """Smallest effective sample size of the response weights (1 = uniform)."""
    weight_ess_action: Action = "warn"
    """Action when the ESS falls below ``weight_ess_min``."""
    kl_old_new_max: float = 1.0
    """Largest KL(old || new) estimate within one rollout batch."""
    kl_action: Action = "warn"
    """Action when ``kl_old_new_max`` is exceeded."""
    entropy_min: float = 0.0
    """Smallest mean token entropy (nats); collapse towards 0 means no exploration (0: off)."""
    entropy_action: Action = "warn"
    """Action when the entropy falls below ``entropy_min``."""
    dead_run_steps: int = 5
    """A run that has earned a reward is *dead* after this many consecutive steps in which
    every reward is 0 or more than ``dead_run_unparsable_frac`` of the responses have an
    answer the reward cannot parse: every advantage is 0 and nothing brings it back
    (``docs/stability.md``). 0 turns the check off."""
    dead_run_unparsable_frac: float = 0.25
    """Share of a step's responses with an unparsable answer (the reward's ``parse_failure``
    verdict) that counts as a dead step (in (0, 1])."""
    dead_run_action: Literal["warn", "stop"] = "stop"
    """``stop``: exit with status 3 and one line naming the last checkpoint saved before the
    run died; ``warn``: log that line and go on (e.g. to study a collapse)."""
    no_signal_steps: int = 5
    """Say so when for this many consecutive steps every group's responses had one and the
    same reward (``zero_adv_frac`` 1: every advantage is 0, so the update has no signal),
    whether or not the run ever earned a reward: usually a reward that cannot score the
    task's answers, or groups too small or too cold to differ. 0 turns the check off."""
    no_signal_action: Literal["warn", "stop"] = "warn"
    """``warn``: log one line saying what to check and go on; ``stop``: exit with status 3
    with that line."""

    def __post_init__(self) -> None:
        if not isinstance(self.max_consecutive_skips, int) or self.max_consecutive_skips < 1:
            raise ValueError(
                f"stability.max_consecutive_skips must be >= 1, got {self.max_consecutive_skips!r}"
            )
        if not isinstance(self.dead_run_steps, int) or self.dead_run_steps < 0:
            raise ValueError(
                f"stability.dead_run_steps must be an integer >= 0 (0: off), got "
                f"{self.dead_run_steps!r}"
            )
        if not 0.0 < self.dead_run_unparsable_frac <= 1.0:
            raise ValueError(
                f"stability.dead_run_unparsable_frac must be in (0, 1], got "
                f"{self.dead_run_unparsable_frac!r} (1.0 counts only steps where every reward "
                "is 0)"
            )
        if not isinstance(self.no_signal_steps, int) or self.no_signal_steps < 0:
            raise ValueError(
                f"stability.no_signal_steps must be an integer >= 0 (0: off), got "
                f"{self.no_signal_steps!r}"
            )
        if self.dead_run_action not in ("warn", "stop"):
            raise ValueError(
                f"stability.dead_run_action must be warn or stop, got {self.dead_run_action!r}"
            )
        if self.token_ratio_max is not None and not self.token_ratio_max >= 1.0:
            raise ValueError(
                f"stability.token_ratio_max must be >= 1 or None (= loss.c_max), got "
                f"{self.token_ratio_max!r}: c == 1 at the old policy"
            )
        for name in ("token_ratio", "ratio", "weight_ess", "kl", "entropy"):
            action = getattr(self, f"{name}_action")
            if action not in ("warn", "skip", "stop"):
                raise ValueError(
                    f"stability.{name}_action must be warn, skip or stop, got {action!r}"
                )


def _check_ints(obj: object, hints: dict[str, str] | None = None, **minimum: int) -> None:
    """Raise naming the field when it is not an int >= its minimum (the loader puts the
    section in front: ``trainer: max_steps must be ...``); ``hints`` adds a word per field."""
    for name, low in minimum.items():
        value = getattr(obj, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            what = "a positive integer" if low == 1 else f"an integer >= {low}"
            hint = (hints or {}).get(name)
            raise ValueError(
                f"{name} must be {what}, got {value!r}" + (f" ({hint})" if hint else "")
            )


@dataclass(kw_only=True)
class CountdownConfig:
    """The synthetic countdown task generated when ``data.train_path`` is empty."""

    n_train: int = 2000
    """Training problems."""
    n_eval: int = 64
    """Held-out problems (disjoint from training)."""
    n_numbers: int = 4
    """Numbers given per problem."""
    max_number: int = 12
    """Numbers are drawn from 2..max_number."""
    target_min: int = 10
    """Smallest target."""
    target_max: int = 100
    """Largest target."""
    min_solutions: int = 3
    """Only targets reachable in at least this many distinct ways (coverage needs several)."""
    style: CountdownStyle = "answer"
    """``answer``: the response is ``Answer: <expression>`` (10-25 tokens); ``worked``: each
    step ``a op b = c`` with the numbers that remain, then the answer (50-100 tokens; grade it
    with ``reward.reward=countdown_worked`` and give it ``rollout.max_new_tokens=96``, prompts
    of up to 105 tokens and ``model.max_position_embeddings`` to match); ``calculator``: the
    steps as calculator calls ``<a op b=c>`` whose values the ``calculator`` environment
    returns (``rollout.env=calculator``, ``examples/calculator_cpu.yaml``), then the answer."""

    def generate_kwargs(self) -> dict[str, object]:
        """Keyword arguments of :func:`reco_megatron.data.countdown.generate`."""
        return {
            "n_numbers": self.n_numbers,
            "max_number": self.max_number,
            "target_range": (self.target_min, self.target_max),
            "min_solutions": self.min_solutions,
            "style": self.style,
        }


@dataclass(kw_only=True)
class PromptFilesConfig(DatasetConfig):
    """:class:`DatasetConfig` as the trainer's ``data.dataset``: everything but the longest
    prompt kept, which is ``rollout.max_prompt_len`` (one key for the rollouts, the prompt
    files and the held-out set)."""

    REPLACED_KEYS: ClassVar[dict[str, str]] = {
        "max_prompt_len": "rollout.max_prompt_len is the longest prompt kept (rollouts, prompt "
        "files, held-out set): set it there and delete data.dataset.max_prompt_len",
    }
    max_prompt_len: int | None = field(default=None, init=False)


@dataclass(kw_only=True)
class DataConfig:
    """Prompt files and the tokenizer."""

    train_path: str = ""
    """jsonl or parquet of training prompts; empty = generate the countdown task in output_dir."""
    eval_path: str = ""
    """Held-out prompts for coverage evaluation (optional)."""
    tokenizer: str = "examples/tiny/countdown_sp.model"
    """A SentencePiece ``.model`` file or a Hugging Face tokenizer directory."""
    template: str = "{prompt}\n"
    """Prompt template when the tokenizer has no chat template."""
    dataset: PromptFilesConfig = field(default_factory=lambda: PromptFilesConfig())
    """Field names and bad-row policy of the prompt files. The longest prompt kept is
    ``rollout.max_prompt_len`` (:meth:`TrainConfig.prompt_dataset`)."""
    countdown: CountdownConfig = field(default_factory=CountdownConfig)
    """The synthetic task used when ``train_path`` is empty (and by the SFT warm-up)."""


@dataclass(kw_only=True)
class SFTConfig:
    """Supervised warm-up on the countdown solutions (tiny default only)."""

    steps: int = 0
    """Optimizer steps of SFT before RL (0 disables)."""
    batch_size: int = 32
    """Sequences per SFT step."""
    lr: float = 3e-3
    """SFT learning rate (constant)."""
    solutions_per_problem: int = 3
    """Distinct solutions taught per problem (so RL starts from several ways to solve)."""

    def __post_init__(self) -> None:
        _check_ints(
            self,
            {"steps": "0 disables the warm-up"},
            steps=0,
            batch_size=1,
            solutions_per_problem=1,
        )
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")


@dataclass(kw_only=True)
class TrainerConfig:
    """The loop."""

    REPLACED_KEYS: ClassVar[dict[str, str]] = {
        "tensorboard": "trainer.loggers chooses the trackers: leave 'tensorboard' out of it "
        "(trainer.loggers=[] for none) and delete trainer.tensorboard",
    }

    max_steps: int = 10
    """Rollout steps (each: generate, score, old-policy pass, mini-batch updates, sync)."""
    seed: int = 1234
    """Seed of everything (weights, data order, sampling)."""
    output_dir: str = "runs/reco"
    """Metrics, resolved config, checkpoints and plots go here."""
    loggers: list[LoggerName] = field(default_factory=lambda: ["tensorboard"])
    """Experiment trackers next to metrics.jsonl, any of ``tensorboard``, ``wandb``, ``mlflow``
    (rank 0; offline unless a server is configured: trainer/reporting/loggers.py). W&B or
    MLflow listed but not installed is an error before the run starts (TensorBoard: a note);
    ``[]``: none."""
    project: str = "reco-megatron"
    """The W&B project / MLflow experiment the run is logged under (its name: the output
    directory's)."""
    log_interval: int = 1
    """Steps between log lines (metrics.jsonl gets every step)."""
    progress: bool = True
    """A progress bar on rank 0 (tqdm or rich when installed)."""
    allow_config_change: bool = False
    """Resume even when the config changes what is being trained (model, data by content,
    seed, objective, reward, ...); each change is logged and kept in config_history.jsonl.
    Changes of the schedule, intervals, guards, logging and workers never need it."""
    allow_out_of_range: list[str] = field(default_factory=list)
    """Keys whose sanity range (lr, workers, ...; docs/stability.md) is not checked, e.g.
    ``[optimizer.lr]`` when a learning rate above 1e-2 is really meant."""

    def __post_init__(self) -> None:
        _check_ints(self, {"max_steps": "0 runs the SFT warm-up only"}, max_steps=0, log_interval=1)
        absent = missing([n for n in self.loggers if n != "tensorboard"])
        if absent:
            raise ValueError(
                f"loggers={self.loggers} but not installed: {'; '.join(absent)}; or remove it "
                "from trainer.loggers"
            )


@dataclass(kw_only=True)
class CheckpointConfig:
    """Saving and initialisation."""

    save_interval: int = 0
    """Steps between checkpoints (0: only at the end)."""
    keep_last: int = 3
    """Complete checkpoints kept; older ones are removed after a new one is written (0 keeps
    every checkpoint). ``step_00000000``, written at the end of the SFT warm-up, is never
    removed: it is the base the run is compared with."""
    init_hf: str = ""
    """Start from this local Hugging Face checkpoint directory (config.json + safetensors)."""
    init_megatron: str = ""
    """Start from the weights of this reco-megatron checkpoint (any TP/PP)."""
    hf_converter: Literal["auto", "builtin", "megatron_bridge"] = "auto"
    """Who maps HF <-> Megatron weights for ``init_hf`` and the rollout weight stream:
    ``builtin`` (ours, everywhere), ``megatron_bridge`` (NVIDIA Megatron-Bridge; error if it
    cannot be used), ``auto`` (the bridge where it imports and gives exactly our tensors, else
    ours; docs/weights.md)."""
    resume: bool = True
    """Resume from ``<output_dir>/checkpoints/latest`` when it exists."""
    on_damaged: Literal["stop", "fallback"] = "stop"
    """When a file of the checkpoint to resume from fails its checksum: ``stop`` (refuse, name
    the file and the previous complete checkpoint) or ``fallback`` (move the damaged one aside
    to ``damaged-step_*``, point ``latest`` at the previous complete checkpoint, resume from
    it; docs/stability.md)."""
    group_writable: bool = False
    """Write checkpoints group-writable (as the umask allows) instead of writable by their
    owner only. A checkpoint is read by code that trusts it: leave it off on shared project
    folders unless every member of the group is trusted with the runs."""

    def __post_init__(self) -> None:
        _check_ints(
            self,
            {"save_interval": "0 saves at the end only", "keep_last": "0 keeps every one"},
            save_interval=0,
            keep_last=0,
        )
