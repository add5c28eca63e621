"""The full run configuration: one YAML file, one dataclass per section.

``python -m reco_megatron.train CONFIG.yaml section.key=value ...`` loads a
:class:`TrainConfig` with :func:`reco_megatron.config.load_config` (unknown keys are errors
with a suggestion; every value is type-checked). Scaling a run from 8B to 70B changes the
``model`` and ``parallel`` sections only.

Where each check lives: a value alone is checked by its own section's ``__post_init__`` (the
trainer's sections are in :mod:`.sections`, ``rollout`` in :mod:`.rollout_config`); every check
that relates two sections is here, in :meth:`TrainConfig.__post_init__`, together with the
sanity ranges of :mod:`.value_ranges` (whose allow-list is ``trainer.allow_out_of_range``).
What needs the job or the files (the world size, the tokenizer, the prompt files, an initial
checkpoint) is :func:`reco_megatron.trainer.preflight.preflight`'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from reco_megatron.algo import LossConfig
from reco_megatron.data.dataset import DatasetConfig
from reco_megatron.eval.during_training import EvalConfig
from reco_megatron.megatron import (
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    UpdateConfig,
    length_multiple,
    round_up,
)
from reco_megatron.rewards.pool_config import RewardPoolConfig
from reco_megatron.trainer.rollout_config import RolloutConfig
from reco_megatron.trainer.sections import (
    CheckpointConfig,
    CountdownConfig,
    DataConfig,
    PromptFilesConfig,
    SFTConfig,
    StabilityConfig,
    TrainerConfig,
)
from reco_megatron.trainer.value_ranges import check_ranges

if TYPE_CHECKING:
    from reco_megatron.config.errors import Problems

__all__ = [
    "CheckpointConfig",
    "CountdownConfig",
    "DataConfig",
    "PromptFilesConfig",
    "SFTConfig",
    "TrainConfig",
    "TrainerConfig",
]


@dataclass(kw_only=True)
class TrainConfig:
    """Everything a run needs."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """Architecture (Llama or Qwen2 family)."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """TP / PP / CP / DP layout and micro-batch size."""
    loss: LossConfig = field(default_factory=LossConfig)
    """The objective (ReCo by default; GRPO, DAPO, Dr.GRPO, CISPO via presets)."""
    optimizer: OptimConfig = field(default_factory=OptimConfig)
    """Adam and the learning-rate schedule."""
    update: UpdateConfig = field(default_factory=lambda: UpdateConfig(minibatches_per_rollout=2))
    """Mini-batch updates per rollout batch (>= 2 so the token ratio acts)."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Sampling."""
    data: DataConfig = field(default_factory=DataConfig)
    """Prompts and tokenizer."""
    reward: RewardPoolConfig = field(default_factory=RewardPoolConfig)
    """The reward function and its isolated worker pool."""
    sft: SFTConfig = field(default_factory=SFTConfig)
    """Optional supervised warm-up."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """The loop."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpoints."""
    stability: StabilityConfig = field(default_factory=StabilityConfig)
    """Guards on NaN/Inf and on the ReCo quantities (docs/stability.md)."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Periodic pass@k / diversity on held-out prompts (``eval.interval=0`` disables)."""

    def __post_init__(self) -> None:
        """Every check that relates two sections, in one place (the module docstring says
        where the others live). Raises ``ValueError`` at the first group that fails; the
        token-budget checks report all their problems together."""
        check_ranges(self, self.trainer.allow_out_of_range)
        total = self.rollout.prompts_per_step
        n = self.update.minibatches_per_rollout
        if total % n:
            raise ValueError(
                f"rollout.prompts_per_step={total} must be divisible by "
                f"update.minibatches_per_rollout={n} (each mini-batch holds whole groups)"
            )
        need = self.rollout.max_prompt_len + self.rollout.max_new_tokens
        if need > self.model.max_position_embeddings:
            raise ValueError(
                f"rollout.max_prompt_len + rollout.max_new_tokens = {need} exceeds "
                f"model.max_position_embeddings={self.model.max_position_embeddings}: shorten "
                "them or raise the model's limit"
            )
        if self.rollout.engine == "megatron":
            self._check_megatron_rollout()
        self._check_routing_replay()
        if self.rollout.placement == "separate":
            self._check_separate_rollout()
        self._check_token_budget()
        self._check_held_out_set()

    @classmethod
    def complete_raw(cls, raw: dict[str, Any], problems: Problems) -> None:
        """With ``checkpoint.init_hf`` naming a directory with a ``config.json``, the model
        section is its architecture under the ``model.*`` keys the user set (called by
        :func:`~reco_megatron.config.load_config` before the dataclasses are built; the keys
        that disagree with ``config.json`` are the pre-flight's one line). A directory that is
        missing or holds no ``config.json`` is left to the pre-flight, which says so."""
        from reco_megatron.megatron import HFConfigError, model_section_from_hf

        ck, model = raw.get("checkpoint"), raw.get("model", {})
        hf_dir = ck.get("init_hf") if isinstance(ck, dict) else None
        if not isinstance(hf_dir, str) or not hf_dir or not isinstance(model, dict):
            return
        if not (Path(hf_dir) / "config.json").is_file():
            return
        try:
            raw["model"] = model_section_from_hf(hf_dir, model)
        except HFConfigError as exc:
            problems.add(("checkpoint", "init_hf"), f"{hf_dir!r}: {exc}")

    @property
    def response_weight_policy(self) -> Literal["proximal", "behaviour"]:
        """Whose log-probs the response weights read (``loss.response_weight_policy``,
        resolved): ``auto`` is ``behaviour`` (the rollout engine's mu) when groups may come
        from older weights (``rollout.placement=separate`` with a staleness bound K > 0), else
        ``proximal`` (the old-policy pass, pi_old): colocated, and separate with K = 0, which
        samples from the current weights and stays bit for bit the colocated run. An explicit
        value is kept."""
        policy = self.loss.response_weight_policy
        if policy == "auto":
            stale = self.rollout.placement == "separate" and self.rollout.staleness_bound > 0
            return "behaviour" if stale else "proximal"
        return policy

    def prompt_dataset(self) -> DatasetConfig:
        """How the trainer reads its prompt files: ``data.dataset`` with the prompt budget of
        the rollout (``rollout.max_prompt_len``, the one key for it)."""
        own = {f.name: getattr(self.data.dataset, f.name) for f in fields(DatasetConfig)}
        return DatasetConfig(**{**own, "max_prompt_len": self.rollout.max_prompt_len})

    def _check_routing_replay(self) -> None:
        """Routing replay needs an MoE model and an engine that reports its routing."""
        mode = self.update.routing_replay
        if mode == "off":
            return
        if self.model.moe is None:
            raise ValueError(
                f"update.routing_replay={mode!r} needs a mixture-of-experts model (model.moe); "
                "set it to 'off' for a dense model"
            )
        if self.rollout.engine == "embedded":
            raise ValueError(
                f"update.routing_replay={mode!r} with rollout.engine=embedded: transformers "
                "does not report the experts it routes to; use rollout.engine=megatron (or "
                "vllm with routed-experts return), or update.routing_replay=off"
            )

    def _check_separate_rollout(self) -> None:
        """What separate placement needs of the other sections."""
        k = self.rollout.staleness_bound
        if k > 0 and self.loss.tis_cap is None:
            raise ValueError(
                f"rollout.placement=separate with max_staleness={k} trains on groups of older "
                "weights and needs the importance weight min(pi_old / mu, C): set "
                "loss.tis_cap (2.0 is the usual cap), or rollout.max_staleness=0"
            )
        if self.eval.interval:
            raise ValueError(
                f"eval.interval={self.eval.interval} with rollout.placement=separate: the "
                "trainer holds no rollout engine to evaluate with; set eval.interval=0 and "
                "evaluate the checkpoints with reco-eval"
            )
        if self.parallel.expert_model_parallel_size > 1:
            raise ValueError(
                "rollout.placement=separate pushes each pipeline stage's weights from one "
                "rank; with parallel.expert_model_parallel_size="
                f"{self.parallel.expert_model_parallel_size} the experts are spread over "
                "several: use placement=colocated, or expert_model_parallel_size=1"
            )
        if self.checkpoint.hf_converter == "megatron_bridge":
            raise ValueError(
                "rollout.placement=separate streams each stage's weights with the builtin "
                "converter; checkpoint.hf_converter=megatron_bridge cannot stream per stage: "
                "set it to auto or builtin"
            )

    def _check_megatron_rollout(self) -> None:
        """What the megatron engine cannot do, caught before any process group starts."""
        p = self.parallel
        if p.virtual_pipeline_model_parallel_size is not None:
            raise ValueError(
                "rollout.engine=megatron decodes on one model chunk per pipeline stage; "
                f"parallel.virtual_pipeline_model_parallel_size="
                f"{p.virtual_pipeline_model_parallel_size} is not supported: set it to null or "
                "use rollout.engine=embedded"
            )
        if p.context_parallel_size > 1:
            raise ValueError(
                "rollout.engine=megatron does not decode with context_parallel_size="
                f"{p.context_parallel_size} (its decoder splits no "
                "sequence over context-parallel ranks): set it to 1 or use rollout.engine=vllm"
            )
        mp = p.tensor_model_parallel_size * p.pipeline_model_parallel_size
        mp *= p.expert_model_parallel_size
        if self.eval.interval and mp > 1:
            raise ValueError(
                f"eval.interval={self.eval.interval} with rollout.engine=megatron and TP x PP x "
                f"EP = {mp}: coverage evaluation generates on global rank 0 alone, but the "
                "megatron engine is collective over the model-parallel (and expert-parallel) "
                "group; set eval.interval=0 (and run reco-eval on a checkpoint) or use "
                "rollout.engine=embedded"
            )
        if self.rollout.env and p.expert_model_parallel_size > 1:
            raise ValueError(
                f"rollout.env={self.rollout.env!r} with rollout.engine=megatron and "
                f"parallel.expert_model_parallel_size={p.expert_model_parallel_size}: episodes "
                "make as many engine calls as their turns need, which differ between the "
                "data-parallel ranks an expert-parallel group joins; set "
                "expert_model_parallel_size=1 or use rollout.engine=vllm"
            )

    def _check_token_budget(self) -> None:
        """A token budget must hold the longest prompt + response (rounded up to the length
        multiple the layout needs), and sequence packing works with neither context
        parallelism nor a mixture-of-experts model."""
        u, par, r = self.update, self.parallel, self.rollout
        problems = []
        budget = u.max_tokens_per_microbatch
        if budget is not None:
            multiple = length_multiple(
                u.microbatch_length_multiple,
                par.tensor_model_parallel_size,
                par.sequence_parallel,
                par.context_parallel_size,
            )
            longest = round_up(r.max_prompt_len + r.max_new_tokens - 1, multiple)
            if budget < longest:
                problems.append(
                    f"update.max_tokens_per_microbatch={budget} is below the longest sequence: "
                    f"rollout.max_prompt_len + max_new_tokens - 1 = "
                    f"{r.max_prompt_len + r.max_new_tokens - 1}, rounded up to a multiple of "
                    f"{multiple} = {longest}: set it to at least {longest}"
                )
        if u.sequence_packing and par.context_parallel_size > 1:
            problems.append(
                "update.sequence_packing=true with context_parallel_size > 1 is not supported: "
                "set update.sequence_packing=false"
            )
        if u.sequence_packing and self.model.moe is not None:
            problems.append(
                "update.sequence_packing=true with a mixture-of-experts model (model.moe) is not "
                "supported: its routing replay and auxiliary-loss bookkeeping run per padded "
                "row; set update.sequence_packing=false (token-budget micro-batches still apply)"
            )
        if problems:
            raise ValueError("; ".join(problems))

    def _check_held_out_set(self) -> None:
        """Periodic evaluation needs a held-out set: ``data.eval_path``, or the countdown
        task's own split (generated when ``data.train_path`` is empty)."""
        if self.eval.interval and self.data.train_path and not self.data.eval_path:
            raise ValueError(
                f"eval.interval={self.eval.interval} needs a held-out set: set data.eval_path "
                "(or eval.interval=0)"
            )
