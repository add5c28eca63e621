"""The CPU backend itself: patch record, no-op with CUDA, forward/backward, dropout, rejections."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from reco_megatron.testing.multiprocess import run_distributed
from tests.megatron import _tiny

pytestmark = pytest.mark.dist

DOC = Path(__file__).resolve().parents[2] / "docs" / "cpu-backend.md"


def _forward_backward(rank: int, world_size: int) -> dict:
    from reco_megatron.megatron.compat.cpu_backend import applied_patches, enable_cpu_backend

    _tiny.init_parallel()
    first = applied_patches()
    assert enable_cpu_backend() is True  # second call: same answer, nothing re-applied
    model = _tiny.build_tiny_gpt(_tiny.tiny_config())
    losses = _tiny.run_forward_backward(model, _tiny.split_batch(_tiny.tiny_batch(4), 2))
    grads = [p.grad for p in model.parameters()]
    return {
        "patches": [(p.target, p.reason) for p in first],
        "after": [(p.target, p.reason) for p in applied_patches()],
        "loss": float(torch.stack([x["lm loss"] for x in losses]).mean()),
        "grads_finite": all(g is not None and bool(torch.isfinite(g).all()) for g in grads),
        "grads_nonzero": sum(int(g.abs().sum() > 0) for g in grads),
        "n_params": len(grads),
    }


def test_forward_backward_and_patch_record() -> None:
    res = run_distributed(_forward_backward, 1, timeout=60)[0]
    assert res["patches"], "enable_cpu_backend recorded no patch"
    assert res["after"] == res["patches"], "a second enable_cpu_backend() re-applied patches"
    # Untrained model on a 128-token vocabulary: loss near ln(128) = 4.85.
    assert abs(res["loss"] - 4.85) < 0.3
    assert res["grads_finite"] and res["grads_nonzero"] == res["n_params"]
    documented = set(re.findall(r"^\| `([^`]+)` \|", DOC.read_text(), flags=re.M))
    missing = {target for target, _ in res["patches"]} - documented
    assert not missing, f"patches missing from docs/cpu-backend.md: {sorted(missing)}"


def _with_cuda_claimed(rank: int, world_size: int) -> dict:
    import megatron.core.utils as mutils

    from reco_megatron.megatron.compat import cpu_backend

    torch.cuda.is_available = lambda: True  # this rank only; the process is discarded
    enabled = cpu_backend.enable_cpu_backend()
    return {
        "enabled": enabled,
        "patches": len(cpu_backend.applied_patches()),
        "torch_untouched": mutils.torch is torch,
    }


def test_noop_when_cuda_available() -> None:
    res = run_distributed(_with_cuda_claimed, 1, timeout=60)[0]
    assert res == {"enabled": False, "patches": 0, "torch_untouched": True}


def _dropout(rank: int, world_size: int, seed: int) -> dict:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    from reco_megatron.megatron.compat.cpu_backend import CpuRNGStatesTracker, model_parallel_seed

    _tiny.init_parallel(seed=seed)
    model = _tiny.build_tiny_gpt(_tiny.tiny_config(dropout=0.3))
    model_parallel_seed(seed)  # after building: the model's init drew from the CPU generator
    batch = _tiny.tiny_batch(2)
    tracker = get_cuda_rng_tracker()
    before = tracker.get_states()["model-parallel-rng"].clone()
    outs = [model(batch["tokens"], batch["position_ids"], None).detach() for _ in range(2)]
    model.eval()
    return {
        "tracker": type(tracker) is CpuRNGStatesTracker,
        "forked": not torch.equal(before, tracker.get_states()["model-parallel-rng"]),
        "outs": outs,
        "eval": model(batch["tokens"], batch["position_ids"], None).detach(),
    }


def test_dropout_uses_cpu_tracker_and_is_reproducible() -> None:
    a = run_distributed(_dropout, 1, args=(11,), timeout=60)[0]
    b = run_distributed(_dropout, 1, args=(11,), timeout=60)[0]
    c = run_distributed(_dropout, 1, args=(12,), timeout=60)[0]
    assert a["tracker"] and a["forked"], "attention dropout did not draw from the CPU tracker"
    assert not torch.equal(a["outs"][0], a["outs"][1]), "two train forwards drew the same mask"
    assert not torch.equal(a["outs"][0], a["eval"]), "dropout inactive in train mode"
    for x, y in zip(a["outs"], b["outs"], strict=True):
        assert torch.equal(x, y), "same seed, different dropout masks"
    assert not torch.equal(a["outs"][0], c["outs"][0]), "the seed does not reach dropout"
