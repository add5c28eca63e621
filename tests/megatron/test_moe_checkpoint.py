"""Checkpoints of a Qwen3-MoE under expert parallelism: exact resume, resharding, export.

The tiny model of ``tests/megatron/_moe.py`` at EP 2 (2 ranks, distributed optimizer: the
experts' Adam state is sharded over their data-parallel group, the rest over DP).

* Resume is bit-exact: the update after a load equals the uninterrupted run's.
* The model weights reshard: the EP 2 checkpoint loads at EP 1 (weights only) with every
  expert where it belongs; the optimizer state refuses another EP size, naming it.
* ``reco-export`` writes the EP 2 checkpoint as a Hugging Face Qwen3-MoE directory (one
  process, EP 1) that ``transformers`` loads with the engine's logits, and generates.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from reco_megatron.megatron.checkpoint import (
    CheckpointError,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from reco_megatron.testing import run_distributed
from tests.megatron import _moe, _reco

pytestmark = pytest.mark.dist
transformers = pytest.importorskip("transformers")


def _update(engine, seed):
    batch = _reco.dp_share(_moe.rollout_batch(seed))
    prepared, _ = engine.prepare(batch)
    return engine.train_on_rollout(prepared)


def _logits(engine) -> torch.Tensor | None:
    """Full logits ``[2, S, V]`` of fixed tokens (collective; None off the last stage)."""
    from tests.megatron.test_convert import _megatron_logits

    return _megatron_logits(engine.unwrapped(), engine.model_cfg.vocab_size)


def _save_resume_body(rank, world_size, root):
    engine = _moe.build_engine(ep=2, distributed_optimizer=True)
    _update(engine, seed=1)
    save_checkpoint(root, 1, engine, {"step": 1}, keep_last=2)
    _update(engine, seed=2)
    uninterrupted = _moe.full_params(engine)
    logits = _logits(engine)
    fresh = _moe.build_engine(ep=2, distributed_optimizer=True)
    state = load_checkpoint(latest_checkpoint(root), fresh)
    _update(fresh, seed=2)
    save_checkpoint(root, 2, fresh, {"step": 2}, keep_last=2)
    return {
        "state": state,
        "uninterrupted": uninterrupted,
        "resumed": _moe.full_params(fresh),
        "logits": logits,
    }


def _load_at_ep1_body(rank, world_size, root):
    engine = _moe.build_engine(ep=1, distributed_optimizer=True)
    try:
        load_checkpoint(latest_checkpoint(root), engine)
    except CheckpointError as err:
        error = str(err)
    load_checkpoint(latest_checkpoint(root), engine, load_optimizer=False)
    return {"params": _moe.full_params(engine), "error": error}


def _cli(rank: int, world: int, argv: list[str]) -> int:
    from reco_megatron.export import main

    return main(argv)


def test_resume_reshard_and_export(tmp_path: Path) -> None:
    root, out = str(tmp_path / "ckpt"), tmp_path / "hf"
    results = run_distributed(_save_resume_body, 2, args=(root,), timeout=300)
    for res in results:
        assert res["state"] == {"step": 1}
        for name, value in res["uninterrupted"].items():
            assert torch.equal(res["resumed"][name], value), name
    saved = results[0]["resumed"]
    # weights reshard from EP 2 to EP 1: every expert lands where it belongs
    # (the optimizer state refuses another EP size, naming it)
    (loaded,) = run_distributed(_load_at_ep1_body, 1, args=(root,), timeout=180)
    assert "expert-parallel size: checkpoint 2 vs run 1" in loaded["error"]
    assert loaded["params"].keys() == saved.keys()
    for name, value in saved.items():
        assert torch.equal(loaded["params"][name], value), name
    # reco-export (one process) writes a Qwen3-MoE that transformers runs like the engine
    (status,) = run_distributed(_cli, 1, args=([root, str(out)],), timeout=180)
    assert status == 0
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "qwen3_moe" and config["num_experts"] == _moe.EXPERTS
    model = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager")
    from tests.megatron.test_convert import hf_logits

    logits = hf_logits(model.float().eval())
    torch.testing.assert_close(logits, results[-1]["logits"], atol=1e-5, rtol=1e-5)
    generated = model.generate(torch.tensor([[5, 17, 3]]), max_new_tokens=5, do_sample=False)
    assert generated.shape == (1, 8)
