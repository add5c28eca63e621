"""Pure ReCo / GRPO-family math on per-token log-probs.

No megatron, no vllm, no torch.distributed here (a test enforces it): every function is a
tensor function testable in one CPU process. Formulas and conventions: ``docs/loss.md``.
"""

from reco_megatron.algo.advantages import group_advantages
from reco_megatron.algo.aggregation import aggregate
from reco_megatron.algo.config import (
    PER_TOKEN_WEIGHT_MODES,
    PRESETS,
    TOKEN_ID_WEIGHT_MODES,
    WEIGHT_MODES,
    LossConfig,
)
from reco_megatron.algo.metrics import merge_metrics, reduction_of
from reco_megatron.algo.passk import diversity_metrics, pass_at_k
from reco_megatron.algo.policy_loss import c_growth, policy_loss
from reco_megatron.algo.ratios import TokenRatio, token_ratio
from reco_megatron.algo.token_stats import TokenStats, token_stats_reference
from reco_megatron.algo.weights import (
    batch_response_weights,
    check_weight_policy,
    response_weights,
    weight_logprobs,
)

__all__ = [
    "PER_TOKEN_WEIGHT_MODES",
    "PRESETS",
    "TOKEN_ID_WEIGHT_MODES",
    "WEIGHT_MODES",
    "LossConfig",
    "TokenRatio",
    "TokenStats",
    "aggregate",
    "batch_response_weights",
    "c_growth",
    "check_weight_policy",
    "diversity_metrics",
    "group_advantages",
    "merge_metrics",
    "pass_at_k",
    "policy_loss",
    "reduction_of",
    "response_weights",
    "token_ratio",
    "token_stats_reference",
    "weight_logprobs",
]
