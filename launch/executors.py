"""Executor factories: local (torchrun, N processes) and Slurm (pyxis container, tunnel).

Both return NeMo-Run executors that start one torchrun per node; :mod:`launch.experiments`
gives them a :func:`train_script`. A job whose last nodes run rollout workers (separate
placement, ``rollout_nodes``) runs :func:`split_script` instead, on :func:`role_executor`:
one ``slurm/role.sh`` task per node, the same role dispatch as ``ROLLOUT_NODES`` in
``slurm/``. ``nemo_run`` is imported lazily so this module imports
without the ``nemo-run`` extra (the factories then raise with the install command).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

INSTALL_HINT = 'pip install -e ".[nemo-run]"  (pins nemo-run==0.11.1 and leptonai==0.27.3)'
"""How to get NeMo-Run; the newest leptonai breaks ``import nemo_run`` 0.11.1."""

DEFAULT_ENV: dict[str, str] = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    "CUDA_DEVICE_MAX_CONNECTIONS": "1",
    "PYTHONUNBUFFERED": "1",
}
"""Environment of every task on GPU nodes (the same as ``slurm/common.sh`` sets)."""


def import_nemo_run() -> Any:
    """``nemo_run``, or ImportError saying how to install it."""
    try:
        import nemo_run
    except ImportError as exc:
        raise ImportError(f"NeMo-Run is not importable ({exc}): {INSTALL_HINT}") from exc
    return nemo_run


def train_script(config: str, overrides: Sequence[str] = (), env: Mapping[str, str] = ()) -> Any:
    """A NeMo-Run ``Script`` running ``python -m reco_megatron.train config overrides...``.

    ``entrypoint="python"`` with ``m=True``: under the torchrun launcher this becomes
    ``torchrun ... -m reco_megatron.train ...`` (without it NeMo-Run would run it with bash).
    """
    run = import_nemo_run()
    return run.Script(
        path="reco_megatron.train",
        args=[config, *overrides],
        entrypoint="python",
        m=True,
        env=dict(env),
    )


WORKER_CONNECT_TIMEOUT_S = 1800
"""How long a rollout worker waits for the trainer's address (``ROLLOUT_CONNECT_TIMEOUT``'s
default in ``slurm/common.sh``): the trainer loads its model first."""


def split_script(
    config: str,
    overrides: Sequence[str],
    split: Any,
    *,
    output_dir: str,
    nproc_per_node: int,
    rdzv_port: int = 29500,
) -> Any:
    """A NeMo-Run ``Script`` running ``bash slurm/role.sh`` on every node of a split job.

    ``split`` is the :class:`reco_megatron.launch_check.RolloutSplit` that
    ``launch_check.check_split`` returned for this config and these overrides. The training
    nodes run torchrun over ``split.train_nodes`` nodes (rendezvous on the job's head node,
    ``$head_node_ip`` of NeMo-Run's sbatch script) with ``split.overrides()`` before
    ``overrides`` (``trainer.output_dir=output_dir`` among them); the rollout nodes start their
    workers on ``output_dir/rollout/address.json``. Run it on :func:`role_executor`.
    """
    run = import_nemo_run()
    args = [
        *("--train-nodes", str(split.train_nodes), "--workers", str(split.num_workers)),
        *("--workers-per-node", str(split.workers_per_node)),
        *("--gpus-per-worker", str(split.gpus_per_worker)),
        *("--worker", "python", "-m", "reco_megatron.rollout_worker"),
        *("--address", f"{output_dir}/rollout/address.json"),
        *("--connect-timeout", str(WORKER_CONNECT_TIMEOUT_S)),
        *("--trainer", "python", "-m", "torch.distributed.run"),
        *("--nnodes", str(split.train_nodes), "--nproc-per-node", str(nproc_per_node)),
        *("--rdzv-backend", "c10d", "--rdzv-endpoint", f"$head_node_ip:{rdzv_port}"),
        *("--rdzv-id", "$SLURM_JOB_ID", "--max-restarts", "0"),
        *("-m", "reco_megatron.train", config, *split.overrides(), *overrides),
    ]
    return run.Script(path="slurm/role.sh", args=args, entrypoint="bash")


def role_executor(executor: Any) -> Any:
    """A clone of a :func:`slurm_executor` for :func:`split_script`: one task per node and no
    launcher (``role.sh`` starts torchrun on the training nodes itself)."""
    clone = executor.clone()
    clone.launcher = None
    clone.ntasks_per_node = 1
    return clone


def local_executor(
    nproc_per_node: int = 1, *, env: Mapping[str, str] | None = None, gpus: bool = False
) -> Any:
    """A ``LocalExecutor`` starting ``nproc_per_node`` processes with torchrun on this machine.

    ``gpus=False`` (the CPU debug path) leaves the CUDA variables out; the trainer then uses
    gloo. The directory of the running interpreter goes first on ``PATH`` so the ``torchrun``
    of this virtual environment is found.
    """
    run = import_nemo_run()
    if nproc_per_node < 1:
        raise ValueError(f"nproc_per_node must be >= 1, got {nproc_per_node}")
    base = dict(DEFAULT_ENV) if gpus else {"PYTHONUNBUFFERED": "1"}
    path = os.environ.get("PATH", "")
    base["PATH"] = os.pathsep.join(p for p in (os.path.dirname(sys.executable), path) if p)
    return run.LocalExecutor(
        ntasks_per_node=nproc_per_node,
        launcher="torchrun",
        env_vars={**base, **(env or {})},
    )


def slurm_executor(
    *,
    account: str,
    partition: str | None = None,
    nodes: int = 1,
    gpus_per_node: int = 8,
    container_image: str | None = "nvcr.io#nvidia/pytorch:25.04-py3",
    container_mounts: Sequence[str] = (),
    time: str = "04:00:00",
    job_dir: str = "",
    ssh_host: str | None = None,
    ssh_user: str | None = None,
    cpus_per_task: int | None = None,
    exclusive: bool = True,
    signal: str | None = "B:USR1@180",
    env: Mapping[str, str] | None = None,
    packager: str = "git",
) -> Any:
    """A ``SlurmExecutor``: ``nodes`` x ``gpus_per_node`` processes, one torchrun per node.

    ``ssh_host`` set: submit through an SSH tunnel to that login node (``job_dir`` is a path
    there); unset: a ``LocalTunnel`` (run from a login node). ``exclusive=False`` gives no
    ``--exclusive`` line (NeMo-Run would otherwise render ``--exclusive=False``). The code is
    shipped by ``packager="git"`` (NeMo-Run's ``GitArchivePackager``: the committed tree of this
    repository lands in the job's working directory, ``/nemo_run/code``, where
    ``python -m reco_megatron.train`` and ``examples/`` resolve); ``"none"`` when the container
    already has reco-megatron installed (pass absolute config paths then).
    """
    run = import_nemo_run()
    if packager not in ("git", "none"):
        raise ValueError(f"packager must be 'git' or 'none', got {packager!r}")
    if nodes < 1 or gpus_per_node < 1:
        raise ValueError(f"nodes={nodes} and gpus_per_node={gpus_per_node} must be >= 1")
    if ssh_host:
        tunnel = run.SSHTunnel(host=ssh_host, user=ssh_user or "", job_dir=job_dir)
    else:
        tunnel = run.LocalTunnel(job_dir=job_dir)
    return run.SlurmExecutor(
        account=account,
        partition=partition,
        nodes=nodes,
        ntasks_per_node=gpus_per_node,
        gpus_per_node=gpus_per_node,
        cpus_per_task=cpus_per_task,
        time=time,
        exclusive=True if exclusive else None,
        signal=signal,
        container_image=container_image,
        container_mounts=list(container_mounts),
        env_vars={**DEFAULT_ENV, **(env or {})},
        tunnel=tunnel,
        packager=run.GitArchivePackager() if packager == "git" else run.Packager(),
        job_name_prefix="reco-",
        launcher="torchrun",
    )
