"""The parallel layout (TP, PP, CP, DP, EP, virtual pipeline, sequence parallel) and its start-up.

:class:`ParallelConfig` is the block users edit to scale: moving from an 8B to a 70B model
changes it and the model block only. :func:`initialize_parallel` reads the torchrun
environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT``),
initialises ``torch.distributed`` (nccl on GPU, gloo on CPU, where it also enables the CPU
backend of megatron-core), validates the layout against the world size and the model, and
initialises megatron's ``parallel_state``.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from datetime import timedelta
from typing import Literal

import torch
import torch.distributed as dist

from reco_megatron.parallel.layout import RankLayout
from reco_megatron.utils.logging import get_logger

logger = get_logger(__name__)


@dataclass(kw_only=True)
class ParallelConfig:
    """How the model and the batch are split over ranks; DP is what is left of the world."""

    tensor_model_parallel_size: int = 1
    """TP: ranks one layer (and the vocabulary) is split over; keep within a node (NVLink)."""
    pipeline_model_parallel_size: int = 1
    """PP: pipeline stages the layers are split over."""
    virtual_pipeline_model_parallel_size: int | None = None
    """Interleaved pipeline: model chunks per stage (needs PP > 1); None disables."""
    context_parallel_size: int = 1
    """CP: ranks one sequence is split over (long contexts; GPU/transformer-engine only)."""
    sequence_parallel: bool = False
    """Shard the activations outside the tensor-parallel matmuls (norms, residuals, dropout)
    over the sequence across the TP group: ~(TP-1)/TP less of that activation memory, the same
    arithmetic (needs TP > 1; the sequence is padded to a multiple of TP)."""
    expert_model_parallel_size: int = 1
    """EP (mixture-of-experts models): ranks the experts of a layer are split over. Carved out
    of the data-parallel ranks (and TP x CP), as in megatron-core: EP x expert-TP must divide
    TP x CP x DP; tokens travel to their experts' ranks through the token dispatcher."""
    expert_tensor_parallel_size: int | None = None
    """Expert TP: ranks one expert is split over; None = the TP size (megatron's default),
    1 keeps experts whole (usual with EP)."""
    moe_token_dispatcher: Literal["alltoall", "allgather"] = "alltoall"
    """How tokens reach their experts across EP ranks: ``alltoall`` (sends each token only
    where it is routed; megatron's choice at scale) or ``allgather`` (every rank sees every
    token). Both run over NCCL on GPU and gloo on CPU."""
    micro_batch_size: int = 1
    """Sequences per micro-batch on one data-parallel rank."""
    distributed_timeout_minutes: int = 30
    """Timeout of collectives before a hung job fails."""

    def __post_init__(self) -> None:
        for name in (
            "tensor_model_parallel_size",
            "pipeline_model_parallel_size",
            "context_parallel_size",
            "expert_model_parallel_size",
            "micro_batch_size",
            "distributed_timeout_minutes",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"parallel.{name} must be a positive integer, got {value!r}")
        etp = self.expert_tensor_parallel_size
        if etp is not None and (isinstance(etp, bool) or not isinstance(etp, int) or etp < 1):
            raise ValueError(
                f"parallel.expert_tensor_parallel_size must be a positive integer or null (= "
                f"TP), got {etp!r}"
            )
        if self.moe_token_dispatcher not in ("alltoall", "allgather"):
            raise ValueError(
                "parallel.moe_token_dispatcher must be 'alltoall' or 'allgather', got "
                f"{self.moe_token_dispatcher!r}"
            )
        vp = self.virtual_pipeline_model_parallel_size
        if vp is not None and (vp < 1 or self.pipeline_model_parallel_size == 1):
            raise ValueError(
                f"parallel.virtual_pipeline_model_parallel_size={vp} needs "
                "pipeline_model_parallel_size > 1 and a value >= 1; set it to null otherwise"
            )
        if self.sequence_parallel and self.tensor_model_parallel_size == 1:
            raise ValueError(
                "parallel.sequence_parallel=true needs tensor_model_parallel_size > 1 "
                "(it shards activations over the TP group); set it to false"
            )

    @property
    def model_parallel_size(self) -> int:
        """Ranks holding one replica of the model: TP x PP x CP."""
        return (
            self.tensor_model_parallel_size
            * self.pipeline_model_parallel_size
            * self.context_parallel_size
        )

    def expert_tensor_size(self) -> int:
        """Expert TP: ``expert_tensor_parallel_size``, or TP when it is null."""
        etp = self.expert_tensor_parallel_size
        return self.tensor_model_parallel_size if etp is None else etp

    def data_parallel_size(self, world_size: int) -> int:
        """DP for ``world_size`` ranks; raises with the fix when the layout does not fit."""
        if world_size % self.model_parallel_size:
            raise ValueError(
                f"world size {world_size} is not divisible by TP x PP x CP = "
                f"{self.tensor_model_parallel_size} x {self.pipeline_model_parallel_size} x "
                f"{self.context_parallel_size} = {self.model_parallel_size}: change the number "
                "of processes (nodes x GPUs per node) or the parallel block"
            )
        dp = world_size // self.model_parallel_size
        ep, etp = self.expert_model_parallel_size, self.expert_tensor_size()
        attention = self.tensor_model_parallel_size * self.context_parallel_size * dp
        if attention % (ep * etp):
            raise ValueError(
                f"EP x expert-TP = {ep} x {etp} does not divide TP x CP x DP = "
                f"{self.tensor_model_parallel_size} x {self.context_parallel_size} x {dp} = "
                f"{attention} (the ranks of one pipeline stage): experts are spread over the "
                "ranks of a stage, so choose EP (and expert TP) dividing it, or change the "
                "number of processes"
            )
        return dp

    def validate_for_model(self, model: object, num_layers: int, on_gpu: bool) -> None:
        """Checks that need the model: heads and kv-heads over TP, layers over PP, CPU limits."""
        check = getattr(model, "check_tensor_parallel", None)
        if check is not None:
            check(self.tensor_model_parallel_size)
        moe = getattr(model, "moe", None)
        if moe is None and self.expert_model_parallel_size > 1:
            raise ValueError(
                f"parallel.expert_model_parallel_size={self.expert_model_parallel_size} needs a "
                "mixture-of-experts model (model.moe); set it to 1 for a dense model"
            )
        if moe is not None:
            moe.check_expert_parallel(self.expert_model_parallel_size, self.expert_tensor_size())
            if self.tensor_model_parallel_size > 1 and not self.sequence_parallel:
                raise ValueError(
                    f"a mixture-of-experts model at tensor_model_parallel_size="
                    f"{self.tensor_model_parallel_size} needs parallel.sequence_parallel=true "
                    "(megatron-core's MoE layer refuses to train TP > 1 without it)"
                )
        chunks = self.pipeline_model_parallel_size * (
            self.virtual_pipeline_model_parallel_size or 1
        )
        if num_layers % chunks:
            raise ValueError(
                f"num_layers={num_layers} is not divisible by PP x VP = {chunks}: choose a "
                "pipeline size (and virtual pipeline size) that divides the layer count"
            )
        if not on_gpu and self.context_parallel_size > 1:
            raise ValueError(
                f"parallel.context_parallel_size={self.context_parallel_size} needs "
                "transformer-engine attention on GPU; set it to 1 for CPU runs"
            )


