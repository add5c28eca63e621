"""Where a run's weights and loop state come from at start-up.

Resume from the run directory's ``checkpoints/latest`` (``checkpoint.resume``; the config diff
was checked before, by :class:`~reco_megatron.trainer.config_history.ResumeCheck`), else
initialise the engine from ``checkpoint.init_megatron`` (a reco-megatron checkpoint, any TP/PP)
or ``checkpoint.init_hf`` (a Hugging Face checkpoint), else keep the seeded initial weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from reco_megatron.data.sampler import PromptSampler
from reco_megatron.megatron import ReCoEngine, latest_checkpoint, load_checkpoint, resume_latest
from reco_megatron.trainer.config import TrainConfig
from reco_megatron.trainer.config_history import ResumeCheck
from reco_megatron.trainer.weight_sync import RolloutClient
from reco_megatron.utils.logging import get_logger

logger = get_logger(__name__)


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
    resume: ResumeCheck,
    sampler: PromptSampler,
    rollout: RolloutClient,
    converter: str,
) -> Start:
    """Load the weights the run starts from into ``engine`` and restore the loop state it
    resumes (``sampler``'s position, ``rollout``'s state); returns where the loop starts.

    ``rollout`` is the rollout client (its ``load_state_dict``), ``converter`` the HF weight
    converter for ``init_hf`` (``trainer.setup.hf_converter``).
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
