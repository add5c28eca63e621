"""Shared bodies of the megatron rollout-engine tests (they run inside ``run_distributed`` ranks).

The trainer's own :class:`ReCoEngine` (tiny Llama of ``tests/megatron/_reco.py``: GQA, RoPE,
vocabulary 100 padded to 128) is built at the requested TP/PP, and the rollout engine decodes
on its chunks; the reference is the trainer's old-policy pass over the same tokens.
"""

from __future__ import annotations

from typing import Any

import torch

from reco_megatron.rollout.base import SamplingParams

PROMPTS = [[5, 17, 3], [9, 1, 44, 12, 7], [60, 2, 8, 31]]


def rollout_engine(engine: Any, max_batch_size: int = 16, seed: int = 0, eos: tuple = ()) -> Any:
    """A :class:`MegatronEngine` on ``engine``'s chunks (what the trainer builds)."""
    from reco_megatron.megatron.rollout_engine import MegatronDecoder
    from reco_megatron.rollout.megatron_engine import MegatronEngine, MegatronEngineConfig

    cfg = engine.model_cfg
    decoder = MegatronDecoder(
        engine.unwrapped(),
        vocab_size=cfg.vocab_size,
        max_model_len=cfg.max_position_embeddings,
        max_batch_size=max_batch_size,
    )
    return MegatronEngine(decoder, MegatronEngineConfig(seed=seed, eos_token_ids=eos))


def logprob_gap_body(rank: int, world: int, tp: int, pp: int, sampling: SamplingParams) -> Any:
    """Generate, then teacher-force the same tokens through the trainer's old-policy pass;
    returns (max |rollout - trainer| over response tokens, number of tokens) on the last stage."""
    from tests.megatron._reco import build_engine

    from reco_megatron.trainer.rollout_batch import build_rollout_batch

    engine = build_engine(tp=tp, pp=pp, micro_batch_size=2)
    rollout = rollout_engine(engine, max_batch_size=4)  # 3 prompts x 2 = 6 rows: 2 chunks
    groups = rollout.generate(PROMPTS, 2, sampling)
    responses = [c.token_ids for g in groups for c in g]
    logprobs = [c.logprobs for g in groups for c in g]
    batch = build_rollout_batch(PROMPTS, responses, logprobs, torch.zeros(6), 2, pad_id=0)
    stats = engine.statistics(batch)
    if not stats:
        return None
    mask = batch.loss_mask.bool()
    old = stats["logprob"]
    gap = (old - batch.rollout_logprobs).abs()[mask]
    return float(gap.max()), int(mask.sum()), responses
