"""Qwen3 dense (QK layernorm, decoupled head width) trained at TP 2 equals one process, and
resumes bit-exactly at TP 2 + SP from its checkpoint.

The tiny model of ``tests/megatron/_reco.py`` as a ``qwen3``: 4 query heads x head_dim 16 (64,
not the hidden size 32), 2 kv heads, per-head RMSNorm of queries and keys (replicated over TP:
megatron sums their gradients over the TP group, which this test would catch if it did not),
tied embeddings. One rollout update (old-policy pass + 2 optimizer steps); tolerances as in
``test_reco_step.py`` (parameters 2e-5, losses 1e-5).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from reco_megatron.algo import LossConfig
from reco_megatron.testing import run_distributed
from tests.megatron import _reco

pytestmark = pytest.mark.dist


def _qwen3():
    return _reco.model_config("qwen3", kv_channels=16, tie_word_embeddings=True)


def _body(rank, world_size, tp, pp, reference):
    model = _qwen3()
    loss = LossConfig.preset("reco", kl_coef=0.0)
    engine = _reco.build_engine(tp=tp, pp=pp, model=model, loss=loss)
    if reference is None:  # a fresh model's weights, then its one-process update
        reference = _reco.full_params(engine)
        return {**_body(rank, world_size, tp, pp, reference), "reference": reference}
    _reco.load_full(engine, reference)
    prepared, _ = engine.prepare(_reco.dp_share(_reco.rollout_batch()))
    steps = engine.train_on_rollout(prepared)
    return {
        "params": _reco.gather_stages(_reco.full_params(engine)),
        "losses": [engine.broadcast_metrics(m)["loss"] for m in steps],
    }


def test_qwen3_tp2_equals_one_process() -> None:
    want = run_distributed(_body, 1, args=(1, 1, None), timeout=180)[0]
    reference = want["reference"]
    assert any(k.endswith("q_layernorm.weight") for k in reference)
    moved = max(float((want["params"][k] - v).abs().max()) for k, v in reference.items())
    assert moved > 1e-3
    for res in run_distributed(_body, 2, args=(2, 1, reference), timeout=240):
        for name, value in want["params"].items():
            torch.testing.assert_close(res["params"][name], value, atol=2e-5, rtol=0, msg=name)
        assert res["losses"] == pytest.approx(want["losses"], abs=1e-5)


def _update(engine, seed):
    prepared, _ = engine.prepare(_reco.dp_share(_reco.rollout_batch(seed)))
    engine.train_on_rollout(prepared)


def _resume_body(rank, world_size, root):
    from reco_megatron.megatron.checkpoint import (
        latest_checkpoint,
        load_checkpoint,
        save_checkpoint,
    )

    def build():
        return _reco.build_engine(tp=2, model=_qwen3(), sequence_parallel=True)

    engine = build()
    _update(engine, seed=1)
    save_checkpoint(root, 1, engine, {"step": 1}, keep_last=2)
    _update(engine, seed=2)
    fresh = build()
    state = load_checkpoint(latest_checkpoint(root), fresh)
    _update(fresh, seed=2)
    return state, _reco.full_params(engine), _reco.full_params(fresh)


def test_qwen3_resumes_bit_exactly_at_tp2_with_sequence_parallel(tmp_path: Path) -> None:
    root = str(tmp_path / "ckpt")
    results = run_distributed(_resume_body, 2, args=(root,), timeout=240)
    for state, uninterrupted, resumed in results:
        assert state == {"step": 1}
        assert any(k.endswith("k_layernorm.weight") for k in resumed)
        for name, value in uninterrupted.items():
            assert torch.equal(resumed[name], value), name
