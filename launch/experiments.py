"""The GRPO vs ReCo ablation as one NeMo-Run experiment.

Four runs of the same entry point that differ only in the loss fields that define each
method (``reco_megatron.algo.config.PRESETS``); everything else comes from the config::

    # CPU, the tiny default, 2 torchrun processes per run, the four runs one after another
    python -m launch.experiments --executor local --nproc-per-node 2 \\
        --config examples/tiny_cpu.yaml trainer.max_steps=10

    # Slurm: 4 jobs of 1 node x 8 H100 each, submitted from a login node
    python -m launch.experiments --executor slurm --account ACCT --partition batch \\
        --nodes 1 --config examples/qwen2.5-math-1.5b.yaml

    # Slurm, 4 nodes per run: 2 train, 2 generate (separate placement, slurm/role.sh)
    python -m launch.experiments --executor slurm --account ACCT --nodes 4 \\
        --rollout-nodes 2 --config examples/llama3.1-8b-instruct.yaml loss.tis_cap=2.0

    # print the sbatch files (Slurm) or torchrun lines (local) without running anything
    python -m launch.experiments --executor slurm --account ACCT --dryrun --config ...

Before anything is built, every variant goes through the launch scripts' layout check
(``reco_megatron.launch_check``: nodes x processes against TP x PP x CP, heads, layers, the
config itself): a layout that cannot run exits 2 with the fix, one line, and creates nothing
(69 when this interpreter is not the project's environment). A run (not ``--dryrun``) then
runs the trainer's file pre-flight once, as the Slurm scripts do (placeholders, paths, the
tokenizer, prompt lengths, the reward's trial call, the initial checkpoint). A dry run prints
each rendered script unwrapped on stdout and leaves no experiment folder behind.

Outputs: ``<output-root>/<variant>/`` (metrics.jsonl, checkpoints, plots) per variant.
"""

from __future__ import annotations

import argparse
import logging
import shlex
import shutil
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from launch.executors import (
    import_nemo_run,
    local_executor,
    role_executor,
    slurm_executor,
    split_script,
    train_script,
)

ABLATION: tuple[str, ...] = ("grpo", "reco", "reco_response_only", "reco_token_only")
"""The four methods of the ablation, as ``LossConfig`` preset names."""

METHOD_FIELDS: tuple[str, ...] = ("objective", "response_weight", "token_ratio")
"""The loss fields in which the ablation presets differ; the rest (clip, KL) is shared."""


def ablation_overrides(preset: str, *, full_preset: bool = False) -> list[str]:
    """``loss.<field>=<value>`` overrides that turn a config's loss into ``preset``.

    ``full_preset=False`` (default): only :data:`METHOD_FIELDS`, so all variants share the
    config's clip range and KL coefficient and differ by method only. ``True``: every field of
    the preset (then ``LossConfig`` equals ``LossConfig.preset(preset)`` exactly).
    """
    from reco_megatron.algo.config import PRESETS

    if preset not in PRESETS:
        raise ValueError(f"unknown loss preset {preset!r}; valid: {sorted(PRESETS)}")
    fields = PRESETS[preset]
    keys = list(fields) if full_preset else [k for k in METHOD_FIELDS if k in fields]
    return [f"loss.{key}={_yaml_value(fields[key])}" for key in keys]


