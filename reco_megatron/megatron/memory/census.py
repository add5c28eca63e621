"""What one rank of a layout allocates for its model state, measured on the meta device.

:func:`measure_rank_state` builds one rank of a parallel layout (an 8B at TP 2 x DP 4, a 70B
at TP 8 x PP 4 x DP 2, ...) in this one process, with megatron-core's own code and nothing
allocated: the rank's model chunks (megatron's ``GPTModel`` per pipeline stage and virtual
chunk, on the meta device), megatron's ``DistributedDataParallel`` (its gradient buffers and,
with the distributed optimizer, its parameter buffers) and megatron's optimizer (the
distributed optimizer's fp32 main-parameter shards and Adam's moments, created as the first
step would). What the CPU backend would put on CUDA goes to the meta device
(``compat.cpu_patches.allocations_on_meta``), and the process pretends to be that rank of a
world of TP x PP x CP x DP ranks through torch's ``fake`` process-group backend (collectives
are no-ops, group sizes and ranks are real). The counts are exact: sharding, vocabulary
padding, the embedding on the first stage and the output layer on the last, replicated norms,
gradient-buffer padding and the optimizer's DP sharding are megatron's.

This is what ``megatron/memory/estimate.py``'s estimate is checked against
(``tests/trainer/test_memory_census.py``;
``python -m reco_megatron.trainer.memory.budget --measure``).

Run it in a process with no process group yet (it starts and destroys its own); the CPU
backend is enabled as in a CPU run. Activation memory is not measured here.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from reco_megatron.megatron.distributed import ParallelConfig
from reco_megatron.megatron.model.config import ModelConfig
from reco_megatron.megatron.model.optimizer import OptimConfig


@dataclass(frozen=True)
class RankState:
    """Bytes of one rank's resident model state, as megatron-core allocates them."""

    pipeline_stage: int
    parameters: int
    """Parameter elements on this rank (its TP shard of its stage's layers and embeddings)."""
    weights: int
    """Bytes of the parameters in their dtype."""
    grads: int
    """Bytes of DDP's gradient buffers (fp32: ``grad_reduce_in_fp32``, padding included)."""
    optimizer: int
    """Bytes of the optimizer state: fp32 main parameters (when the model is bf16/fp16) and
    Adam's two moments, this rank's shard with the distributed optimizer."""


@contextmanager
def _fake_rank(rank: int, world_size: int) -> Iterator[None]:
    """This process as ``rank`` of ``world_size`` (torch's ``fake`` backend). Every group
    megatron creates is a fake group, including the ones it asks gloo for."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("measure_rank_state needs a process without a process group")
    new_group = dist.new_group

    def fake_group(*args: Any, backend: Any = None, **kwargs: Any) -> Any:
        return new_group(*args, **kwargs)

    dist.new_group = fake_group
    dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())
    try:
        yield
    finally:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
        dist.new_group = new_group


def _optimizer_tensors(optimizer: Any, fp32_model: bool) -> Iterator[torch.Tensor]:
    """The tensors the optimizer allocates: Adam's moments (created as the first step would)
    and, for a bf16/fp16 model, the fp32 main parameters (for an fp32 model they are the
    model's own parameters, or views of them: no new memory)."""
    from reco_megatron.megatron.checkpoint.megatron_state import (
        _inner_optimizers,
        init_optimizer_state,
    )

    init_optimizer_state(optimizer)
    for opt in _inner_optimizers(optimizer):
        inner = opt.optimizer
        for group in inner.param_groups:
            for param in group["params"]:
                if not fp32_model:
                    yield param
                for value in inner.state.get(param, {}).values():
                    if torch.is_tensor(value) and value.dim() > 0:
                        yield value


def measure_rank_state(
    model: ModelConfig,
    parallel: ParallelConfig,
    optim: OptimConfig,
    *,
    data_parallel_size: int,
    pipeline_stage: int,
) -> RankState:
    """Build TP rank 0, DP rank 0 of ``pipeline_stage`` on the meta device; count its bytes."""
    from megatron.core import parallel_state as ps

    from reco_megatron.megatron.compat import versions as compat
    from reco_megatron.megatron.compat.cpu_backend import enable_cpu_backend
    from reco_megatron.megatron.compat.cpu_patches import allocations_on_meta
    from reco_megatron.megatron.model.build import build_model, transformer_config
    from reco_megatron.megatron.model.optimizer import build_optimizer, wrap_ddp

    tp, pp = parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size
    if not 0 <= pipeline_stage < pp:
        raise ValueError(f"pipeline_stage={pipeline_stage} is not a stage of PP {pp}")
    parallel.validate_for_model(model, model.num_layers, on_gpu=False)
    per_stage = tp * parallel.context_parallel_size * data_parallel_size
    rank = pipeline_stage * per_stage  # megatron's default order: tp-cp-ep-dp-pp
    vp = parallel.virtual_pipeline_model_parallel_size
    with _fake_rank(rank, per_stage * pp), allocations_on_meta():
        enable_cpu_backend()
        compat.initialize_model_parallel(
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            virtual_pipeline_model_parallel_size=vp,
            context_parallel_size=parallel.context_parallel_size,
        )
        assert ps.get_pipeline_model_parallel_rank() == pipeline_stage
        config = transformer_config(model, parallel, on_gpu=False)
        config.perform_initialization = False  # nothing to initialise on the meta device
        chunks = []
        with torch.device("meta"):
            for i in range(vp or 1):
                kwargs = {} if vp is None else {"vp_stage": i}
                chunks.append(
                    build_model(
                        model,
                        config,
                        pre_process=ps.is_pipeline_first_stage(ignore_virtual=vp is None, **kwargs),
                        post_process=ps.is_pipeline_last_stage(ignore_virtual=vp is None, **kwargs),
                        on_gpu=False,
                        vp_stage=None if vp is None else i,
                    )
                )
        params = [p for chunk in chunks for p in chunk.parameters()]
        ddp = wrap_ddp(chunks, config, optim)
        optimizer, _ = build_optimizer(ddp, config, optim, total_steps=1)
        grads = sum(
            b.grad_data.numel() * b.grad_data.element_size() for c in ddp for b in c.buffers
        )
        fp32 = model.params_dtype == "float32"
        state = sum(t.numel() * t.element_size() for t in _optimizer_tensors(optimizer, fp32))
        return RankState(
            pipeline_stage=pipeline_stage,
            parameters=sum(p.numel() for p in params),
            weights=sum(p.numel() * p.element_size() for p in params),
            grads=grads,
            optimizer=state,
        )
