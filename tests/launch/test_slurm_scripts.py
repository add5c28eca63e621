"""The Slurm scripts without Slurm: dry runs under a fake multi-node allocation, shellcheck."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.dist

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = [*sorted((ROOT / "slurm").glob("*.sh")), ROOT / "slurm/reco.sbatch"]


def _fake_allocation(tmp_path: Path, nodes: list[str]) -> dict[str, str]:
    """Environment of a fake Slurm job on ``nodes`` with a fake ``scontrol`` on PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    scontrol = bin_dir / "scontrol"
    names = "\n".join(nodes)
    scontrol.write_text(
        f'#!/bin/sh\n[ "$1 $2" = "show hostnames" ] || exit 3\nprintf "%s\\n" "{names}"\n'
    )
    scontrol.chmod(0o755)
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SLURM_", "ROLLOUT_")) and k != "LAUNCH_CHECK"
    }
    env.update(
        PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}",
        SLURM_JOB_NODELIST=f"gpu[001-{len(nodes):03d}]",
        SLURM_NNODES=str(len(nodes)),
        SLURM_JOB_ID="4242",
        SLURM_JOB_NAME="reco-llama8b",
        SLURM_CPUS_PER_TASK="96",
        DRY_RUN="1",
        LAYOUT_ONLY="1",  # the examples hold /path/to/... placeholders: these tests are layouts
        PYTHON=sys.executable,
        PYTHONPATH=str(ROOT),
    )
    return env


def _dry_run(script: str, env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(ROOT / script), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )


def test_llama8b_dry_run_multinode(tmp_path: Path) -> None:
    env = _fake_allocation(tmp_path, ["gpu001", "gpu002", "gpu003", "gpu004"])
    env["OUTPUT_DIR"] = "/lustre/runs/llama8b"
    res = _dry_run("slurm/reco_llama8b.sh", env, "trainer.max_steps=7", "rollout.top_p=0.9")
    assert res.returncode == 0, res.stderr
    cmd = shlex.split(res.stdout.strip())
    assert cmd[:4] == ["srun", "--nodes=4", "--ntasks-per-node=1", "--kill-on-bad-exit=1"]
    i = cmd.index("torch.distributed.run")
    run = cmd[i + 1 :]

    def opt(name: str) -> str:
        return run[run.index(name) + 1]

    assert opt("--nnodes") == "4" and opt("--nproc-per-node") == "8"
    assert opt("--rdzv-backend") == "c10d" and opt("--rdzv-id") == "4242"
    assert opt("--rdzv-endpoint") == f"gpu001:{29500 + 4242 % 1000}"
    tail = run[run.index("reco_megatron.train") + 1 :]
    assert tail == [
        "examples/llama3.1-8b-instruct.yaml",
        "trainer.output_dir=/lustre/runs/llama8b",
        "trainer.max_steps=7",
        "rollout.top_p=0.9",
    ]
    assert "layout: TP=2 PP=1 CP=1 DP=16 WORLD=32" in res.stderr


def test_llama8b_dry_run_container(tmp_path: Path) -> None:
    env = _fake_allocation(tmp_path, ["gpu001", "gpu002"])
    env.update(
        CONTAINER_IMAGE="nvcr.io#nvidia/pytorch:25.04-py3",
        CONTAINER_MOUNTS="/a:/a",
        LAUNCH_CHECK="0",
    )
    res = _dry_run("slurm/reco_llama8b.sh", env)
    assert res.returncode == 0, res.stderr
    cmd = shlex.split(res.stdout.strip())
    assert "--container-image=nvcr.io#nvidia/pytorch:25.04-py3" in cmd
    assert "--container-mounts=/a:/a" in cmd
    assert f"--container-workdir={ROOT}" in cmd


@pytest.mark.parametrize(
    ("extra_env", "args", "needle"),
    [
        # Each layout case runs the Python check (a torch import); the other bad fits are
        # covered in-process by tests/launch/test_configs.py::test_layout_fails_fast.
        ({}, ["parallel.tensor_model_parallel_size=16"], "must stay inside a node"),
        ({"CONFIG": "examples/nope.yaml"}, [], "config examples/nope.yaml not found"),
    ],
)
def test_llama8b_fails_fast(
    tmp_path: Path, extra_env: dict[str, str], args: list[str], needle: str
) -> None:
    env = _fake_allocation(tmp_path, ["gpu001", "gpu002", "gpu003"])
    env.update(extra_env)
    res = _dry_run("slurm/reco_llama8b.sh", env, *args)
    assert res.returncode == 2, res.stderr  # a bad fit: 2, never the environment's 69
    assert needle in res.stderr
    assert "srun" not in res.stdout


BAD_REWARDS = "def text(response, gold):\n    return 'yes'\n"


