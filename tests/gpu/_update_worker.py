"""One ReCo rollout update of the tiny engine model, in a fresh process, on one device.

``python -m tests.gpu._update_worker DEVICE INIT OUT``: DEVICE is ``cpu`` or ``cuda``; INIT
is a ``torch.save`` file of full initial weights (written by this worker on its first,
CPU, run when absent, so both devices start from the same numbers); OUT receives the
parameters after the update and the metrics of the old-policy pass and of both optimizer
steps. A fresh process per device because the CPU backend patches megatron-core for the
whole process, and a process whose CUDA is initialised cannot become a CPU-only one.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch


def main(device: str, init: Path, out: Path) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32 on both devices
    torch.backends.cudnn.allow_tf32 = False
    from tests.megatron import _reco

    engine = _reco.build_engine()
    if engine.device.type != device:
        raise SystemExit(f"asked for {device} but the engine runs on {engine.device}")
    if not init.exists():
        torch.save({k: v.cpu() for k, v in _reco.full_params(engine).items()}, init)
    _reco.load_full(engine, torch.load(init))
    prepared, prep = engine.prepare(_reco.rollout_batch())
    steps = engine.train_on_rollout(prepared)
    torch.save(
        {
            "device": str(engine.device),
            "params": {k: v.cpu() for k, v in _reco.full_params(engine).items()},
            "prep": prep,
            "steps": steps,
            "old_logprobs": prepared.old_logprobs,
            "weights": prepared.weights,
        },
        out,
    )


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]))
