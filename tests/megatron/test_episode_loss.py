"""Multi-turn episodes in the loss (fp64): observation tokens never get gradient, and a
single-turn response (a loss mask of ones, or none) trains exactly as before.

The batch comes from ``build_rollout_batch`` with per-row loss masks (what an episode's
:class:`Completion` carries) and goes through the training loss layer
(``policy_loss_func``: statistics from the logits, ReCo weights, KL, entropy, TIS), so the
mask is followed from the completion to the gradient of the logits.
"""

from __future__ import annotations

import pytest
import torch

from reco_megatron.algo import LossConfig, batch_response_weights
from reco_megatron.megatron.step.loss_layer import LossContext, policy_loss_func
from reco_megatron.parallel import vocab_parallel_stats
from reco_megatron.trainer.orchestration import build_rollout_batch

F64 = torch.float64
V, G = 11, 4
PRESETS = LossConfig.preset_names()


def _episodes() -> tuple[list[list[int]], list[list[int]], list[list[int]]]:
    """Two groups of G episodes: prompts, episode tokens, loss masks (0 = observation)."""
    g = torch.Generator().manual_seed(3)
    prompts = [[1, 2, 3], [4, 5]]
    tokens, masks = [], []
    for i in range(2 * G):
        mask: list[int] = []
        for turn in range(1 + i % 3):  # 1 to 3 turns: action, observation, action, ...
            if turn:
                mask += [0] * (1 + (i + turn) % 3)
            mask += [1] * (2 + (i * turn) % 3)
        tokens.append(torch.randint(0, V, (len(mask),), generator=g).tolist())
        masks.append(mask)
    return prompts, tokens, masks


def _batch(masks, cfg: LossConfig, logits: torch.Tensor | None = None):
    prompts, tokens, _ = _episodes()
    g = torch.Generator().manual_seed(4)
    adv = torch.randn(2 * G, generator=g, dtype=F64)
    lps = [(-torch.rand(len(t), generator=g, dtype=F64)).tolist() for t in tokens]
    if masks is not None:  # what an episode reports: log-prob 0 on observations
        lps = [
            [lp if m else 0.0 for lp, m in zip(row, mk, strict=True)]
            for row, mk in zip(lps, masks, strict=True)
        ]
    batch = build_rollout_batch(prompts, tokens, lps, adv, G, pad_id=0, loss_masks=masks)
    b, s = batch.labels.shape
    if logits is None:
        logits = torch.randn(b, s, V, generator=g, dtype=F64)
    old = vocab_parallel_stats((logits + 0.1).detach(), batch.labels, V)
    batch.old_logprobs = old.logprob
    batch.old_sum_p2 = old.sum_p2
    batch.ref_logprobs = old.logprob - 0.05
    batch.rollout_logprobs = batch.rollout_logprobs.to(F64)
    batch.advantages = batch.advantages.to(F64)
    batch.weights = batch_response_weights(
        cfg,
        batch.old_logprobs,
        batch.loss_mask,
        G,
        response_ids=batch.labels,
    ).to(F64)
    return batch, logits


def _preset(name: str, **overrides: object) -> LossConfig:
    if LossConfig.preset(name, loss_normalizer=64).aggregation == "seq_mean_token_sum_norm":
        overrides["loss_normalizer"] = 64  # dr_grpo: the maximum response length
    return LossConfig.preset(name, **overrides)


def _everything_on(name: str) -> LossConfig:
    """The preset with the terms that read per-token inputs switched on: KL, entropy, TIS."""
    return _preset(name, kl_coef=0.1, entropy_coef=0.01, tis_cap=2.0)


def _loss_grad(batch, logits: torch.Tensor, cfg: LossConfig):
    leaf = logits.clone().requires_grad_()
    ctx = LossContext(loss=cfg, vocab_size=V, tp_group=None, stats_implementation="eager")
    numerator, count, metrics = policy_loss_func(batch, ctx, leaf.clone())
    (numerator / count).backward()
    return numerator.detach(), leaf.grad, metrics


@pytest.mark.parametrize("name", PRESETS)
@pytest.mark.parametrize("extras", [False, True], ids=["preset", "kl_entropy_tis"])
def test_observation_logits_get_exactly_zero_gradient(name: str, extras: bool) -> None:
    cfg = _everything_on(name) if extras else _preset(name)
    _, _, masks = _episodes()
    batch, logits = _batch(masks, cfg)
    _, grad, _ = _loss_grad(batch, logits, cfg)
    observation = torch.zeros_like(batch.loss_mask, dtype=torch.bool)
    for i, mask in enumerate(masks):  # label index of response token k: p - 1 + k
        p = len(_episodes()[0][i // G])
        for k, m in enumerate(mask):
            observation[i, p - 1 + k] = m == 0
    assert observation.sum() > 10
    assert torch.equal(grad[observation], torch.zeros_like(grad[observation]))
    policy = batch.loss_mask.bool()
    assert grad[policy].abs().sum() > 0  # the test can fail: policy tokens do get gradient


@pytest.mark.parametrize("name", PRESETS)
def test_single_turn_loss_mask_of_ones_is_todays_loss_exactly(name: str) -> None:
    cfg = _everything_on(name)
    _, tokens, _ = _episodes()
    today, logits = _batch(None, cfg)
    ones, _ = _batch([[1] * len(t) for t in tokens], cfg, logits)
    assert torch.equal(today.response_mask, ones.response_mask)
    num_a, grad_a, metrics_a = _loss_grad(today, logits, cfg)
    num_b, grad_b, metrics_b = _loss_grad(ones, logits, cfg)
    assert torch.equal(num_a, num_b)
    assert torch.equal(grad_a, grad_b)
    assert metrics_a.keys() == metrics_b.keys()
    for key in metrics_a:
        assert torch.equal(metrics_a[key], metrics_b[key]), key


def test_observation_tokens_are_not_counted_by_any_metric() -> None:
    """num_tokens, entropy, clip fractions: the same whether observations are in the batch as
    masked tokens or their statistics are garbage (they never enter a mean)."""
    cfg = _everything_on("reco")
    _, _, masks = _episodes()
    batch, logits = _batch(masks, cfg)
    _, _, metrics = _loss_grad(batch, logits, cfg)
    assert metrics["num_tokens/sum"] == sum(sum(m) for m in masks)
    noisy = logits.clone()
    obs = (batch.loss_mask == 0).unsqueeze(-1).expand_as(noisy)
    noisy[obs] = noisy[obs] * 7.0 + 3.0  # other distributions at every observation position
    _, _, metrics_noisy = _loss_grad(batch, noisy, cfg)
    for key in ("entropy/mean", "clip_frac/mean", "kl_ref/mean", "kl_old_new/mean"):
        assert torch.equal(metrics[key], metrics_noisy[key]), key
