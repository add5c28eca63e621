"""DP=2 with megatron's DistributedDataParallel + distributed Adam on CPU, and resuming it.

One step at DP=2 (each rank half of the global batch) must give the parameters of DP=1 on the
whole batch; a dist_checkpointing save/load round trip must not change the next step; a TP=2
model checkpoint must load at TP=1.
"""

from __future__ import annotations

import pytest
import torch

from reco_megatron.testing.multiprocess import run_distributed
from tests.megatron import _tiny

pytestmark = pytest.mark.dist

GLOBAL_BATCH = 4
# DP=2 sums two half-batch gradients (reduce-scatter) where DP=1 sums one full batch: fp32
# reduction order differs by ~1e-7 relative; Adam's first step divides g by sqrt(g^2) + eps,
# which amplifies that near g ~ 0 to at most ~lr * 1e-2 (lr = 1e-3): measured max 2.5e-5.
DP_ATOL = 5e-5


def _build_trainable(tp: int = 1) -> tuple[object, object]:
    """Tiny GPT wrapped in megatron DDP with the distributed Adam optimizer."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    config = _tiny.tiny_config(tp=tp)
    config.finalize_model_grads_func = finalize_model_grads
    model = _tiny.build_tiny_gpt(config)
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=True, overlap_grad_reduce=False, grad_reduce_in_fp32=True
    )
    ddp = DistributedDataParallel(config, ddp_config, model)
    opt_config = OptimizerConfig(
        optimizer="adam",
        lr=1e-3,
        weight_decay=0.01,
        use_distributed_optimizer=True,
        params_dtype=torch.float32,
        clip_grad=1.0,
    )
    return ddp, get_megatron_optimizer(opt_config, [ddp])


def _train_step(ddp: object, optimizer: object, step: int) -> float:
    """One optimizer step on this DP rank's share of global batch number ``step``."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    batch = _tiny.split_batch(_tiny.tiny_batch(GLOBAL_BATCH, seed=100 + step), dp)[dp_rank]
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    # Same micro-batch size everywhere: DP=1 runs 2 micro-batches, DP=2 one per rank.
    losses = _tiny.run_forward_backward(ddp, _tiny.split_batch(batch, GLOBAL_BATCH // 2 // dp))
    success, _, _ = optimizer.step()
    assert success, "optimizer step skipped"
    loss = torch.stack([x["lm loss"] for x in losses]).mean()
    dist.all_reduce(loss, group=ps.get_data_parallel_group())
    return float(loss) / dp


def _steps(rank: int, world_size: int, n_steps: int, reference: dict | None) -> dict:
    _tiny.init_parallel()
    ddp, optimizer = _build_trainable()
    if reference is not None:
        _tiny.load_reference(ddp.module, reference)
    initial = _tiny.full_named(ddp.module)
    losses = [_train_step(ddp, optimizer, s) for s in range(n_steps)]
    return {"initial": initial, "losses": losses, "params": _tiny.full_named(ddp.module)}


def _resume(rank: int, world_size: int, ckpt: str, reference: dict) -> dict:
    """Step 0, save, step 1 (uninterrupted); then fresh model + optimizer, load, step 1."""
    from reco_megatron.megatron.checkpoint.megatron_state import (
        load_model_and_optimizer,
        save_model_and_optimizer,
    )

    _tiny.init_parallel()
    ddp, optimizer = _build_trainable()
    _tiny.load_reference(ddp.module, reference)
    _train_step(ddp, optimizer, 0)
    save_model_and_optimizer(ckpt, ddp.module, optimizer)
    _train_step(ddp, optimizer, 1)
    uninterrupted = _tiny.full_named(ddp.module)

    ddp2, optimizer2 = _build_trainable()  # different random init: the load must overwrite it
    load_model_and_optimizer(ckpt, ddp2.module, optimizer2)
    _train_step(ddp2, optimizer2, 1)
    return {"uninterrupted": uninterrupted, "resumed": _tiny.full_named(ddp2.module)}


@pytest.fixture(scope="module")
def dp1() -> dict:
    return run_distributed(_steps, 1, args=(1, None), timeout=60)[0]


def test_dp2_step_equals_dp1(dp1: dict) -> None:
    results = run_distributed(_steps, 2, args=(1, dp1["initial"]), timeout=90)
    for res in results:
        assert res["losses"] == pytest.approx(dp1["losses"], abs=1e-6)
        moved = 0.0
        for name, param in res["params"].items():
            torch.testing.assert_close(param, dp1["params"][name], atol=DP_ATOL, rtol=0, msg=name)
            moved = max(moved, float((param - res["initial"][name]).abs().max()))
        assert moved > 1e-4, "the optimizer step did not move the parameters"


def test_distributed_optimizer_resume_equals_uninterrupted(dp1: dict, tmp_path) -> None:
    results = run_distributed(
        _resume, 2, args=(str(tmp_path / "ckpt"), dp1["initial"]), timeout=120
    )
    for res in results:
        for name, param in res["uninterrupted"].items():
            # Same ranks, same ops, state restored bit for bit: the resumed step is exact.
            assert torch.equal(res["resumed"][name], param), name


def _save_tp(rank: int, world_size: int, ckpt: str, tp: int) -> dict:
    from reco_megatron.megatron.checkpoint.megatron_state import save_model_and_optimizer

    _tiny.init_parallel(tp=tp)
    model = _tiny.build_tiny_gpt(_tiny.tiny_config(tp=tp), seed=99)
    save_model_and_optimizer(ckpt, model)
    return _tiny.full_named(model)


def _load_tp(rank: int, world_size: int, ckpt: str, tp: int) -> dict:
    from reco_megatron.megatron.checkpoint.megatron_state import load_model_and_optimizer

    _tiny.init_parallel(tp=tp)
    model = _tiny.build_tiny_gpt(_tiny.tiny_config(tp=tp), seed=5)
    load_model_and_optimizer(ckpt, model)
    return _tiny.full_named(model)


def test_tp2_checkpoint_loads_at_tp1(tmp_path) -> None:
    ckpt = str(tmp_path / "tp2")
    saved = run_distributed(_save_tp, 2, args=(ckpt, 2), timeout=90)[0]
    loaded = run_distributed(_load_tp, 1, args=(ckpt, 1), timeout=60)[0]
    assert loaded.keys() == saved.keys()
    for name, param in saved.items():
        assert torch.equal(loaded[name], param), name
