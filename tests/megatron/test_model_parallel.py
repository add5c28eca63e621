"""TP=2 and PP=2 of the real megatron GPTModel on CPU equal the single-process model.

The reference runs in one rank (TP=1, PP=1); its weights are copied into the parallel model,
so any difference comes from the parallel computation itself.
"""

from __future__ import annotations

import pytest
import torch

from reco_megatron.testing.multiprocess import run_distributed
from tests.megatron import _tiny

pytestmark = pytest.mark.dist

GLOBAL_BATCH, MICRO_BATCHES = 4, 2
# TP splits the hidden/ffn matmuls and all-reduces partial sums: fp32 reduction order changes,
# so results agree to a few ulps of the O(1) activations, not bit for bit.
TP_ATOL, TP_RTOL = 1e-5, 1e-4


def _logits(model: object, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Full-vocabulary logits ``[B, S, V]`` (gathered over TP ranks)."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    with torch.no_grad():
        logits = model(batch["tokens"], batch["position_ids"], None)
    if ps.get_tensor_model_parallel_world_size() > 1:
        logits = gather_from_tensor_model_parallel_region(logits)
    return logits


def _run(rank: int, world_size: int, tp: int, pp: int, reference: dict | None) -> dict:
    """Build the tiny model at (tp, pp), optionally load ``reference`` weights, run one step."""
    _tiny.init_parallel(tp=tp, pp=pp)
    model = _tiny.build_tiny_gpt(_tiny.tiny_config(tp=tp, pp=pp))
    if reference is not None:
        _tiny.load_reference(model, reference)
    batch = _tiny.tiny_batch(GLOBAL_BATCH)
    out: dict = {"params": _tiny.full_named(model)}
    if pp == 1:
        out["logits"] = _logits(model, batch)
    losses = _tiny.run_forward_backward(model, _tiny.split_batch(batch, MICRO_BATCHES))
    out["losses"] = [float(x["lm loss"]) for x in losses]
    out["grads"] = _tiny.full_named(model, "grad")
    return out


@pytest.fixture(scope="module")
def reference() -> dict:
    return run_distributed(_run, 1, args=(1, 1, None), timeout=60)[0]


def test_tp2_logits_and_grads_equal_tp1(reference: dict) -> None:
    results = run_distributed(_run, 2, args=(2, 1, reference["params"]), timeout=90)
    for res in results:  # both TP ranks hold the full gathered tensors
        torch.testing.assert_close(res["logits"], reference["logits"], atol=TP_ATOL, rtol=TP_RTOL)
        assert res["losses"] == pytest.approx(reference["losses"], abs=TP_ATOL)
        assert res["grads"].keys() == reference["grads"].keys()
        for name, grad in res["grads"].items():
            torch.testing.assert_close(
                grad, reference["grads"][name], atol=TP_ATOL, rtol=TP_RTOL, msg=name
            )


def test_pp2_loss_and_grads_equal_pp1(reference: dict) -> None:
    first, last = run_distributed(_run, 2, args=(1, 2, reference["params"]), timeout=90)
    # Only the last stage computes the loss; the first stage returns no loss values.
    assert first["losses"] == []
    assert last["losses"] == reference["losses"]
    grads = {**first["grads"], **last["grads"]}
    assert grads.keys() == reference["grads"].keys()
    assert not first["grads"].keys() & last["grads"].keys()
    for name, grad in grads.items():
        # PP only moves whole layers between processes: same ops, same order, so bit-identical.
        assert torch.equal(grad, reference["grads"][name]), name
