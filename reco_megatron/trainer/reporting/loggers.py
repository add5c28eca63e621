"""Experiment trackers next to ``metrics.jsonl``: TensorBoard, Weights & Biases, MLflow.

``trainer.loggers: [tensorboard, wandb, mlflow]`` (any subset) chooses them; each gets every
numeric column of every step's row, on rank 0. None is needed to train: ``metrics.jsonl`` is
always written. The packages are optional (``pip install -e ".[loggers]"`` for W&B and
MLflow; TensorBoard ships with ``tensorboard``); a listed one that is not installed is a
configuration error before anything starts (``trainer/config.py``).

Offline by default where no server is configured, so that a run on a cluster node without
network neither hangs nor fails:

- W&B runs ``online`` when ``WANDB_API_KEY`` is set (or ``WANDB_MODE`` says so), else
  ``offline``: the run is written under ``<output_dir>/wandb/`` (``wandb sync`` uploads it).
- MLflow logs to ``MLFLOW_TRACKING_URI`` when set, else to the file store
  ``<output_dir>/mlruns`` (no server or database needed; MLflow 3 keeps that store in
  maintenance mode, so the logger sets ``MLFLOW_ALLOW_FILE_STORE=true`` for it;
  ``mlflow ui --backend-store-uri <output_dir>/mlruns`` reads it).
  Metric names are MLflow-safe (``pass@4`` -> ``pass_at_4``).
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from reco_megatron.trainer.sections import INSTALL
from reco_megatron.utils.logging import get_logger

logger = get_logger(__name__)


def _numbers(row: Mapping[str, Any]) -> dict[str, float]:
    return {
        k: float(v)
        for k, v in row.items()
        if k != "step"
        and isinstance(v, int | float)
        and not isinstance(v, bool)
        and math.isfinite(v)
    }


def _flat(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, Mapping):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


class TensorBoardLogger:
    """``<output_dir>/tensorboard`` event files (torch's SummaryWriter)."""

    def __init__(self, out: Path, **_: Any) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(str(out / "tensorboard"))

    def log(self, row: Mapping[str, Any], step: int) -> None:
        for key, value in _numbers(row).items():
            self._writer.add_scalar(key, value, step)

    def close(self) -> None:
        self._writer.close()


class WandbLogger:
    """A W&B run in ``<output_dir>/wandb`` (offline unless an API key or WANDB_MODE says)."""

    def __init__(self, out: Path, *, project: str, name: str, config: Mapping[str, Any]) -> None:
        import wandb

        mode = os.environ.get("WANDB_MODE") or (
            "online" if os.environ.get("WANDB_API_KEY") else "offline"
        )
        self._run = wandb.init(
            project=project,
            name=name,
            dir=str(out),
            config=dict(config),
            mode=mode,
            resume="allow",
            id=re.sub(r"[^A-Za-z0-9_-]", "-", f"{name}-{abs(hash(str(out))) % 10**8}"),
        )
        where = f"{out}/wandb (upload: wandb sync {out}/wandb/offline-run-*)"
        logger.info("W&B %s run: %s", mode, where if mode == "offline" else self._run.url)

    def log(self, row: Mapping[str, Any], step: int) -> None:
        self._run.log(_numbers(row), step=step)

    def close(self) -> None:
        self._run.finish()


def mlflow_name(key: str) -> str:
    """A metric name MLflow accepts (letters, digits, ``_ - . / space``)."""
    return re.sub(r"[^A-Za-z0-9_\-./ ]", "_", key.replace("@", "_at_"))


class MlflowLogger:
    """An MLflow run (``MLFLOW_TRACKING_URI``, else the file store ``<output_dir>/mlruns``)."""

    def __init__(self, out: Path, *, project: str, name: str, config: Mapping[str, Any]) -> None:
        import mlflow

        self._mlflow = mlflow
        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:  # the file store: no server, no database package; MLflow 3 asks to opt in
            uri = (out / "mlruns").absolute().as_uri()
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        mlflow.set_tracking_uri(uri)
        mlflow.set_experiment(project)
        self._run = mlflow.start_run(run_name=name)
        params = {k: str(v)[:500] for k, v in _flat(config).items()}
        mlflow.log_params(params)
        logger.info("MLflow run %s in %s", self._run.info.run_id, uri)

    def log(self, row: Mapping[str, Any], step: int) -> None:
        metrics = {mlflow_name(k): v for k, v in _numbers(row).items()}
        self._mlflow.log_metrics(metrics, step=step)

    def close(self) -> None:
        self._mlflow.end_run()


class Tracker(Protocol):
    """What :class:`~reco_megatron.trainer.reporting.metrics_writer.MetricsWriter` needs of a
    logger."""

    def log(self, row: Mapping[str, Any], step: int) -> None:
        """Send one ``metrics.jsonl`` row (its numbers) at ``step``."""
        ...

    def close(self) -> None:
        """Flush and release the tracker."""
        ...


_CLASSES = {"tensorboard": TensorBoardLogger, "wandb": WandbLogger, "mlflow": MlflowLogger}


def build_loggers(
    names: Sequence[str], out: Path, *, project: str, config: Mapping[str, Any]
) -> list[Tracker]:
    """One logger per name (duplicates once); a logger whose package went missing since the
    config was checked is skipped with a line, never stops the run."""
    built: list[Tracker] = []
    for name in dict.fromkeys(names):
        try:
            built.append(_CLASSES[name](out, project=project, name=out.name, config=config))
        except ImportError as exc:
            logger.warning("%s logger off: %s (%s)", name, exc, INSTALL[name])
    return built
