"""The loss layer with ``update.fused_output_layer``: one op with 3 matmuls
(:func:`reco_megatron.parallel.linear_loss.vocab_parallel_linear_loss`) equals the output
layer's logits + the statistics op + the loss, for every objective the engine offers.

The fused op takes each block's gradients from the loss evaluated with only that block's
statistics live, which is exact for token-separable losses only; these cases cover each
objective, aggregation and extra term (KL, entropy bonus, truncated importance sampling,
the categorical token ratio), single-process on CPU with blocks of 5 tokens over micro-batches
of 4 x 6 (several blocks cutting across sequences). fp32 throughout: the paths differ only in
summation order, atol 1e-5 on the numerator, the metrics and the gradients.
"""

from __future__ import annotations

import pytest
import torch

from reco_megatron.algo import LossConfig
from reco_megatron.megatron.step.loss_layer import LossContext, policy_loss_func, sft_loss_func
from reco_megatron.parallel.batch import RolloutBatch

ATOL = 1e-5
B, L, H, VOCAB, V_PAD = 4, 7, 8, 40, 48

CONFIGS = {
    "reco": LossConfig.preset("reco", kl_coef=0.04),  # KL k3, sequence weights, Bernoulli ratio
    "reco_categorical_entropy": LossConfig.preset(
        "reco", token_ratio="categorical", entropy_coef=0.01, kl_coef=0.0
    ),
    "grpo_seq_mean": LossConfig.preset("grpo", aggregation="seq_mean_token_mean"),
    "dr_grpo": LossConfig.preset("dr_grpo", loss_normalizer=6.0),
    "cispo_tis": LossConfig.preset("cispo", tis_cap=2.0),
}


def _batch(cfg: LossConfig) -> tuple[RolloutBatch, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, VOCAB, (B, L), generator=gen)
    response = torch.zeros(B, L)
    response[:, 3:] = 1
    response[1, 6:] = 0  # a shorter response
    hidden = torch.randn(B, L - 1, H, generator=gen)
    weight = torch.randn(V_PAD, H, generator=gen) * 0.5
    with torch.no_grad():
        logp = torch.log_softmax(hidden @ weight[:VOCAB].t(), -1)
        current = logp.gather(-1, tokens[:, 1:, None]).squeeze(-1)
        sum_p2 = logp.exp().square().sum(-1)
    near = lambda x: x + 0.3 * torch.randn(x.shape, generator=gen)  # noqa: E731
    mb = RolloutBatch(
        tokens=tokens,
        response_mask=response,
        advantages=torch.randn(B, generator=gen),
        group_size=2,
        rollout_logprobs=near(current).clamp(max=-1e-3) if cfg.tis_cap else None,
        old_logprobs=near(current).clamp(max=-1e-3),
        old_sum_p2=(sum_p2 * 0.9) if cfg.token_ratio == "categorical" else None,
        ref_logprobs=near(current).clamp(max=-1e-3) if cfg.kl_coef > 0 else None,
        weights=torch.rand(B, generator=gen) + 0.5 if cfg.response_weight != "none" else None,
    )
    return mb, hidden, weight


def _run(loss_func, cfg: LossConfig, fused: bool):
    mb, hidden, weight = _batch(cfg)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    ctx = LossContext(
        loss=cfg,
        vocab_size=VOCAB,
        tp_group=None,
        stats_implementation="eager",
        fused_output_layer=fused,
        output_weight=w if fused else None,
        fused_block_tokens=5,
    )
    output = h if fused else h @ w.t()  # [B, S, H] hidden states or [B, S, V] logits
    numerator, count, metrics = loss_func(mb, ctx, output)
    (numerator * 0.5).backward()
    return numerator.detach(), count, metrics, h.grad, w.grad


@pytest.mark.parametrize("name", CONFIGS)
def test_fused_policy_loss_equals_logits_plus_op(name: str) -> None:
    fused, unfused = (_run(policy_loss_func, CONFIGS[name], f) for f in (True, False))
    torch.testing.assert_close(fused[0], unfused[0], atol=ATOL, rtol=0)
    assert int(fused[1]) == int(unfused[1])
    assert fused[2].keys() == unfused[2].keys()
    for key, value in unfused[2].items():
        torch.testing.assert_close(fused[2][key], value, atol=ATOL, rtol=0, msg=key)
    for got, want in zip(fused[3:], unfused[3:], strict=True):
        assert want.abs().max() > 0
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


def test_fused_sft_loss_equals_logits_plus_op() -> None:
    fused, unfused = (_run(sft_loss_func, CONFIGS["reco"], f) for f in (True, False))
    for got, want in zip(fused[3:], unfused[3:], strict=True):
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    torch.testing.assert_close(fused[0], unfused[0], atol=ATOL, rtol=0)