def _yaml_value(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def add_ablation(
    exp: Any,
    executor: Any,
    *,
    config: str,
    overrides: Sequence[str] = (),
    output_root: str = "runs/ablation",
    variants: Sequence[str] = ABLATION,
    full_preset: bool = False,
    rollout_nodes: int = 0,
) -> list[str]:
    """Add one task per variant to ``exp`` (inside ``with exp:``); returns the task names.

    Each task: ``config``, then the variant's loss overrides, then ``overrides``, then
    ``trainer.output_dir=<output_root>/<variant>``. ``rollout_nodes=k`` (a Slurm executor):
    the last k nodes of each job run rollout workers (:func:`launch.executors.split_script`),
    the split checked and sized by ``reco_megatron.launch_check.check_split``, which raises
    ``ValueError`` (one line, with the fix) for a split that cannot run.
    """
    for variant in variants:
        output_dir = f"{output_root}/{variant}"
        args = [
            *ablation_overrides(variant, full_preset=full_preset),
            *overrides,
            f"trainer.output_dir={output_dir}",
        ]
        if rollout_nodes:
            from reco_megatron.launch_check import check_split

            gpus = executor.gpus_per_node
            _, split = check_split(
                config,
                args,
                nnodes=executor.nodes,
                nproc_per_node=gpus,
                gpus_per_node=gpus,
                rollout_nodes=rollout_nodes,
            )
            task = split_script(config, args, split, output_dir=output_dir, nproc_per_node=gpus)
            exp.add(task, executor=role_executor(executor), name=variant)
        else:
            exp.add(train_script(config, args), executor=executor.clone(), name=variant)
    return list(variants)


@contextmanager
def ablation_experiment(
    executor: Any, *, title: str = "reco-ablation", **kwargs: Any
) -> Iterator[Any]:
    """``with ablation_experiment(executor, config=...) as exp: exp.run()`` (or ``dryrun()``).

    A ``nemo_run.Experiment`` holding the tasks of :func:`add_ablation` (``kwargs`` go there).
    """
    run = import_nemo_run()
    with run.Experiment(title) as exp:
        add_ablation(exp, executor, **kwargs)
        yield exp


def preflight(
    config: str,
    overrides: Sequence[str],
    variants: Sequence[str],
    *,
    nnodes: int,
    nproc_per_node: int,
    gpus_per_node: int,
    full_preset: bool = False,
    rollout_nodes: int = 0,
    files: bool = False,
) -> list[str]:
    """The problems (``"<variant>: <reason and fix>"``) of launching each variant on this
    layout, checked as the Slurm scripts check (``reco_megatron.launch_check``, with
    ``--rollout-nodes``' split when ``rollout_nodes``); with ``files``, the first variant's
    files, tokenizer, prompts and reward too (the variants differ only in their loss); [] when
    all fit. Raises ImportError when the project's dependencies are missing here."""
    from reco_megatron.config import ConfigError
    from reco_megatron.launch_check import check_layout, check_split

    problems = []
    for variant in variants:
        try:
            args = [*ablation_overrides(variant, full_preset=full_preset), *overrides]
            sizes = {
                "nnodes": nnodes,
                "nproc_per_node": nproc_per_node,
                "gpus_per_node": gpus_per_node,
                "files": files and variant == variants[0],
            }
            if rollout_nodes:
                check_split(config, args, rollout_nodes=rollout_nodes, **sizes)
            else:
                check_layout(config, args, **sizes)
        except (ConfigError, ValueError) as exc:
            problems.append(f"{variant}: {' '.join(str(exc).split())}")
    return problems


def _nemorun_dirs(exp_dir: Path) -> list[Path]:
    """``exp_dir`` and its parents up to NeMo-Run's home (``experiments/<title>/<id>``)."""
    return [exp_dir, *list(exp_dir.parents)[:3]]


def print_dryrun(exp: Any, executor_kind: str, stream: Any = None) -> None:
    """Render ``exp`` without running it, write each task's script to ``stream`` (stdout)
    unwrapped, and remove the folders the rendering created (NeMo-Run keeps an experiment
    folder per dry run otherwise)."""
    stream = stream or sys.stdout
    home = Path(import_nemo_run().config.get_nemorun_home())
    existed = {p for p in [home, home / "experiments", *home.glob("experiments/*")] if p.exists()}
    torchx = logging.getLogger("torchx")  # "Log directory is: <a folder removed below>"
    level = torchx.level
    torchx.setLevel(logging.WARNING)
    try:
        exp.dryrun(log=False, delete_exp_dir=False)
    finally:
        torchx.setLevel(level)
    exp_dir = Path(exp._exp_dir)
    try:
        for job in exp.jobs:
            stream.write(f"# ---- {job.id} ({executor_kind}) ----\n")
            sbatch = exp_dir / f"{job.id}_sbatch.sh"
            if sbatch.is_file():
                text = sbatch.read_text()
                stream.write(text if text.endswith("\n") else text + "\n")
            else:  # the local executor renders no file: the command it runs
                task = job.task
                env = " ".join(
                    f"{k}={shlex.quote(v)}"
                    for k, v in job.executor.env_vars.items()
                    if k != "PATH"  # this interpreter's bin directory first: long, not news
                )
                nproc = job.executor.nproc_per_node()
                args = shlex.join([task.path, *task.args])
                stream.write(f"{env} torchrun --nproc-per-node {nproc} -m {args}\n")
    finally:
        shutil.rmtree(exp_dir, ignore_errors=True)
        for folder in _nemorun_dirs(exp_dir)[1:]:
            if folder not in existed and folder.is_dir() and not any(folder.iterdir()):
                folder.rmdir()


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: see the module docstring. Returns the exit code: 0, 2 (a variant that
    cannot run on this layout, or a bad argument), 69 (not the project's environment)."""
    p = argparse.ArgumentParser(
        prog="python -m launch.experiments",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,  # keep the examples' lines
    )
    p.add_argument("--executor", choices=("local", "slurm"), default="local")
    p.add_argument("--config", default="examples/tiny_cpu.yaml")
    p.add_argument("--output-root", default="runs/ablation")
    p.add_argument("--variants", default=",".join(ABLATION), help="comma-separated presets")
    p.add_argument("--nproc-per-node", type=int, default=1, help="local: torchrun processes")
    p.add_argument("--account", default="", help="slurm: account")
    p.add_argument("--partition", default=None, help="slurm: partition")
    p.add_argument("--nodes", type=int, default=1, help="slurm: nodes per run")
    p.add_argument("--gpus-per-node", type=int, default=8, help="slurm: GPUs per node")
    p.add_argument("--container-image", default="nvcr.io#nvidia/pytorch:25.04-py3")
    p.add_argument("--time", default="04:00:00", help="slurm: time limit per run")
    p.add_argument("--job-dir", default="", help="slurm: NeMo-Run job dir (on the cluster)")
    p.add_argument("--ssh-host", default=None, help="slurm: submit through SSH to this host")
    p.add_argument(
        "--rollout-nodes",
        type=int,
        default=0,
        help="slurm: the last K nodes of each job run rollout workers (separate placement)",
    )
    p.add_argument("--full-preset", action="store_true", help="apply every preset field")
    p.add_argument("--dryrun", action="store_true", help="render, do not run")
    p.add_argument("overrides", nargs="*", help="section.key=value trainer overrides")
    ns = p.parse_args(argv)
    variants = [v for v in ns.variants.split(",") if v]
    from reco_megatron.algo.config import PRESETS

    unknown = [v for v in variants if v not in PRESETS]
    if unknown:
        p.error(f"--variants: unknown preset(s) {unknown}; valid: {', '.join(PRESETS)}")
    local = ns.executor == "local"
    if local and ns.rollout_nodes:
        p.error("--rollout-nodes needs --executor slurm (nodes of their own for the workers)")
    from reco_megatron.utils.noise import quiet_known_warnings

    quiet_known_warnings()  # the file checks import megatron-core: its notes are not problems
    try:
        problems = preflight(
            ns.config,
            ns.overrides,
            variants,
            nnodes=1 if local else ns.nodes,
            nproc_per_node=ns.nproc_per_node if local else ns.gpus_per_node,
            gpus_per_node=0 if local else ns.gpus_per_node,
            full_preset=ns.full_preset,
            rollout_nodes=ns.rollout_nodes,
            files=not ns.dryrun,
        )
    except ImportError as exc:
        from reco_megatron.launch_check import EXIT_ENVIRONMENT, environment_problem

        sys.stderr.write(f"launch.experiments: environment: {environment_problem(exc)}\n")
        return EXIT_ENVIRONMENT
    if problems:
        # The variants share the layout, so they usually share the problem: say it once.
        unique = list(dict.fromkeys(problem.split(": ", 1)[1] for problem in problems))
        for problem in unique if len(unique) < len(problems) else problems:
            sys.stderr.write(f"launch.experiments: cannot launch: {problem}\n")
        return 2
    if ns.executor == "local":
        executor = local_executor(ns.nproc_per_node)
    else:
        executor = slurm_executor(
            account=ns.account,
            partition=ns.partition,
            nodes=ns.nodes,
            gpus_per_node=ns.gpus_per_node,
            container_image=ns.container_image or None,
            time=ns.time,
            job_dir=ns.job_dir,
            ssh_host=ns.ssh_host,
        )
    with ablation_experiment(
        executor,
        config=ns.config,
        overrides=ns.overrides,
        output_root=ns.output_root,
        variants=variants,
        full_preset=ns.full_preset,
        rollout_nodes=ns.rollout_nodes,
    ) as exp:
        if ns.dryrun:
            print_dryrun(exp, ns.executor)
        else:
            # Local CPU runs share the cores: one after another. Slurm jobs run side by side.
            exp.run(sequential=ns.executor == "local", tail_logs=ns.executor == "local")
    return 0


if __name__ == "__main__":
    sys.exit(main())
