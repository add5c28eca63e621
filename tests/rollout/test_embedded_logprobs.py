"""The embedded engine's log-probs equal a teacher-forced forward of the same HF model.

Tolerance 1e-5 (fp32): the engine runs left-padded batches with a KV cache, the reference one
unpadded forward per sequence in fp64 softmax; observed differences are ~5e-7.
"""

from __future__ import annotations

import pytest
import torch

from reco_megatron.rollout import EmbeddedEngine, EmbeddedEngineConfig, SamplingParams
from tests.rollout._tiny import TINY_LLAMA, teacher_forced_logprobs

TOL = 1e-5
PROMPTS = [[5, 6, 7], [1, 9, 10, 11, 12, 13, 14, 15, 16], [4], [3, 3, 8, 8]]


def _assert_matches_reference(model, prompts, results, temperature) -> None:
    assert len(results) == len(prompts)
    for i, group in enumerate(results):
        for j, comp in enumerate(group):
            assert (comp.prompt_index, comp.sample_index) == (i, j)
            assert len(comp.token_ids) == len(comp.logprobs) >= 1
            ref = teacher_forced_logprobs(model, prompts[i], comp.token_ids, temperature)
            got = torch.tensor(comp.logprobs, dtype=torch.float64)
            torch.testing.assert_close(got, ref, atol=TOL, rtol=0)


@pytest.mark.parametrize(
    ("temperature", "top_p", "top_k", "attn"),
    [(1.0, 1.0, 0, "sdpa"), (0.7, 0.9, 20, "sdpa"), (1.3, 1.0, 5, "eager")],
)
def test_logprobs_equal_teacher_forced_forward(ref_model, temperature, top_p, top_k, attn) -> None:
    # max_batch_size 5 puts prompts of different lengths into one left-padded chunk and splits
    # the 12 rows over three chunks.
    cfg = EmbeddedEngineConfig(max_batch_size=5, attn_implementation=attn, eos_token_ids=())
    engine = EmbeddedEngine(TINY_LLAMA, cfg)
    engine.update_weights(ref_model.state_dict().items())
    sampling = SamplingParams(
        temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=10, seed=7
    )
    results = engine.generate(PROMPTS, 3, sampling)
    assert all(len(group) == 3 for group in results)
    _assert_matches_reference(ref_model, PROMPTS, results, temperature)


def test_logprobs_with_eos_stops_and_mixed_lengths(engine, ref_model) -> None:
    # Stop on several frequent tokens so rows of a chunk finish at different steps.
    sampling = SamplingParams(max_new_tokens=12, seed=3, stop_token_ids=(10, 20, 30, 40))
    results = engine.generate(PROMPTS, 4, sampling)
    lengths = {len(c.token_ids) for g in results for c in g}
    assert len(lengths) > 1, "expected completions of different lengths"
    _assert_matches_reference(ref_model, PROMPTS, results, 1.0)


def test_greedy_is_argmax_with_untempered_logprobs(engine, ref_model) -> None:
    sampling = SamplingParams(temperature=0.0, max_new_tokens=6)
    results = engine.generate(PROMPTS[:2], 2, sampling)
    for i, group in enumerate(results):
        assert group[0].token_ids == group[1].token_ids
        comp = group[0]
        ids = torch.tensor([PROMPTS[i] + comp.token_ids])
        with torch.no_grad():
            logits = ref_model(input_ids=ids).logits[0]
        start = len(PROMPTS[i]) - 1
        argmax = logits[start : start + len(comp.token_ids)].argmax(-1).tolist()
        assert comp.token_ids == argmax
    _assert_matches_reference(ref_model, PROMPTS[:2], results, 0.0)


def test_batching_does_not_change_samples(ref_model) -> None:
    sampling = SamplingParams(temperature=0.9, max_new_tokens=6, seed=11)
    outs = []
    for size in (1, 3, 64):  # 6 rows: one per chunk, two chunks of 3, one chunk
        engine = EmbeddedEngine(TINY_LLAMA, EmbeddedEngineConfig(max_batch_size=size))
        engine.update_weights(ref_model.state_dict().items())
        outs.append(engine.generate(PROMPTS[:3], 2, sampling))
    for other in outs[1:]:
        for g0, g1 in zip(outs[0], other, strict=True):
            for c0, c1 in zip(g0, g1, strict=True):
                assert c0.token_ids == c1.token_ids
                torch.testing.assert_close(
                    torch.tensor(c0.logprobs), torch.tensor(c1.logprobs), atol=TOL, rtol=0
                )
