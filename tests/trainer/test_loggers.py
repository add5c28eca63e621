"""Optional trackers next to TensorBoard: W&B and MLflow, offline, writing their files on CPU
(skipped with the reason where the package is absent); a listed tracker that is not
installed is a configuration error before anything starts."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from reco_megatron.config import ConfigError, load_config
from reco_megatron.trainer.config import TrainConfig
from reco_megatron.trainer.reporting import MetricsWriter, loggers

ROWS = [{"step": s, "reward_mean": 0.1 * s, "pass@4": 0.5, "note": "x"} for s in (1, 2, 3)]


def _write(tmp_path: Path, names: list[str]) -> Path:
    out = tmp_path / "run"
    out.mkdir()
    writer = MetricsWriter(
        out,
        3,
        progress=False,
        loggers=names,
        project="reco-test",
        run_config={"loss": {"objective": "reco"}, "trainer": {"max_steps": 3}},
    )
    for row in ROWS:
        writer.write(row)
    writer.close()
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 3
    return out


def test_wandb_offline_writes_its_run(tmp_path: Path, monkeypatch) -> None:
    pytest.importorskip("wandb", reason='W&B not installed (pip install -e ".[loggers]")')
    for var in ("WANDB_MODE", "WANDB_API_KEY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = _write(tmp_path, ["wandb"])
    (run,) = (out / "wandb").glob("offline-run-*")
    (data,) = run.glob("run-*.wandb")
    assert data.stat().st_size > 0


def test_mlflow_file_store_holds_the_metrics(tmp_path: Path, monkeypatch) -> None:
    pytest.importorskip("mlflow", reason='MLflow not installed (pip install -e ".[loggers]")')
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    out = _write(tmp_path, ["mlflow"])
    (metric,) = (out / "mlruns").glob("*/*/metrics/pass_at_4")
    assert [line.split()[1:] for line in metric.read_text().splitlines()] == [
        ["0.5", "1"],
        ["0.5", "2"],
        ["0.5", "3"],
    ]
    (param,) = (out / "mlruns").glob("*/*/params/loss.objective")
    assert param.read_text() == "reco"


def test_mlflow_names() -> None:
    assert loggers.mlflow_name("pass@16") == "pass_at_16"
    assert loggers.mlflow_name("time_train") == "time_train"


def test_a_listed_tracker_that_is_missing_is_a_config_error(monkeypatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a)
    )
    with pytest.raises(ConfigError) as info:
        load_config(TrainConfig, None, ["trainer.loggers=[tensorboard, wandb]"])
    assert "trainer: loggers=['tensorboard', 'wandb'] but not installed: wandb: pip install" in str(
        info.value
    )
    cfg = load_config(TrainConfig, None, ["trainer.loggers=[]"])
    assert cfg.trainer.loggers == []


def test_no_tracker_still_writes_metrics(tmp_path: Path) -> None:
    out = _write(tmp_path, [])
    assert json.loads((out / "metrics.jsonl").read_text().splitlines()[0])["step"] == 1


def test_the_default_tracker_list_writes_with_or_without_tensorboard(tmp_path: Path) -> None:
    """The default ``trainer.loggers`` ([tensorboard]): the writer starts and writes whether
    tensorboard is installed or not (absent: a note, and ``metrics.jsonl`` alone). The tests'
    runs pass ``trainer.loggers=[]``, so this is the one place the default path runs."""
    default = TrainConfig().trainer.loggers
    assert default == ["tensorboard"]
    out = _write(tmp_path, default)
    assert json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])["step"] == 3