def initialize_parallel(cfg: ParallelConfig, seed: int) -> str:
    """Start ``torch.distributed`` from the torchrun environment and megatron's groups.

    Without torchrun variables a single process (world size 1) is started, so
    ``python -m reco_megatron.train`` works as is. Returns the backend (``nccl``/``gloo``).
    Idempotent for an already initialised process group (tests start their own).
    """
    from megatron.core import parallel_state

    from reco_megatron.megatron.compat import versions as compat
    from reco_megatron.megatron.compat.cpu_backend import enable_cpu_backend, model_parallel_seed

    on_gpu = torch.cuda.is_available()
    backend = "nccl" if on_gpu else "gloo"
    if not dist.is_initialized():
        rank = int(os.environ.get("RANK", "0"))
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        init_method = None  # torchrun's environment (MASTER_ADDR / MASTER_PORT)
        if "MASTER_PORT" not in os.environ:
            if world_size > 1:
                raise RuntimeError(
                    f"WORLD_SIZE={world_size} but MASTER_PORT is not set: start the job with "
                    "torchrun (or set MASTER_ADDR/MASTER_PORT for every rank)"
                )
            # A plain single-process run: a file store in a private temporary directory
            # (mode 0700), not a TCP store, which listens on every interface and lets anyone
            # write its keys. Nothing goes into os.environ, where processes started later (a
            # trainer launched from a script, a test) would inherit it.
            init_method = f"file://{tempfile.mkdtemp(prefix='reco-world-')}/store"
        if on_gpu:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(
            backend,
            init_method=init_method,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(minutes=cfg.distributed_timeout_minutes),
        )
    else:
        backend = dist.get_backend()
    world_size = dist.get_world_size()
    dp = cfg.data_parallel_size(world_size)
    if not on_gpu:
        enable_cpu_backend()
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    compat.initialize_model_parallel(
        tensor_model_parallel_size=cfg.tensor_model_parallel_size,
        pipeline_model_parallel_size=cfg.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=cfg.virtual_pipeline_model_parallel_size,
        context_parallel_size=cfg.context_parallel_size,
        expert_model_parallel_size=cfg.expert_model_parallel_size,
        expert_tensor_parallel_size=cfg.expert_tensor_size(),
    )
    model_parallel_seed(seed)
    logger.info(
        "parallel: world %d = TP %d x PP %d x CP %d x DP %d%s (%s)",
        world_size,
        cfg.tensor_model_parallel_size,
        cfg.pipeline_model_parallel_size,
        cfg.context_parallel_size,
        dp,
        f", EP {cfg.expert_model_parallel_size} x expert-TP {cfg.expert_tensor_size()}"
        if cfg.expert_model_parallel_size > 1
        else "",
        backend,
    )
    return backend


def rank_layout() -> RankLayout:
    """This process's :class:`RankLayout` (after :func:`initialize_parallel`)."""
    from megatron.core import parallel_state as ps

    return RankLayout(
        rank=dist.get_rank(),
        tp_rank=ps.get_tensor_model_parallel_rank(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        pp_size=ps.get_pipeline_model_parallel_world_size(),
        dp_rank=ps.get_data_parallel_rank(),
        dp_size=ps.get_data_parallel_world_size(),
        dp_group=ps.get_data_parallel_group(),
        mp_group=ps.get_model_parallel_group(),
        pp_group=ps.get_pipeline_model_parallel_group(),
    )
