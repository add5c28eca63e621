"""Bodies of the prefix-cache tests (they run inside ``run_distributed`` ranks).

Multi-turn episodes are driven by hand here, as ``reco_megatron/envs/episodes.py`` drives the
engine: turn ``t + 1``'s prompt is turn ``t``'s prompt, its response and a fixed observation,
one sample per episode, a seed per episode and turn. The same turns run on two decoders over
the same model chunk, one with the prefix cache and one without (``prefix_cache_bytes=0``).
The model runs in fp64 (parameters and activations; the sampler's logits are fp32), so the
two can differ only where a forward of another shape sums in another order (~1e-15).
"""

from __future__ import annotations

from typing import Any

import torch

from reco_megatron.rollout.requests import SamplingParams

PROMPTS = [[5, 17, 3], [9, 1, 44, 12, 7], [60, 2, 8, 31], [4]]
OBSERVATION = [21, 22, 23]
TURNS = 3
NEW = 5


def tiny_fp64(tp: int = 1, pp: int = 1) -> Any:
    """The tiny Llama of the engine tests, its chunk cast to fp64."""
    from tests.megatron._reco import build_engine

    engine = build_engine(tp=tp, pp=pp, micro_batch_size=2)
    for chunk in engine.unwrapped():
        chunk.double()
        chunk.config.params_dtype = torch.float64
    return engine


def rollout(engine: Any, prefix_cache_bytes: int | None, **decoder: Any) -> Any:
    """A :class:`MegatronEngine` on ``engine``'s chunks; ``decoder``: further
    ``MegatronDecoder`` arguments."""
    from reco_megatron.megatron.decoding.decoder import MegatronDecoder
    from reco_megatron.rollout.megatron_engine import MegatronEngine, MegatronEngineConfig

    cfg = engine.model_cfg
    decoding = MegatronDecoder(
        engine.unwrapped(),
        vocab_size=cfg.vocab_size,
        max_model_len=cfg.max_position_embeddings,
        max_batch_size=16,
        prefix_cache_bytes=prefix_cache_bytes,
        **decoder,
    )
    return MegatronEngine(decoding, MegatronEngineConfig(seed=0))


def turns(
    eng: Any, prompts: list[list[int]], n_turns: int = TURNS, stops: tuple[int, ...] = ()
) -> dict[str, Any]:
    """``n_turns`` turns of one episode per prompt (``stops``: stop ids of every turn): every
    turn's tokens, log-probs and the decoder's prefilled / reused positions of that turn."""
    contexts = [list(p) for p in prompts]
    out: dict[str, Any] = {"tokens": [], "logprobs": [], "prefilled": [], "reused": []}
    decoder = eng.decoder
    for t in range(n_turns):
        params = [
            SamplingParams(
                temperature=1.0, max_new_tokens=NEW, seed=1000 * t + i, stop_token_ids=stops
            )
            for i in range(len(contexts))
        ]
        before = (decoder.prefix_cache.prefilled_positions, decoder.prefix_cache.reused_positions)
        got = eng.generate(contexts, 1, params)
        out["prefilled"].append(decoder.prefix_cache.prefilled_positions - before[0])
        out["reused"].append(decoder.prefix_cache.reused_positions - before[1])
        out["tokens"].append([g[0].token_ids for g in got])
        out["logprobs"].append([g[0].logprobs for g in got])
        contexts = [c + g[0].token_ids + OBSERVATION for c, g in zip(contexts, got, strict=True)]
    out["contexts"] = contexts
    return out


def equality_body(
    rank: int, world: int, tp: int = 1, pp: int = 1, stops: tuple[int, ...] = (), **decoder: Any
) -> Any:
    """The same episodes with and without the prefix cache, and what each prefilled."""
    engine = tiny_fp64(tp, pp)
    cached = turns(rollout(engine, None, **decoder), PROMPTS, stops=stops)
    plain = turns(rollout(engine, 0, **decoder), PROMPTS, stops=stops)
    return {"cached": cached, "plain": plain}


