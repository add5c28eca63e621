"""Training checkpoints: one room for save, load, integrity, resume, RNG states and megatron-core's
dist_checkpointing across versions.

``format`` (layout, errors, plain-JSON reads) <- ``safe_pickle`` (restricted unpickling) <-
``integrity`` / ``rng`` / ``megatron_state`` / ``collective`` <- ``save`` <- ``load`` <-
``resume``. Callers import from this package.
"""

from reco_megatron.megatron.checkpoint.format import (
    FORMAT_VERSION,
    PREFIX,
    CheckpointError,
    CheckpointSpaceError,
    DamagedCheckpointError,
    LatestPointerError,
    UnsafeCheckpointError,
    checkpoint_name,
    complete_checkpoints,
    latest_checkpoint,
    read_meta,
    sft_checkpoint_name,
)
from reco_megatron.megatron.checkpoint.load import (
    check_compatible,
    load_checkpoint,
    verify_checkpoint,
)
from reco_megatron.megatron.checkpoint.resume import remove_partial_checkpoints, resume_latest
from reco_megatron.megatron.checkpoint.save import save_checkpoint

__all__ = [
    "FORMAT_VERSION",
    "PREFIX",
    "CheckpointError",
    "CheckpointSpaceError",
    "DamagedCheckpointError",
    "LatestPointerError",
    "UnsafeCheckpointError",
    "check_compatible",
    "checkpoint_name",
    "complete_checkpoints",
    "latest_checkpoint",
    "load_checkpoint",
    "read_meta",
    "remove_partial_checkpoints",
    "resume_latest",
    "save_checkpoint",
    "sft_checkpoint_name",
    "verify_checkpoint",
]
