"""Rollout orchestration: where a step's scored groups come from.

Colocated (the engine in the trainer's processes) or separate (rollout workers on their own
devices, behind :class:`WorkerPool` and the :class:`GroupDispatcher`'s book of requests); the
policy's weights streamed into the engine (:class:`RolloutClient`) or pushed to the workers
(:class:`WeightPusher`); every rank of a model-parallel group agreeing on one set of responses;
and the responses turned into the batch the engine trains on. The rest of the trainer imports
the names below, never a module of this folder.
"""

from reco_megatron.rollout.weight_transport import PushMismatch
from reco_megatron.trainer.orchestration.agreement import (
    agree_on_completions,
    completions_fingerprint,
)
from reco_megatron.trainer.orchestration.batch import build_rollout_batch, completions_batch
from reco_megatron.trainer.orchestration.engines import (
    build_rollout_source,
    warn_if_colocation_overflows,
    write_rollout_model_dir,
)
from reco_megatron.trainer.orchestration.scoring import StepScorer
from reco_megatron.trainer.orchestration.source import (
    PromptSource,
    RolloutSource,
    StepPrompts,
    StepRollout,
    prompt_seed,
)
from reco_megatron.trainer.orchestration.sync import RolloutClient
from reco_megatron.trainer.orchestration.workers import WorkerLost

__all__ = [
    "PromptSource",
    "PushMismatch",
    "RolloutClient",
    "RolloutSource",
    "StepPrompts",
    "StepRollout",
    "StepScorer",
    "WorkerLost",
    "agree_on_completions",
    "build_rollout_batch",
    "build_rollout_source",
    "completions_batch",
    "completions_fingerprint",
    "prompt_seed",
    "warn_if_colocation_overflows",
    "write_rollout_model_dir",
]