def _tiny_check_env(tmp_path: Path) -> tuple[dict[str, str], Path]:
    (tmp_path / "bad_rewards.py").write_text(BAD_REWARDS)
    env = _fake_allocation(tmp_path, ["cpu001"])
    out = tmp_path / "run"
    del env["LAYOUT_ONLY"]
    env.update(
        CONFIG="examples/tiny_cpu.yaml",
        GPUS_PER_NODE="0",
        OUTPUT_DIR=str(out),
        PYTHONPATH=f"{ROOT}{os.pathsep}{tmp_path}",
    )
    return env, out


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("data.train_path=missing.jsonl", "data.train_path='missing.jsonl' does not exist"),
        ("reward.reward=no_such_module:score", "module 'no_such_module' cannot be imported"),
        ("reward.reward=bad_rewards:text", "returned 'yes'"),  # the trial call, in a worker
        ("rollout.max_prompt_len=16", "prompts are longer than rollout.max_prompt_len=16"),
        ("data.tokenizer=examples/no_such.model", "data.tokenizer='examples/no_such.model'"),
    ],
)
def test_the_dry_run_runs_the_trainers_file_checks(
    tmp_path: Path, override: str, needle: str
) -> None:
    """What the trainer's pre-flight would refuse stops the dry run (and the job, before srun):
    exit 2, one line, no traceback, no srun line, no output directory."""
    env, out = _tiny_check_env(tmp_path)
    res = _dry_run("slurm/reco.sbatch", env, override)
    assert res.returncode == 2 and res.stdout == "", res.stderr
    (line,) = res.stderr.splitlines()
    assert line.startswith("reco launch check failed: ") and needle in line, line
    assert not out.exists()


def test_layout_only_skips_the_file_checks_and_says_so(tmp_path: Path) -> None:
    env, _ = _tiny_check_env(tmp_path)
    res = _dry_run("slurm/reco.sbatch", {**env, "LAYOUT_ONLY": "1"}, "data.train_path=x.jsonl")
    assert res.returncode == 0 and res.stdout.startswith("srun "), res.stderr
    assert "(LAYOUT_ONLY=1: the config's files, tokenizer, prompts and reward not" in res.stderr
    fine = _dry_run("slurm/reco.sbatch", env)
    assert fine.returncode == 0, fine.stderr
    assert "(files, tokenizer, prompts and reward checked)" in fine.stderr


def test_generic_sbatch_needs_config(tmp_path: Path) -> None:
    env = _fake_allocation(tmp_path, ["n1"])
    env["LAUNCH_CHECK"] = "0"
    res = _dry_run("slurm/reco.sbatch", env)
    assert res.returncode != 0 and "CONFIG is empty" in res.stderr
    env.update(CONFIG="examples/qwen2.5-math-7b.yaml", GPUS_PER_NODE="8")
    res = _dry_run("slurm/reco.sbatch", env, "trainer.seed=3")
    assert res.returncode == 0, res.stderr
    assert res.stdout.rstrip().endswith("trainer.seed=3")


def test_tiny_dry_run_cpu(tmp_path: Path) -> None:
    env = _fake_allocation(tmp_path, ["localhost"])
    env.update(NPROC_PER_NODE="2", LAUNCH_CHECK="0")
    res = _dry_run("slurm/reco_tiny.sh", env, "trainer.max_steps=2")
    assert res.returncode == 0, res.stderr
    cmd = shlex.split(res.stdout.strip())
    assert cmd[cmd.index("--nproc-per-node") + 1] == "2"
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in res.stdout


