"""ROLLOUT_NODES: one job whose first nodes train and whose last nodes generate.

The previews of the Slurm scripts under a fake allocation, the role dispatch of
``slurm/role.sh`` run as each node would run it, and the refusals of impossible splits by
``reco_megatron.launch_check --rollout-nodes``.
"""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path

import pytest

from reco_megatron import launch_check
from tests.launch.test_slurm_scripts import ROOT, _dry_run, _fake_allocation

pytestmark = pytest.mark.dist

LLAMA8B = "examples/llama3.1-8b-instruct.yaml"
TIS = "loss.tis_cap=2.0"  # the examples keep K = 1 stale groups, which need the TIS cap


def _split_preview(tmp_path: Path, nodes: int, **env: str) -> tuple[list[str], str]:
    allocation = _fake_allocation(tmp_path, [f"gpu{i:03d}" for i in range(1, nodes + 1)])
    allocation.update(OUTPUT_DIR="/lustre/runs/split", **env)
    res = _dry_run("slurm/reco.sbatch", allocation, TIS)
    assert res.returncode == 0, res.stderr
    return shlex.split(res.stdout.strip()), res.stderr


def _role_args(cmd: list[str]) -> list[str]:
    """The arguments the srun line gives ``slurm/role.sh``."""
    return cmd[cmd.index(f"{ROOT}/slurm/role.sh") + 1 :]


def _trainer(cmd: list[str]) -> list[str]:
    return cmd[cmd.index("--trainer") + 1 :]


def test_dry_run_previews_a_two_plus_two_split(tmp_path: Path) -> None:
    cmd, err = _split_preview(tmp_path, 4, ROLLOUT_NODES="2", CONFIG=LLAMA8B)
    assert cmd[:5] == ["srun", "--nodes=4", "--ntasks-per-node=1", "--kill-on-bad-exit=1", "bash"]
    role = _role_args(cmd)
    assert role[: role.index("--worker")] == [
        *("--train-nodes", "2", "--workers", "16"),
        *("--workers-per-node", "8", "--gpus-per-worker", "1"),  # a worker is one GPU
    ]
    worker = role[role.index("--worker") + 1 : role.index("--trainer")]
    assert worker[1:] == [
        *("-m", "reco_megatron.rollout_worker"),
        *("--address", "/lustre/runs/split/rollout/address.json", "--connect-timeout", "1800"),
    ]
    run = _trainer(cmd)
    assert run[run.index("--nnodes") + 1] == "2"  # torchrun over the training nodes only
    assert run[run.index("--nproc-per-node") + 1] == "8"
    assert run[run.index("--rdzv-endpoint") + 1] == f"gpu001:{29500 + 4242 % 1000}"
    assert run[run.index("reco_megatron.train") + 1 :] == [
        LLAMA8B,
        "trainer.output_dir=/lustre/runs/split",
        "rollout.placement=separate",
        "rollout.worker_launch=external",
        "rollout.num_workers=16",
        TIS,  # the user's overrides come last: they win where launch_check let them
    ]
    assert "layout: TP=2 PP=1 CP=1 DP=8 WORLD=16 on 2 training node(s)" in err
    assert (
        "split: 2 training node(s) x 8 process(es), 2 rollout node(s) x 8 worker(s) of "
        "1 GPU(s) (16 worker(s)"
    ) in err


def test_dry_run_previews_a_cpu_split(tmp_path: Path) -> None:
    cmd, err = _split_preview(
        tmp_path, 3, ROLLOUT_NODES="1", CONFIG="examples/tiny_cpu.yaml", GPUS_PER_NODE="0"
    )
    role = _role_args(cmd)
    assert role[: role.index("--worker")] == [
        *("--train-nodes", "2", "--workers", "1"),
        *("--workers-per-node", "1", "--gpus-per-worker", "0"),
    ]
    run = _trainer(cmd)
    assert run[run.index("--nnodes") + 1] == "2" and "rollout.num_workers=1" in run
    assert "1 rollout node(s) x 1 worker(s) on the CPU" in err


def test_rollout_nodes_zero_is_todays_command_line(tmp_path: Path) -> None:
    env = _fake_allocation(tmp_path, ["gpu001", "gpu002"])
    env.update(CONFIG=LLAMA8B, LAUNCH_CHECK="0")
    plain = _dry_run("slurm/reco.sbatch", env, "trainer.seed=3")
    zero = _dry_run("slurm/reco.sbatch", {**env, "ROLLOUT_NODES": "0"}, "trainer.seed=3")
    assert plain.returncode == zero.returncode == 0, plain.stderr + zero.stderr
    assert zero.stdout == plain.stdout and "role.sh" not in plain.stdout


