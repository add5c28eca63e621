"""Shared bodies of the megatron rollout-engine tests (they run inside ``run_distributed`` ranks).

The trainer's own :class:`ReCoEngine` (tiny Llama of ``tests/megatron/_reco.py``: GQA, RoPE,
vocabulary 100 padded to 128) is built at the requested TP/PP, and the rollout engine decodes
on its chunks; the reference is the trainer's old-policy pass over the same tokens.
"""

from __future__ import annotations

from typing import Any

import torch

from reco_megatron.rollout.requests import SamplingParams

PROMPTS = [[5, 17, 3], [9, 1, 44, 12, 7], [60, 2, 8, 31]]


def rollout_engine(
    engine: Any, max_batch_size: int = 16, seed: int = 0, eos: tuple = (), release: bool = True
) -> Any:
    """A :class:`MegatronEngine` on ``engine``'s chunks (what the trainer builds)."""
    from reco_megatron.megatron.decoding.decoder import MegatronDecoder
    from reco_megatron.rollout.megatron_engine import MegatronEngine, MegatronEngineConfig

    cfg = engine.model_cfg
    decoder = MegatronDecoder(
        engine.unwrapped(),
        vocab_size=cfg.vocab_size,
        max_model_len=cfg.max_position_embeddings,
        max_batch_size=max_batch_size,
    )
    return MegatronEngine(
        decoder,
        MegatronEngineConfig(seed=seed, eos_token_ids=eos, release_cache_after_generate=release),
    )


def logprob_gap_body(
    rank: int, world: int, tp: int, pp: int, sampling: SamplingParams, sp: bool = False
) -> Any:
    """Generate, then teacher-force the same tokens through the trainer's old-policy pass;
    returns (max |rollout - trainer| over response tokens, number of tokens) on the last stage.
    ``sp``: the trainer runs with sequence parallelism (the decoder switches it off)."""
    from reco_megatron.trainer.orchestration import build_rollout_batch
    from tests.megatron._reco import build_engine

    engine = build_engine(tp=tp, pp=pp, micro_batch_size=2, sequence_parallel=sp)
    sp_flags = _sp_flags(engine)
    rollout = rollout_engine(engine, max_batch_size=4)  # 3 prompts x 2 = 6 rows: 2 chunks
    groups = rollout.generate(PROMPTS, 2, sampling)
    responses = [c.token_ids for g in groups for c in g]
    logprobs = [c.logprobs for g in groups for c in g]
    batch = build_rollout_batch(PROMPTS, responses, logprobs, torch.zeros(6), 2, pad_id=0)
    assert _sp_flags(engine) == sp_flags, "decoding left sequence parallelism switched"
    stats = engine.statistics(batch)
    if not stats:
        return None
    mask = batch.loss_mask.bool()
    old = stats["logprob"]
    gap = (old - batch.rollout_logprobs).abs()[mask]
    return float(gap.max()), int(mask.sum()), responses


def _sp_flags(engine: Any) -> list[Any]:
    """The config's and every module's sequence-parallel flags, in module order."""
    from reco_megatron.megatron.decoding.sequence_parallel import _SP_ATTRIBUTES

    chunk = engine.unwrapped()[0]
    flags: list[Any] = [chunk.config.sequence_parallel]
    for module in chunk.modules():
        flags += [vars(module)[a] for a in _SP_ATTRIBUTES if a in vars(module)]
    return flags


def _embedded_twin(engine: Any, eos: tuple = ()) -> Any:
    """The embedded engine loaded with ``engine``'s weights through the HF export."""
    from reco_megatron.megatron.hf.config import hf_config_from_model_config
    from reco_megatron.megatron.hf.converter import policy_hf_weights
    from reco_megatron.rollout.embedded import EmbeddedEngine
    from reco_megatron.rollout.embedded_config import EmbeddedEngineConfig

    hf = hf_config_from_model_config(engine.model_cfg)
    hf["eos_token_id"] = None
    twin = EmbeddedEngine(hf, EmbeddedEngineConfig(max_batch_size=4, eos_token_ids=eos))
    twin.update_weights(policy_hf_weights(engine.unwrapped(), engine.model_cfg))
    return twin