def test_sbatch_headers() -> None:
    for script in SCRIPTS:
        if script.name in ("common.sh", "role.sh"):  # sourced / run by srun: not submitted
            continue
        text = script.read_text()
        for directive in (
            "--nodes",
            "--ntasks-per-node=1",
            "--time",
            "--signal=B:USR1@",
            "--requeue",
        ):
            assert f"#SBATCH {directive}" in text, (script.name, directive)
        assert 'reco_launch "$@"' in text


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck not installed")
def test_shellcheck_clean() -> None:
    res = subprocess.run(
        [
            "shellcheck",
            "-x",
            *map(str, SCRIPTS),
            str(ROOT / ".ci/slurm_up.sh"),
            str(ROOT / ".ci/slurm_down.sh"),
            str(ROOT / ".ci/run"),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert res.returncode == 0, res.stdout + res.stderr


def test_cluster_test_leaves_the_system_alone_without_opt_in(tmp_path: Path) -> None:
    """Plain ``pytest`` (no ``RECO_TEST_SYSTEM_CHANGES=1``) must not run ``.ci/slurm_up.sh``
    (apt-get, /etc/slurm, daemons): a fake ``bash`` first on PATH records any call."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    marker = tmp_path / "slurm_up_ran"
    fake = bin_dir / "bash"
    fake.write_text(f"#!/bin/sh\ntouch {marker}\nexit 77\n")
    fake.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "RECO_TEST_SYSTEM_CHANGES")}
    env.update(PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}", PYTHONPATH=str(ROOT))
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-rs",
            "-p",
            "no:cacheprovider",
            "--noconftest",
            "tests/launch/test_slurm_cluster.py",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert not marker.exists(), "the cluster fixture ran .ci/slurm_up.sh without the opt-in"
    assert "1 skipped" in res.stdout, res.stdout + res.stderr
    assert "RECO_TEST_SYSTEM_CHANGES=1" in res.stdout


# --------------------------------------------------------------------- documented previews
_PREVIEW = re.compile(
    r"^(?:#\s+|\s*)((?:[A-Z_]+=\S+ )*DRY_RUN=1 (?:[A-Z_]+=\S+ )*bash slurm/\S+"
    r"(?: [a-z_]+(?:\.[a-z_]+)+=[^\s`]+)*)"  # trailing trainer overrides, as written
)


def documented_previews() -> list[str]:
    """Every ``... DRY_RUN=1 ... bash slurm/X [section.key=value ...]`` command line in the
    README, docs/ and the scripts' headers, as written (trailing comments and ``...``
    dropped)."""
    found = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *SCRIPTS]:
        for line in path.read_text().splitlines():
            for text in (line, *re.findall(r"`([^`]*DRY_RUN=1[^`]*)`", line)):
                match = _PREVIEW.match(text)
                if match and match.group(1) not in found:
                    found.append(match.group(1))
    return found


def _fresh_clone(tmp_path: Path, *, venv: bool) -> tuple[Path, dict[str, str]]:
    """A checkout as a new user has it after the README's install command (``.venv`` with the
    project's dependencies, when ``venv``), and a shell where nothing is activated: ``python3``
    and ``python`` on PATH cannot import torch."""
    root = tmp_path / "clone"
    root.mkdir()
    for name in ("slurm", "reco_megatron", "examples"):
        (root / name).symlink_to(ROOT / name)
    if venv:
        (root / ".venv/bin").mkdir(parents=True)
        wrapper = root / ".venv/bin/python"
        wrapper.write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
        wrapper.chmod(0o755)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("python3", "python"):  # site-packages off: no torch, no yaml
        fake = bin_dir / name
        fake.write_text(f'#!/bin/sh\nexec {sys.executable} -S -E "$@"\n')
        fake.chmod(0o755)
    drop = ("PYTHON", "PYTHONPATH", "VIRTUAL_ENV", "DRY_RUN", "CONFIG", "GPUS_PER_NODE")
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SLURM_", "ROLLOUT_")) and k not in drop
    }
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    return root, env


def _has_placeholders(command: str) -> bool:
    """Whether the config a preview runs on still holds the examples' ``/path/to/...``: the
    ``CONFIG=`` of the command, else the script's own default."""
    words = shlex.split(command)
    config = next((w.split("=", 1)[1] for w in words if w.startswith("CONFIG=")), None)
    if config is None:
        script = (ROOT / next(w for w in words if w.startswith("slurm/"))).read_text()
        config = re.search(r"^CONFIG=\$\{CONFIG:-(\S+)\}$", script, flags=re.M).group(1)
    return "/path/to/" in (ROOT / config).read_text()


def test_every_documented_preview_works_as_written(tmp_path: Path) -> None:
    """A layout-only preview (``LAYOUT_ONLY=1``) or one of a config without placeholders
    prints the srun line; a full check of an example that still holds ``/path/to/...`` stops
    with one line naming them, as the docs say, and prints no srun line."""
    previews = documented_previews()
    assert len(previews) >= 4, previews  # README, reco_llama8b.sh, reco_tiny.sh, reco.sbatch x2
    root, env = _fresh_clone(tmp_path, venv=True)
    refused = 0
    for command in previews:
        res = subprocess.run(
            ["bash", "-c", command], cwd=root, env=env, capture_output=True, text=True, timeout=180
        )
        if "LAYOUT_ONLY=1" not in command and _has_placeholders(command):
            refused += 1
            assert res.returncode == 2 and res.stdout == "", (command, res.stderr)
            (line,) = res.stderr.splitlines()
            assert "still the example's placeholder" in line and "LAYOUT_ONLY=1" in line, line
            continue
        assert res.returncode == 0, (command, res.stderr)
        assert res.stdout.startswith("srun "), (command, res.stdout)
        assert "layout: TP=" in res.stderr, (command, res.stderr)
        assert f"{root}/.venv/bin/python -m torch.distributed.run" in res.stdout, command
    assert refused, "no documented preview shows the placeholders' refusal any more"
    assert not (root / "runs").exists()  # a preview creates no output directory


def test_no_environment_is_told_apart_from_a_bad_layout(tmp_path: Path) -> None:
    root, env = _fresh_clone(tmp_path, venv=False)
    res = subprocess.run(
        ["bash", "slurm/reco_llama8b.sh"],
        cwd=root,
        env={**env, "DRY_RUN": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 69, res.stderr
    assert "not the project's environment" in res.stderr and "PYTHON=" in res.stderr
    assert "Traceback" not in res.stderr and "srun" not in res.stdout
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, res.stderr
    missing = subprocess.run(
        ["bash", "slurm/reco_llama8b.sh"],
        cwd=root,
        env={**env, "DRY_RUN": "1", "PYTHON": str(tmp_path / "no/such/python")},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert missing.returncode == 69 and "no Python interpreter found" in missing.stderr
