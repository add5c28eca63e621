"""The full run configuration: one YAML file, one dataclass per section.

``python -m reco_megatron.train CONFIG.yaml section.key=value ...`` loads a
:class:`TrainConfig` with :func:`reco_megatron.config.load_config` (unknown keys are errors
with a suggestion; every value is type-checked). Scaling a run from 8B to 70B changes the
``model`` and ``parallel`` sections only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from reco_megatron.algo import LossConfig
from reco_megatron.data.dataset import DatasetConfig
from reco_megatron.eval.during_training import EvalConfig
from reco_megatron.megatron.distributed import ParallelConfig
from reco_megatron.megatron.engine import UpdateConfig
from reco_megatron.megatron.model import ModelConfig
from reco_megatron.megatron.optimizer import OptimConfig
from reco_megatron.rewards.pool import RewardPoolConfig
from reco_megatron.trainer.guards import StabilityConfig


@dataclass(kw_only=True)
class RolloutConfig:
    """Sampling of G responses per prompt."""

    engine: Literal["embedded", "vllm"] = "embedded"
    """``embedded`` (transformers on CPU/GPU, the debug default) or ``vllm`` (GPU)."""
    group_size: int = 8
    """G, responses per prompt (the paper: 8)."""
    prompts_per_step: int = 8
    """Prompts per rollout batch (global, over all data-parallel ranks)."""
    temperature: float = 1.0
    """Sampling temperature; the trainer's log-probs use the same temperature."""
    top_p: float = 1.0
    """Nucleus sampling threshold (1 disables)."""
    max_new_tokens: int = 64
    """Longest response; longer generations end with finish_reason 'length'."""
    max_prompt_len: int = 64
    """Longest prompt in tokens (rows above it are an error or a counted skip)."""
    gpu_memory_utilization: float = 0.5
    """vLLM only: fraction of GPU memory for weights + KV cache when colocated."""

    def __post_init__(self) -> None:
        for name in ("group_size", "prompts_per_step", "max_new_tokens", "max_prompt_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"rollout.{name} must be a positive integer, got {value!r}")
        if not self.temperature > 0:
            raise ValueError(
                f"rollout.temperature must be > 0, got {self.temperature} (RL needs sampling)"
            )
        if not 0 < self.top_p <= 1:
            raise ValueError(f"rollout.top_p must be in (0, 1], got {self.top_p}")


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

    def generate_kwargs(self) -> dict[str, object]:
        """Keyword arguments of :func:`reco_megatron.data.countdown.generate`."""
        return {
            "n_numbers": self.n_numbers,
            "max_number": self.max_number,
            "target_range": (self.target_min, self.target_max),
            "min_solutions": self.min_solutions,
        }


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
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    """Field names and bad-row policy of the prompt files."""
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


@dataclass(kw_only=True)
class TrainerConfig:
    """The loop."""

    max_steps: int = 10
    """Rollout steps (each: generate, score, old-policy pass, mini-batch updates, sync)."""
    seed: int = 1234
    """Seed of everything (weights, data order, sampling)."""
    output_dir: str = "runs/reco"
    """Metrics, resolved config, checkpoints and plots go here."""
    log_interval: int = 1
    """Steps between log lines (metrics.jsonl gets every step)."""
    tensorboard: bool = True
    """Also write TensorBoard events when tensorboard is installed."""
    progress: bool = True
    """A progress bar on rank 0 (tqdm or rich when installed)."""


@dataclass(kw_only=True)
class CheckpointConfig:
    """Saving and initialisation."""

    save_interval: int = 0
    """Steps between checkpoints (0: only at the end)."""
    keep_last: int = 3
    """Complete checkpoints kept; older ones are removed after a new one is written."""
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


@dataclass(kw_only=True)
class TrainConfig:
    """Everything a run needs."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """Architecture (Llama or Qwen2 family)."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """TP / PP / CP / DP layout and micro-batch size."""
    loss: LossConfig = field(default_factory=lambda: LossConfig.preset("reco", kl_coef=0.0))
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
