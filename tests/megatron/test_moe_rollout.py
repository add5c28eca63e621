"""The megatron rollout engine on a Qwen3-MoE: recorded routing, replay, expert parallelism.

The engine decodes on the trainer's own chunks (KV cache) and records which experts every fed
position went to in every layer. Teacher-forcing the same tokens through the trainer's
old-policy pass (no cache, whole sequences) must choose the same experts for every response
token (``routing_mismatch == 0``: both run megatron's router on the same fp32 weights, only
the attention kernel differs) and give the same log-probs up to fp32 rounding.

Under expert parallelism (EP 2: the two ranks are data-parallel replicas decoding with
different response lengths and chunk sizes) the ranks' MoE layers exchange tokens in every
forward, so the decoder keeps them in lockstep: the rank that finishes first joins its peer's
remaining steps with idle one-token forwards, and the rank with fewer decode calls idles
through the other's. A hang here is a failure (hard timeout).
"""

from __future__ import annotations

import pytest
import torch

from reco_megatron.rollout.requests import SamplingParams
from reco_megatron.testing import run_distributed
from tests.megatron import _moe

pytestmark = pytest.mark.dist

PROMPTS = [[5, 17, 3], [9, 1, 44, 12, 7], [60, 2, 8, 31], [4, 4, 90]]


def _body(rank, world_size, ep, modes, tp=1):
    return {mode: _generate_and_train(ep, mode, tp) for mode in modes}


def _generate_and_train(ep, mode, tp=1):
    from megatron.core import parallel_state as ps

    from reco_megatron.megatron.decoding.decoder import MegatronDecoder
    from reco_megatron.rollout.megatron_engine import MegatronEngine, MegatronEngineConfig
    from reco_megatron.trainer.orchestration import build_rollout_batch

    engine = _moe.build_engine(tp=tp, ep=ep, routing_replay=mode)  # TP > 1: with SP
    dp = ps.get_data_parallel_rank()
    decoder = MegatronDecoder(
        engine.unwrapped(),
        vocab_size=engine.model_cfg.vocab_size,
        max_model_len=engine.model_cfg.max_position_embeddings,
        max_batch_size=3 if dp == 0 else 8,  # 8 rows: 3 decode calls, or 1
        routing=engine.routing,
        record_routing=True,
    )
    rollout = MegatronEngine(decoder, MegatronEngineConfig(seed=0, eos_token_ids=(7,)))
    prompts = PROMPTS if dp == 0 else PROMPTS[::-1]
    sampling = SamplingParams(temperature=1.0, max_new_tokens=8 if dp == 0 else 3, seed=11 + dp)
    groups = rollout.generate(prompts, 2, sampling)
    flat = [c for group in groups for c in group]
    batch = build_rollout_batch(
        prompts,
        [c.token_ids for c in flat],
        [c.logprobs for c in flat],
        torch.randn(len(flat)),
        2,
        pad_id=0,
        routed_experts=[c.routed_experts for c in flat],
    )
    prepared, prep = engine.prepare(batch)
    gap = None
    if engine.is_last_stage:
        mask = batch.loss_mask.bool()
        gap = float((prepared.old_logprobs - batch.rollout_logprobs).abs()[mask].max())
    return {
        "routed": [c.routed_experts for c in flat],
        "lengths": [len(prompts[i // 2]) + len(c.token_ids) for i, c in enumerate(flat)],
        "prep": prep,
        "gap": gap,
        "steps": len(engine.train_on_rollout(prepared)),
    }


@pytest.mark.parametrize(("ep", "tp"), [(1, 1), (2, 1), (2, 2)], ids=["ep1", "ep2", "ep2tp2sp"])
def test_rollout_routing_is_the_trainers(ep, tp) -> None:
    # EP 1 also trains in replay mode on its recorded routing (the same process). EP 2 x TP 2
    # trains with sequence parallelism (MoE at TP > 1 needs it) and decodes with it switched
    # off for the decode (one position per row cannot be split over TP).
    modes = ["record", "replay"] if ep == 1 else ["record"]
    results = run_distributed(_body, ep * tp, args=(ep, modes, tp), timeout=300)
    for res in (r[mode] for r in results for mode in modes):
        for routed, length in zip(res["routed"], res["lengths"], strict=True):
            assert routed.shape == (length, 2, _moe.TOPK) and routed.dtype == torch.int16
            known = routed[:-1]
            assert bool((known >= 0).all()) and bool((known < _moe.EXPERTS).all())
            # the last sampled token was never fed: unknown, or fed because others went on
            assert bool((routed[-1] >= 0).all()) or bool((routed[-1] == -1).all())
        assert res["prep"]["routing_mismatch"] == 0.0
        assert res["prep"]["routing_mismatch_layer"] == 0.0
        assert res["gap"] < 1e-5
        assert res["steps"] == 2  # the updates run on the recorded batch
