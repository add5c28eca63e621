"""NeMo-Run: the Slurm executor's sbatch script, and the tiny job through torchrun locally."""

from __future__ import annotations

import glob
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from reco_megatron.algo.config import LossConfig
from reco_megatron.config import load_config
from reco_megatron.trainer.config import TrainConfig
from tests.tiny_overrides import TINY_RUN

ROOT = Path(__file__).resolve().parents[2]

try:
    import nemo_run  # noqa: F401

    HAVE_NEMO_RUN = True
except ImportError:
    HAVE_NEMO_RUN = False
needs_nemo_run = pytest.mark.skipif(
    not HAVE_NEMO_RUN, reason='nemo-run not installed: pip install -e ".[nemo-run]"'
)


@pytest.mark.parametrize("preset", ["grpo", "reco", "reco_response_only", "reco_token_only"])
def test_ablation_overrides_reproduce_presets(preset: str) -> None:
    from launch.experiments import METHOD_FIELDS, ablation_overrides

    want = LossConfig.preset(preset)
    full = load_config(TrainConfig, None, ablation_overrides(preset, full_preset=True))
    assert full.loss == want
    cfg = load_config(TrainConfig, ROOT / "examples/tiny_cpu.yaml", ablation_overrides(preset))
    for name in METHOD_FIELDS:
        assert getattr(cfg.loss, name) == getattr(want, name)


