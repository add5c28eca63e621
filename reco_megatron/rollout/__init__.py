"""Rollout engines: generate ``n`` responses per prompt with per-token log-probs.

``base`` (the protocol: :class:`SamplingParams`, :class:`Completion`, :class:`RolloutEngine`),
``embedded`` (``transformers`` on CPU, the default), ``vllm_engine`` (colocated vLLM on GPUs,
imports vLLM lazily) and ``mismatch`` (train/rollout log-prob metrics, TIS weights). This layer
takes Hugging Face-named tensors and never imports megatron. See ``docs/rollout.md``.
"""

from reco_megatron.algo.ratios import tis_weights
from reco_megatron.rollout.base import RolloutEngine
from reco_megatron.rollout.embedded import EmbeddedEngine
from reco_megatron.rollout.embedded_config import EmbeddedEngineConfig
from reco_megatron.rollout.mismatch import logprob_mismatch, mismatch_metrics
from reco_megatron.rollout.requests import (
    Completion,
    FinishReason,
    SamplingArg,
    SamplingParams,
    validate_requests,
)
from reco_megatron.rollout.vllm_config import VLLMEngineConfig
from reco_megatron.rollout.vllm_engine import VLLMEngine

__all__ = [
    "Completion",
    "EmbeddedEngine",
    "EmbeddedEngineConfig",
    "FinishReason",
    "RolloutEngine",
    "SamplingArg",
    "SamplingParams",
    "VLLMEngine",
    "VLLMEngineConfig",
    "logprob_mismatch",
    "mismatch_metrics",
    "tis_weights",
    "validate_requests",
]