def invalidation_body(rank: int, world: int) -> Any:
    """Turn 0, then the weights change (the trainer's sync: ``update_weights(())``; or
    ``sleep``/``wake``), then turn 1: no hit, and the tokens of the new weights."""
    engine = tiny_fp64()
    eng = rollout(engine, None)
    params = [SamplingParams(max_new_tokens=NEW, seed=i) for i in range(len(PROMPTS))]
    first = eng.generate(PROMPTS, 1, params)
    nexts = [p + g[0].token_ids + OBSERVATION for p, g in zip(PROMPTS, first, strict=True)]
    held = len(eng.decoder.prefix_cache.store)
    with torch.no_grad():  # new weights: every parameter moved, as an optimizer step would
        for chunk in engine.unwrapped():
            for param in chunk.parameters():
                param.add_(0.05 * torch.randn_like(param))
    eng.update_weights(())
    after_update = len(eng.decoder.prefix_cache.store)
    reused = eng.decoder.prefix_cache.reused_positions
    second = eng.generate(nexts, 1, params)
    no_hit_after_update = eng.decoder.prefix_cache.reused_positions == reused
    fresh = rollout(engine, 0).generate(nexts, 1, params)
    same_as_fresh = [g[0].token_ids for g in second] == [g[0].token_ids for g in fresh]
    eng.sleep()
    after_sleep = len(eng.decoder.prefix_cache.store)
    return {
        "held": held,
        "after_update": after_update,
        "no_hit_after_update": no_hit_after_update,
        "same_as_fresh": same_as_fresh,
        "after_sleep": after_sleep,
    }


def bound_body(rank: int, world: int) -> Any:
    """A prefix cache bounded to 20 positions: what it holds after a turn of 4 rows."""
    engine = tiny_fp64()
    probe = rollout(engine, None)
    per_position = probe.decoder.stage.bytes_per_row(1)
    eng = rollout(engine, 20 * per_position)
    got = turns(eng, PROMPTS, n_turns=2)
    store = eng.decoder.prefix_cache.store
    plain = turns(rollout(engine, 0), PROMPTS, n_turns=2)
    return {
        "limit": store.limit,
        "positions": store.positions,
        "entries": len(store),
        "nbytes": store.nbytes(),
        "per_position": per_position,
        "reused": got["reused"],
        "same": got["tokens"] == plain["tokens"],
    }


def partial_body(rank: int, world: int) -> Any:
    """Prompts that share only part of a kept sequence, or equal one: correct, and how many
    positions came from the cache."""
    engine = tiny_fp64()
    eng = rollout(engine, None)
    params = [SamplingParams(max_new_tokens=NEW, seed=i) for i in range(2)]
    first = eng.generate(PROMPTS[:2], 1, params)
    kept = [p + g[0].token_ids[:-1] for p, g in zip(PROMPTS[:2], first, strict=True)]
    probes = [
        [*kept[0][:2], 70, 71],  # shares 2 tokens with a kept sequence, then differs
        list(kept[1]),  # exactly a kept sequence (nothing left to feed would be a hit of 0)
    ]
    reused = eng.decoder.prefix_cache.reused_positions
    got = eng.generate(probes, 1, params)
    want = rollout(engine, 0).generate(probes, 1, params)
    pairs = list(zip(got, want, strict=True))
    return {
        "reused": eng.decoder.prefix_cache.reused_positions - reused,
        "same": all(a[0].token_ids == b[0].token_ids for a, b in pairs),
        "gap": max(
            abs(x - y) for a, b in pairs for x, y in zip(a[0].logprobs, b[0].logprobs, strict=True)
        ),
    }


def recording_body(rank: int, world: int) -> Any:
    """An MoE decoder that records routing: the prefix cache stays off (every call prefills
    whole prompts and records every prompt position's experts, as before)."""
    from reco_megatron.megatron.decoding.decoder import MegatronDecoder
    from reco_megatron.rollout.megatron_engine import MegatronEngine, MegatronEngineConfig
    from tests.megatron import _moe

    engine = _moe.build_engine(routing_replay="record")
    decoder = MegatronDecoder(
        engine.unwrapped(),
        vocab_size=engine.model_cfg.vocab_size,
        max_model_len=engine.model_cfg.max_position_embeddings,
        routing=engine.routing,
        record_routing=True,
    )
    eng = MegatronEngine(decoder, MegatronEngineConfig(seed=0))
    params = [SamplingParams(max_new_tokens=NEW, seed=i) for i in range(2)]
    first = eng.generate(PROMPTS[:2], 1, params)
    nexts = [p + g[0].token_ids + OBSERVATION for p, g in zip(PROMPTS[:2], first, strict=True)]
    second = eng.generate(nexts, 1, params)
    fed = [c[0].routed_experts[: len(p)] for c, p in zip(second, nexts, strict=True)]
    return {
        "enabled": decoder.prefix_cache.enabled,
        "store": decoder.prefix_cache.store,
        "reused": decoder.prefix_cache.reused_positions,
        "prompt_experts_recorded": all(bool((e >= 0).all()) for e in fed),
    }