@pytest.fixture
def nemorun_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A private NEMORUN_HOME; stdin from /dev/null (NeMo-Run's invoke calls read stdin)."""
    monkeypatch.setenv("NEMORUN_HOME", str(tmp_path / "nemorun"))
    with open(os.devnull) as devnull:
        monkeypatch.setattr(sys, "stdin", devnull)
        yield tmp_path


@needs_nemo_run
def test_slurm_executor_sbatch_script(nemorun_home: Path) -> None:
    from launch.executors import slurm_executor
    from launch.experiments import ABLATION, ablation_experiment

    ex = slurm_executor(
        account="acct",
        partition="batch",
        nodes=2,
        gpus_per_node=8,
        time="01:00:00",
        job_dir=str(nemorun_home / "jobs"),
        container_mounts=["/lustre:/lustre"],
        packager="none",
    )
    with ablation_experiment(
        ex, config="examples/llama3.1-8b-instruct.yaml", overrides=["trainer.max_steps=3"]
    ) as exp:
        exp.dryrun(log=False, delete_exp_dir=False)
        files = sorted(glob.glob(os.path.join(exp._exp_dir, "**", "*_sbatch.sh"), recursive=True))
    names = {Path(f).name: f for f in files}
    assert set(names) == {f"{v}_sbatch.sh" for v in ABLATION}
    text = Path(names["grpo_sbatch.sh"]).read_text()
    for line in (
        "#SBATCH --account=acct",
        "#SBATCH --partition=batch",
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --time=01:00:00",
        "#SBATCH --exclusive",
        "#SBATCH --signal=B:USR1@180",
        "export CUDA_DEVICE_MAX_CONNECTIONS=1",
    ):
        assert line in text, line
    assert "--exclusive=False" not in text
    assert "--container-image nvcr.io#nvidia/pytorch:25.04-py3" in text
    assert "--nnodes 2 --nproc-per-node 8" in text and "--rdzv-backend c10d" in text
    assert (
        "-m reco_megatron.train examples/llama3.1-8b-instruct.yaml loss.objective=ppo_clip "
        "loss.response_weight=none loss.token_ratio=importance trainer.max_steps=3 "
        "trainer.output_dir=runs/ablation/grpo"
    ) in text


@pytest.mark.dist
@needs_nemo_run
def test_local_executor_tiny_two_processes(nemorun_home: Path) -> None:
    from launch.executors import local_executor
    from launch.experiments import ablation_experiment

    # NeMo-Run's local executor hands an argument with shell-special characters to torchrun
    # still quoted ("'trainer.loggers=[]'"), so list-valued overrides stay out (docs/launch.md)
    tiny = [
        *(o for o in TINY_RUN if "[" not in o),
        "trainer.max_steps=2",
        "sft.steps=2",
        "parallel.micro_batch_size=2",
        f"data.tokenizer={ROOT}/examples/tiny/countdown_sp.model",
    ]
    out = nemorun_home / "runs"
    with ablation_experiment(
        local_executor(2, env={"PYTHONPATH": str(ROOT)}),
        config=str(ROOT / "examples/tiny_cpu.yaml"),
        overrides=tiny,
        output_root=str(out),
        variants=["reco"],
    ) as exp:
        exp.run(sequential=True)
    # Leaving the context waits for the jobs.
    status = exp.status(return_dict=True)
    assert str(status["reco"]["status"]).endswith("SUCCEEDED"), status
    run_dir = out / "reco"
    assert (run_dir / "metrics.jsonl").read_text().strip()
    assert (run_dir / "checkpoints" / "latest").exists()
    assert local_executor(2).nproc_per_node() == 2  # torchrun --nproc-per-node 2


def _experiments_main(argv: list[str], capsys) -> tuple[int, str, str]:
    from launch.experiments import main

    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


@needs_nemo_run
def test_dryrun_impossible_layout_exits_2_and_creates_nothing(nemorun_home: Path, capsys) -> None:
    argv = [
        *("--executor", "slurm", "--account", "a", "--dryrun"),
        *(
            "--config",
            "examples/llama3.1-8b-instruct.yaml",
            "parallel.pipeline_model_parallel_size=3",  # TP 2 x PP 3 = 6 does not divide 8
        ),
    ]
    code, out, err = _experiments_main(argv, capsys)
    assert code == 2
    (line,) = err.strip().splitlines()  # the four variants share the problem: said once
    assert line.startswith("launch.experiments: cannot launch: world size 8 is not divisible")
    assert out == ""
    assert not (nemorun_home / "nemorun").exists()


@needs_nemo_run
@pytest.mark.dist  # a fresh interpreter importing torch and megatron-core (the real command)
def test_a_run_checks_the_files_first_exits_2_and_creates_nothing(
    nemorun_home: Path, tmp_path: Path
) -> None:
    """Not a dry run: the trainer's file pre-flight runs before anything is built (here a
    prompt file that does not exist), once, on the first variant, in one line."""
    runs = tmp_path / "runs"
    argv = [
        *("--executor", "local", "--variants", "grpo,reco", "--output-root", str(runs)),
        *("--config", "examples/tiny_cpu.yaml", "data.train_path=missing.jsonl"),
    ]
    done = subprocess.run(  # the real command: a fresh process, as a user runs it
        [sys.executable, "-m", "launch.experiments", *argv],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2 and done.stdout == "", done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("launch.experiments: cannot launch: grpo: data.train_path='missing.")
    assert not (nemorun_home / "nemorun").exists() and not runs.exists()


@pytest.mark.dist
@needs_nemo_run
def test_dryrun_prints_unwrapped_scripts_and_leaves_no_folder(nemorun_home: Path, capsys) -> None:
    home = nemorun_home / "nemorun"
    argv = [
        *("--executor", "slurm", "--account", "a", "--dryrun", "--variants", "grpo,reco"),
        *("--config", "examples/llama3.1-8b-instruct.yaml", "trainer.max_steps=3"),
    ]
    code, out, _ = _experiments_main(argv, capsys)
    assert code == 0
    assert out.count("#!/bin/bash") == 2 and "# ---- reco (slurm) ----" in out
    (output,) = [line for line in out.splitlines() if line.startswith("#SBATCH --output=")][:1]
    assert output.endswith("/grpo/sbatch_reco-grpo_%j.out")  # the long path on one line
    assert any(
        line.rstrip().endswith("trainer.max_steps=3 trainer.output_dir=runs/ablation/reco")
        for line in out.splitlines()
    )
    assert not home.exists() or not any(home.rglob("*")), sorted(home.rglob("*"))
    code, out, _ = _experiments_main(
        ["--dryrun", "--variants", "reco", "--nproc-per-node", "2"], capsys
    )
    assert code == 0
    assert "torchrun --nproc-per-node 2 -m reco_megatron.train examples/tiny_cpu.yaml" in out
    assert not home.exists() or not any(home.rglob("*"))


def test_help_keeps_the_example_lines(capsys) -> None:
    from launch.experiments import main

    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "\n    python -m launch.experiments --executor local --nproc-per-node 2 \\\n" in out


@needs_nemo_run
def test_slurm_split_runs_the_role_dispatch(nemorun_home: Path) -> None:
    from launch.executors import slurm_executor
    from launch.experiments import ablation_experiment

    ex = slurm_executor(account="a", nodes=4, job_dir=str(nemorun_home / "jobs"), packager="none")
    with ablation_experiment(
        ex,
        config="examples/llama3.1-8b-instruct.yaml",
        overrides=["loss.tis_cap=2.0"],
        variants=["reco"],
        rollout_nodes=2,
    ) as exp:
        exp.dryrun(log=False, delete_exp_dir=False)
        (sbatch,) = glob.glob(os.path.join(exp._exp_dir, "**", "*_sbatch.sh"), recursive=True)
    text = Path(sbatch).read_text()
    assert "#SBATCH --nodes=4" in text and "#SBATCH --ntasks-per-node=1" in text
    (srun,) = [line for line in text.splitlines() if "slurm/role.sh" in line]
    assert (
        "bash slurm/role.sh --train-nodes 2 --workers 16 --workers-per-node 8 "
        "--gpus-per-worker 1 --worker python -m reco_megatron.rollout_worker "
        "--address runs/ablation/reco/rollout/address.json"
    ) in srun
    assert "--trainer python -m torch.distributed.run --nnodes 2 --nproc-per-node 8" in srun
    assert "--rdzv-endpoint $head_node_ip:29500" in srun  # the sbatch script sets it
    assert srun.endswith(
        "rollout.placement=separate rollout.worker_launch=external rollout.num_workers=16 "
        "loss.objective=reco loss.response_weight=sequence loss.token_ratio=bernoulli "
        "loss.tis_cap=2.0 trainer.output_dir=runs/ablation/reco"
    )


@needs_nemo_run
def test_an_impossible_split_is_refused(nemorun_home: Path, capsys) -> None:
    from launch.executors import slurm_executor
    from launch.experiments import ablation_experiment

    ex = slurm_executor(account="a", nodes=2, job_dir=str(nemorun_home / "jobs"), packager="none")
    config = "examples/llama3.1-8b-instruct.yaml"
    argv = [
        *("--executor", "slurm", "--account", "a", "--dryrun", "--nodes", "4"),
        *("--rollout-nodes", "2", "--config", config),  # K = 1 stale groups need loss.tis_cap
    ]
    code, out, err = _experiments_main(argv, capsys)
    assert code == 2 and out == ""
    (line,) = err.strip().splitlines()
    assert line.startswith("launch.experiments: cannot launch: ROLLOUT_NODES=2: ")
    assert "set loss.tis_cap" in line
    assert not (nemorun_home / "nemorun").exists()
    with (
        pytest.raises(ValueError, match="leaves no node to train on"),
        ablation_experiment(ex, config=config, variants=["reco"], rollout_nodes=2),
    ):
        pass
