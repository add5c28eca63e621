"""Reference outputs of the megatron rollout engine, kept as a fixture.

``decoder_reference.json`` holds the tokens and log-probs the engine's first decoder (megatron
-core's static inference path, right padding, prefill up to the shortest prompt) produced on the
tiny dense Llama and the tiny Qwen3-MoE of the engine tests with seeded weights
(:func:`seeded_weights`, the same at every layout) and fixed sampling seeds, on CPU in fp32.
``test_decoder_reference.py`` checks that today's decoder gives the same tokens and log-probs
within 1e-5 at every layout. Regenerate only on purpose (the file is the old code's answer)::

    python -m tests.megatron._decoder_reference   # writes tests/megatron/data/...json
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from reco_megatron.rollout.base import SamplingParams

FIXTURE = Path(__file__).parent / "data" / "decoder_reference.json"
PROMPTS = [[5, 17, 3], [9, 1, 44, 12, 7, 30, 2, 61, 8], [60, 2, 8, 31], [4], [7, 7, 81, 6, 3, 3]]
SETTINGS = {
    "t1": SamplingParams(temperature=1.0, max_new_tokens=10),
    "greedy": SamplingParams(temperature=0.0, max_new_tokens=7),
    "topk_topp_stop": SamplingParams(
        temperature=0.8, top_k=20, top_p=0.9, max_new_tokens=12, stop_token_ids=(3, 11, 50)
    ),
    # a third of the vocabulary stops: rows end at many different steps
    "many_stops": SamplingParams(max_new_tokens=16, stop_token_ids=tuple(range(0, 100, 3))),
}
SEED = 7


def outputs(engine: Any, rollout: Any) -> dict[str, Any]:
    """Per setting: ``[[tokens, logprobs, finish_reason] per completion]`` for 2 samples of each
    prompt, every prompt seeded on its own."""
    got: dict[str, Any] = {}
    for name, setting in SETTINGS.items():
        params = [
            SamplingParams(**{**setting.__dict__, "seed": SEED + i}) for i in range(len(PROMPTS))
        ]
        groups = rollout.generate(PROMPTS, 2, params)
        got[name] = [[c.token_ids, c.logprobs, c.finish_reason] for g in groups for c in g]
    return got


def seeded_weights(full: dict[str, Any]) -> dict[str, Any]:
    """Weights that depend on nothing but the names and shapes (the same at every layout:
    megatron's own initialisation seeds each pipeline stage differently)."""
    import torch

    out = {}
    for k, name in enumerate(sorted(full)):
        gen = torch.Generator().manual_seed(1000 + k)
        noise = torch.randn(full[name].shape, generator=gen, dtype=torch.float32)
        is_norm = full[name].dim() == 1 and "norm" in name
        out[name] = (1.0 + 0.1 * noise if is_norm else 0.3 * noise).to(full[name].dtype)
    return out


def dense_body(
    rank: int, world: int, tp: int = 1, pp: int = 1, max_batch_size: int = 4, **decoder: Any
) -> Any:
    """``decoder``: further ``MegatronDecoder`` arguments (e.g. ``sync_every``)."""
    from reco_megatron.megatron.decoding.decoder import MegatronDecoder
    from reco_megatron.rollout.megatron_engine import MegatronEngine, MegatronEngineConfig
    from tests.megatron import _reco

    engine = _reco.build_engine(tp=tp, pp=pp, micro_batch_size=2)
    full = _reco.gather_stages(_reco.full_params(engine))
    _reco.load_full(engine, seeded_weights(full))
    decoding = MegatronDecoder(
        engine.unwrapped(),
        vocab_size=engine.model_cfg.vocab_size,
        max_model_len=engine.model_cfg.max_position_embeddings,
        max_batch_size=max_batch_size,
        **decoder,
    )
    return outputs(engine, MegatronEngine(decoding, MegatronEngineConfig(seed=0)))


def small_prefill_body(rank: int, world: int, moe: bool) -> Any:
    """:func:`dense_body` or :func:`moe_body` with the prefill's score budget at one byte:
    every prompt prefills in a forward of its own (at expert parallelism 1)."""
    from reco_megatron.megatron.decoding import stage

    stage.PREFILL_SCORE_BYTES = 1
    return moe_body(rank, world, 1, None) if moe else dense_body(rank, world, 1, 1, None)


def moe_body(rank: int, world: int, ep: int = 1, max_batch_size: int = 4) -> Any:
    from reco_megatron.megatron.decoding.decoder import MegatronDecoder
    from reco_megatron.rollout.megatron_engine import MegatronEngine, MegatronEngineConfig
    from tests.megatron import _moe

    engine = _moe.build_engine(ep=ep, routing_replay="record")
    _moe.load_full(engine, seeded_weights(_moe.full_params(engine)))
    decoder = MegatronDecoder(
        engine.unwrapped(),
        vocab_size=engine.model_cfg.vocab_size,
        max_model_len=engine.model_cfg.max_position_embeddings,
        max_batch_size=max_batch_size,
        routing=engine.routing,
        record_routing=True,
    )
    rollout = MegatronEngine(decoder, MegatronEngineConfig(seed=0))
    got = outputs(engine, rollout)
    groups = rollout.generate(PROMPTS, 2, SamplingParams(max_new_tokens=6, seed=SEED))
    got["routed"] = [c.routed_experts.tolist() for g in groups for c in g]
    return got


def main() -> None:
    from reco_megatron.testing import run_distributed

    data = {
        "dense": run_distributed(dense_body, 1, timeout=600)[0],
        "moe": run_distributed(moe_body, 1, timeout=600)[0],
    }
    FIXTURE.write_text(json.dumps(data))


if __name__ == "__main__":
    main()
