"""The interleaved (virtual) pipeline: one ReCo update at PP 2 x VP 2 equals one process, and
its checkpoints resume exactly and load at PP 1.

4 layers in 4 chunks (2 stages x 2 chunks, one layer each): chunk ``i`` of stage ``r`` holds
layer ``2 i + r``, so the layer numbering, the per-chunk data iterators and megatron's
interleaved 1F1B schedule are all on the path. The result is bit-identical to the single
process (same fp32 operations in the same order; measured 0.0), asserted with the tolerances of
``test_reco_step``.

PP 2 is the case megatron's batched point-to-point exchange gets wrong: the previous stage is
also the next one, so a stage's outgoing activation and its outgoing gradient travel to the same
rank with the same tag and the receiver mixes them up (later micro-batches then see another
micro-batch's hidden states). ``model.transformer_config`` therefore sends one by one with a
virtual pipeline (``overlap_p2p_comm``), as Megatron-LM does by default.

Checkpoints hold one model state per chunk (``model0``, ``model1``) under the chunks' global
layer numbers: a PP 2 x VP 2 run saved after one update, reloaded into fresh chunks and updated
again equals the uninterrupted run bit for bit, and the same checkpoint loads into one process.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from reco_megatron.megatron.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from reco_megatron.testing import run_distributed
from tests.megatron import _reco

pytestmark = pytest.mark.dist

LAYERS = 4


def _body(rank, world_size, pp, vp, reference):
    engine = _reco.build_engine(pp=pp, vp=vp, model=_reco.model_config(num_layers=LAYERS))
    if reference is None:
        return _reco.full_params(engine)
    if vp is not None:
        numbers = [layer.layer_number for c in engine.unwrapped() for layer in c.decoder.layers]
        assert numbers == [1 + rank, 3 + rank], numbers  # chunk i of stage r: layer 2i + r
    _reco.load_full(engine, reference)
    prepared, _ = engine.prepare(_reco.dp_share(_reco.rollout_batch()))
    steps = engine.train_on_rollout(prepared)
    return {
        "params": _reco.gather_stages(_reco.full_params(engine)),
        "steps": [engine.broadcast_metrics(m) for m in steps],
        "old_logprobs": prepared.old_logprobs,
    }


def test_interleaved_pipeline_equals_single_process() -> None:
    ref = run_distributed(_body, 1, args=(1, None, None), timeout=120)[0]
    single = run_distributed(_body, 1, args=(1, None, ref), timeout=120)[0]
    results = run_distributed(_body, 2, args=(2, 2, ref), timeout=180)
    last = results[-1]
    torch.testing.assert_close(last["old_logprobs"], single["old_logprobs"], atol=1e-6, rtol=0)
    for res in results:
        assert res["params"].keys() == single["params"].keys()
        for name, value in single["params"].items():
            torch.testing.assert_close(res["params"][name], value, atol=2e-5, rtol=0, msg=name)
        for got, want in zip(res["steps"], single["steps"], strict=True):
            for key in ("loss", "ratio_max", "token_ratio_max", "entropy"):
                assert got[key] == pytest.approx(want[key], abs=1e-5), key


def _update(engine, seed):
    prepared, _ = engine.prepare(_reco.dp_share(_reco.rollout_batch(seed=seed)))
    engine.train_on_rollout(prepared)


def _resume_body(rank, world_size, root, reference):
    engine = _reco.build_engine(pp=2, vp=2, model=_reco.model_config(num_layers=LAYERS))
    _reco.load_full(engine, reference)
    _update(engine, seed=1)
    save_checkpoint(root, 1, engine, {"step": 1}, keep_last=1)
    saved = _reco.gather_stages(_reco.full_params(engine))
    _update(engine, seed=2)
    fresh = _reco.build_engine(pp=2, vp=2, model=_reco.model_config(num_layers=LAYERS))
    load_checkpoint(latest_checkpoint(root), fresh)
    _update(fresh, seed=2)
    return {
        "saved": saved,
        "uninterrupted": _reco.gather_stages(_reco.full_params(engine)),
        "resumed": _reco.gather_stages(_reco.full_params(fresh)),
    }


def _load_body(rank, world_size, root):
    engine = _reco.build_engine(model=_reco.model_config(num_layers=LAYERS))
    load_checkpoint(latest_checkpoint(root), engine, load_optimizer=False, load_rng=False)
    return _reco.full_params(engine)


def test_interleaved_checkpoint_resumes_exactly_and_loads_at_pp1(tmp_path: Path) -> None:
    ref = run_distributed(_body, 1, args=(1, None, None), timeout=120)[0]
    root = str(tmp_path / "ckpt")
    results = run_distributed(_resume_body, 2, args=(root, ref), timeout=300)
    for res in results:
        for name, value in res["uninterrupted"].items():
            assert torch.equal(res["resumed"][name], value), name
    single = run_distributed(_load_body, 1, args=(root,), timeout=120)[0]
    assert single.keys() == results[0]["saved"].keys()
    for name, value in results[0]["saved"].items():
        assert torch.equal(single[name], value), name