def versus_embedded_body(rank: int, world: int, tp: int, settings: list[SamplingParams]) -> Any:
    """Per setting: (tokens equal?, max |logprob gap|, finish reasons equal?, token count) of
    the megatron and embedded engines on the same weights, prompts and per-prompt seeds."""
    from tests.megatron._reco import build_engine

    engine = build_engine(tp=tp, micro_batch_size=2)
    mine = rollout_engine(engine, max_batch_size=4)
    twin = _embedded_twin(engine)  # every rank exports (collective), every rank compares
    out = []
    for k, setting in enumerate(settings):
        params = [
            SamplingParams(**{**setting.__dict__, "seed": 100 * k + i}) for i in range(len(PROMPTS))
        ]
        a = mine.generate(PROMPTS, 4, params)
        b = twin.generate(PROMPTS, 4, params)
        pairs = [(x, y) for ga, gb in zip(a, b, strict=True) for x, y in zip(ga, gb, strict=True)]
        same = all(x.token_ids == y.token_ids for x, y in pairs)
        reasons = all(x.finish_reason == y.finish_reason for x, y in pairs)
        gap = max(
            (
                abs(p - q)
                for x, y in pairs
                if len(x.logprobs) == len(y.logprobs)
                for p, q in zip(x.logprobs, y.logprobs, strict=True)
            ),
            default=0.0,
        )
        count = sum(len(x.token_ids) for g in a for x in g)
        out.append((same, gap, reasons, count))
    return out


def seeds_body(rank: int, world: int) -> Any:
    """Seeded sampling: repeat, alone vs batched, other batch compositions and chunk sizes."""
    from tests.megatron._reco import build_engine

    engine = build_engine(micro_batch_size=2)
    s = SamplingParams(temperature=1.0, max_new_tokens=10, top_p=0.9)
    seeded = [SamplingParams(**{**s.__dict__, "seed": 11 + i}) for i in range(3)]

    def run(engine_rows: int, order: list[int]) -> list[list[Any]]:
        eng = rollout_engine(engine, max_batch_size=engine_rows)
        got = eng.generate([PROMPTS[i] for i in order], 3, [seeded[i] for i in order])
        return [[(c.token_ids, c.logprobs) for c in got[order.index(i)]] for i in sorted(order)]

    together = run(16, [0, 1, 2])
    return {
        "together": together,
        "again": run(16, [0, 1, 2]),
        "alone": [run(16, [i])[0] for i in range(3)],
        "reordered": run(5, [2, 0, 1]),
    }


def state_body(rank: int, world: int) -> Any:
    """Sleep/wake and the KV cache, the weight stream, the sampler state after a resume."""
    from tests.megatron._reco import build_engine

    engine = build_engine(micro_batch_size=2)
    s = SamplingParams(max_new_tokens=5)
    released = rollout_engine(engine, max_batch_size=8)  # the trainer's setting
    released.generate(PROMPTS, 2, s)
    out: dict[str, Any] = {"kv_released": released.decoder.kv_cache_bytes()}
    eng = rollout_engine(engine, max_batch_size=8, seed=3, release=False)
    out["kv_before"] = eng.decoder.kv_cache_bytes()
    eng.generate(PROMPTS, 2, s)
    out["kv_after_generate"] = eng.decoder.kv_cache_bytes()
    eng.sleep()
    out["kv_asleep"] = eng.decoder.kv_cache_bytes()
    try:
        eng.generate(PROMPTS, 2, s)
        out["asleep_error"] = None
    except RuntimeError as err:
        out["asleep_error"] = str(err)
    eng.wake()
    saved = eng.state_dict()
    first = eng.generate(PROMPTS, 2, s)  # unseeded: the engine's (seed, call index) stream
    resumed = rollout_engine(engine, max_batch_size=8, seed=99)
    resumed.load_state_dict(saved)
    out["replayed"] = [c.token_ids for g in first for c in g] == [
        c.token_ids for g in resumed.generate(PROMPTS, 2, s) for c in g
    ]
    eng.update_weights(iter(()))
    try:
        eng.update_weights([("model.embed_tokens.weight", torch.zeros(1))])
        out["stream_error"] = None
    except ValueError as err:
        out["stream_error"] = str(err)
    return out