def _role(node: int, args: list[str], **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(ROOT / "slurm/role.sh"), *args],
        env={"PATH": "/usr/bin:/bin", "SLURM_NODEID": str(node), **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


def _workers(out: str) -> list[tuple[str, str]]:
    """``(CUDA_VISIBLE_DEVICES, worker id)`` of each worker line a dry run printed."""
    found = []
    for line in out.splitlines():
        words = shlex.split(line)
        assert words[0].startswith("CUDA_VISIBLE_DEVICES="), line
        found.append((words[0].split("=", 1)[1], words[words.index("--worker-id") + 1]))
    return found


def test_role_dispatch_per_node(tmp_path: Path) -> None:
    cmd, _ = _split_preview(tmp_path, 4, ROLLOUT_NODES="2", CONFIG=LLAMA8B)
    args = _role_args(cmd)
    for node in (0, 1):  # training nodes: the torchrun line, nothing else
        res = _role(node, args, DRY_RUN="1")
        assert res.returncode == 0, res.stderr
        assert shlex.split(res.stdout) == _trainer(cmd)
    res = _role(2, args, DRY_RUN="1")
    assert res.returncode == 0, res.stderr
    assert _workers(res.stdout) == [(str(g), str(g)) for g in range(8)]  # a GPU each
    # The GPUs Slurm gave the task, sliced in order; ids go on node-major.
    res = _role(3, args, DRY_RUN="1", CUDA_VISIBLE_DEVICES="8,9,10,11,12,13,14,15")
    assert res.returncode == 0, res.stderr
    assert _workers(res.stdout) == [(str(g), str(g)) for g in range(8, 16)]
    assert (
        shlex.split(res.stdout.splitlines()[0])[1:-2]
        == cmd[cmd.index("--worker") + 1 : cmd.index("--trainer")]
    )
    few = _role(3, args, DRY_RUN="1", CUDA_VISIBLE_DEVICES="0,1")
    assert few.returncode == 2 and "8 worker(s) need 1 each" in few.stderr


def test_role_dispatch_cpu(tmp_path: Path) -> None:
    cmd, _ = _split_preview(
        tmp_path, 3, ROLLOUT_NODES="1", CONFIG="examples/tiny_cpu.yaml", GPUS_PER_NODE="0"
    )
    res = _role(2, _role_args(cmd), DRY_RUN="1")
    assert res.returncode == 0, res.stderr
    assert _workers(res.stdout) == [("", "0")]  # CPU workers see no GPU


FAKE_WORKER = 'case "$*" in *"--worker-id $FAIL_ID"*) exit 5 ;; esac; sleep "${NAP:-0}"'


def _fake_role(fail_id: str, nap: str) -> subprocess.CompletedProcess:
    args = [
        *("--train-nodes", "1", "--workers", "3", "--workers-per-node", "3"),
        *("--gpus-per-worker", "0", "--worker", "bash", "-c", FAKE_WORKER, "worker"),
        *("--trainer", "false"),
    ]
    return _role(1, args, FAIL_ID=fail_id, NAP=nap)


def test_a_failed_worker_fails_the_task_and_stops_the_others() -> None:
    ok = _fake_role("none", "0")
    assert ok.returncode == 0, ok.stderr
    assert ok.stderr.count("finished") == 3
    # Worker 1 fails at once; 0 and 2 would sleep 300 s: the task must end them and fail.
    bad = _fake_role("1", "300")
    assert bad.returncode == 5, bad.stderr
    assert "rollout worker 1 exited with status 5" in bad.stderr
    assert "finished" not in bad.stderr


def _check(capsys, *argv: str) -> tuple[int, str, str]:
    code = launch_check.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# the 8B example still holds /path/to/... placeholders: these tests check the split alone
GPU4 = ("--nnodes", "4", "--nproc-per-node", "8", "--gpus-per-node", "8", "--layout-only")


def test_launch_check_names_the_split(capsys) -> None:
    code, out, err = _check(capsys, *GPU4, "--rollout-nodes", "2", LLAMA8B, TIS)
    assert code == 0, err
    assert out == (
        "TP=2 PP=1 CP=1 DP=8 WORLD=16 TRAIN_NODES=2 ROLLOUT_NODES=2 WORKERS=16 "
        "WORKERS_PER_NODE=8 WORKER_GPUS=1\n"
    )


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        ((*GPU4, "--rollout-nodes", "4", LLAMA8B, TIS), "leaves no node to train on"),
        ((*GPU4, "--rollout-nodes", "-1", LLAMA8B), "ROLLOUT_NODES=-1"),
        ((*GPU4, "--rollout-nodes", "2", LLAMA8B), "set loss.tis_cap"),  # TrainConfig speaks
        ((*GPU4, "--rollout-nodes", "2", LLAMA8B, TIS, "rollout.engine=megatron"), "megatron"),
        (
            (*GPU4, "--rollout-nodes", "2", LLAMA8B, TIS, "rollout.placement=colocated"),
            "rollout.placement=colocated with ROLLOUT_NODES=2",
        ),
        (
            (*GPU4, "--rollout-nodes", "2", LLAMA8B, TIS, "rollout.worker_launch=spawn"),
            "rollout.worker_launch=spawn with ROLLOUT_NODES=2",
        ),
        (  # 3 workers fill part of one node of 8 slots: the second rollout node would idle
            (*GPU4, "--rollout-nodes", "2", LLAMA8B, TIS, "rollout.num_workers=3"),
            "give 9..16 workers",
        ),
    ],
)
def test_launch_check_refuses_an_impossible_split(capsys, argv: tuple, needle: str) -> None:
    code, out, err = _check(capsys, *argv)
    assert code == launch_check.EXIT_CONFIG and out == ""
    (line,) = err.splitlines()
    assert line.startswith("reco launch check failed: ") and needle in line, line


def test_a_user_worker_count_that_fits_wins(capsys) -> None:
    argv = (*GPU4, "--rollout-nodes", "2", LLAMA8B, TIS, "rollout.num_workers=12")
    code, out, err = _check(capsys, *argv)
    assert code == 0 and " WORKERS=12 " in out, err


def test_the_scripts_refuse_a_split_they_cannot_size(tmp_path: Path) -> None:
    env = _fake_allocation(tmp_path, ["gpu001", "gpu002"])
    env.update(CONFIG=LLAMA8B, ROLLOUT_NODES="1", LAUNCH_CHECK="0")
    res = _dry_run("slurm/reco.sbatch", env)
    assert res.returncode == 2 and "drop LAUNCH_CHECK=0" in res.stderr
    res = _dry_run("slurm/reco.sbatch", {**env, "ROLLOUT_NODES": "two"})
    assert res.returncode == 2 and "whole number of rollout nodes" in res.stderr
    assert res.stdout == ""
