"""Where tensors live: the engine's compute device, and the device of collectives.

Two rules, decided here once instead of ``torch.cuda.is_available()`` checks scattered over
the code:

* **Compute.** :class:`reco_megatron.megatron.step.engine.ReCoEngine` owns one device,
  ``engine.device`` (:func:`compute_device` unless given): its model, optimizer state and every
  tensor of a forward pass live there. The trainer builds batches on the CPU and hands them to
  the engine as they are; the engine moves them (``RolloutBatch.to(engine.device)``, at each
  public method's entry), checks every micro-batch entering the model
  (:func:`check_on_device`), and returns CPU tensors and Python floats.
* **Collectives.** A tensor passed to ``torch.distributed`` must live where the process group's
  backend wants it: on the current CUDA device for NCCL, on the CPU for gloo.
  :func:`reco_megatron.parallel.collectives.collective_device` answers from the group's
  backend, not from whether CUDA exists (a gloo group on a GPU machine takes CPU tensors); it
  lives below the adapter, since it needs no megatron-core.
"""

from __future__ import annotations

from typing import Any

import torch


def compute_device() -> torch.device:
    """The device this process trains on: the current CUDA device when CUDA is available
    (``initialize_parallel`` sets it to ``LOCAL_RANK``), else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def resolve_device(device: torch.device | str | None) -> torch.device:
    """``device`` as a ``torch.device`` (None: :func:`compute_device`), checked usable.

    A CUDA device must be the current one: megatron-core allocates its buffers (DDP gradient
    buckets, optimizer shards, pipeline messages) on ``torch.cuda.current_device()``.
    """
    if device is None:
        return compute_device()
    dev = torch.device(device)
    if dev.type == "cpu":
        return torch.device("cpu")
    if dev.type != "cuda":
        raise ValueError(f"the engine runs on 'cpu' or 'cuda[:N]', got device {str(dev)!r}")
    if not torch.cuda.is_available():
        raise ValueError(
            f"device {str(dev)!r} was asked for but CUDA is not available in this process: "
            "check CUDA_VISIBLE_DEVICES and the torch build, or leave the device unset"
        )
    current = torch.cuda.current_device()
    if dev.index is not None and dev.index != current:
        raise ValueError(
            f"device {str(dev)!r} is not the current CUDA device (cuda:{current}): call "
            "torch.cuda.set_device first (torchrun ranks: LOCAL_RANK), or leave the device unset"
        )
    return torch.device("cuda", current)


def same_device(a: torch.device, b: torch.device) -> bool:
    """Whether two devices are the same (``cuda`` without an index is the current device)."""
    if a.type != b.type:
        return False
    if a.type != "cuda":
        return True
    current = torch.cuda.current_device()
    return (a.index if a.index is not None else current) == (
        b.index if b.index is not None else current
    )


def check_on_device(tensors: dict[str, Any], device: torch.device, where: str) -> None:
    """Raise, naming the tensor, when one of ``tensors`` (None values skipped) is not on
    ``device``: a placement bug caught where it enters, not deep inside a kernel."""
    for name, value in tensors.items():
        if isinstance(value, torch.Tensor) and not same_device(value.device, device):
            raise RuntimeError(
                f"{where}: {name} is on {value.device} but the engine computes on {device}; "
                "batches must enter the engine through ReCoEngine methods, which move them"
            )
