"""Train/inference log-prob mismatch metrics and the truncated importance-sampling weight.

The rollout engine reports ``rollout_logprobs`` while sampling; the trainer recomputes
``trainer_logprobs`` for the same tokens with its own kernels (bf16, TP reductions, other
attention). They should agree; how much they do not is the first thing to look at when RL
diverges. Pure torch, local to one batch (no ``torch.distributed``): keys follow
:mod:`reco_megatron.algo.metrics` (suffix = how to reduce across micro-batches and ranks).

The TIS weight (Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy RL
training") ``min(exp(logp_train_old - logp_rollout), cap)`` corrects for sampling from the
rollout engine's distribution rather than the trainer's ``pi_old``. It is a separate factor from
ReCo's token ratio ``c = p(1-p) / (p_old(1-p_old))`` (which compares the current policy with
``pi_old`` *as the trainer computes it*); the trainer multiplies the per-token loss by it when
enabled.
"""

from __future__ import annotations

import torch


def _check(trainer: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    if trainer.shape != rollout.shape or trainer.shape != mask.shape:
        raise ValueError(
            f"trainer_logprobs {tuple(trainer.shape)}, rollout_logprobs "
            f"{tuple(rollout.shape)} and mask {tuple(mask.shape)} must have the same [B, T] shape"
        )
    if trainer.dim() != 2:
        raise ValueError(f"expected [B, T] tensors, got {trainer.dim()} dimensions")
    return mask.bool()


def logprob_mismatch(
    trainer_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """Mean ``|trainer - rollout|`` over response tokens (0 if none). Inputs ``[B, T]``."""
    m = _check(trainer_logprobs, rollout_logprobs, mask)
    diff = (trainer_logprobs.detach().double() - rollout_logprobs.detach().double()).abs()
    total = torch.where(m, diff, torch.zeros_like(diff)).sum()
    return (total / m.sum().clamp(min=1)).float()


def mismatch_metrics(
    trainer_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Per-token and per-sequence mismatch statistics of one batch.

    Args:
        trainer_logprobs: ``[B, T]`` log p of the response tokens under the trainer's policy.
        rollout_logprobs: ``[B, T]`` the same tokens' log-probs reported by the engine.
        mask: ``[B, T]`` true on response tokens.

    Returns:
        Detached 0-d fp32 tensors:
        ``mismatch/logprob_abs_diff/mean`` (mean |diff| per token),
        ``mismatch/logprob_abs_diff/max``,
        ``mismatch/logprob_diff/mean`` (signed trainer - rollout, shows a bias),
        ``mismatch/seq_log_ratio/mean`` (mean over sequences with a token of
        ``sum_t (trainer - rollout)``, the log of the sequence importance ratio),
        ``mismatch/seq_log_ratio_abs/max`` and ``mismatch/num_tokens/sum``.
    """
    m = _check(trainer_logprobs, rollout_logprobs, mask)
    diff = trainer_logprobs.detach().double() - rollout_logprobs.detach().double()
    diff = torch.where(m, diff, torch.zeros_like(diff))
    n_tok = m.sum()
    has_tok = m.any(dim=1)
    seq = diff.sum(dim=1)
    n_seq = has_tok.sum()
    zero = torch.zeros((), dtype=torch.float64)
    out = {
        "mismatch/logprob_abs_diff/mean": diff.abs().sum() / n_tok.clamp(min=1),
        "mismatch/logprob_abs_diff/max": diff.abs().max() if n_tok > 0 else zero,
        "mismatch/logprob_diff/mean": diff.sum() / n_tok.clamp(min=1),
        "mismatch/seq_log_ratio/mean": seq[has_tok].sum() / n_seq.clamp(min=1),
        "mismatch/seq_log_ratio_abs/max": seq[has_tok].abs().max() if n_seq > 0 else zero,
        "mismatch/num_tokens/sum": n_tok.double(),
    }
    return {k: v.float() for k, v in out.items()}
