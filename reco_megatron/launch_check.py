"""Fail-fast check of a launch layout against a config, for the Slurm scripts.

The scripts in ``slurm/`` call it before starting ``srun``, so a layout that cannot work
fails in seconds with the fix, not after the job waited in the queue and loaded a model::

    python -m reco_megatron.launch_check --nnodes 2 --nproc-per-node 8 --gpus-per-node 8 \\
        examples/llama3.1-8b-instruct.yaml parallel.tensor_model_parallel_size=4 \\
        data.train_path=math/train.jsonl ...   # the example's /path/to/... set to your files

Then it runs the trainer's pre-flight checks that need no world
(:func:`reco_megatron.trainer.preflight.file_problems`: the examples' ``/path/to/...``
placeholders, missing paths, the tokenizer, the prompts against ``rollout.max_prompt_len``,
the reward's import and trial call, the initial checkpoint), so a queued job cannot fail on
what could be checked at submission. ``--layout-only`` skips them (a preview of a config whose
files live elsewhere, or still hold the placeholders: ``LAYOUT_ONLY=1`` in ``slurm/``).

On success it writes one line to stdout, ``TP=4 PP=1 CP=1 DP=4 WORLD=16``, and exits 0; on a
bad fit (or an invalid config, or a file check) it writes the reason and the fix to stderr, one
line per problem, and exits 2. When the interpreter cannot import the project's dependencies
(torch, PyYAML, ...: not the project's environment) it says which interpreter and what to do,
and exits 69
(:data:`EXIT_ENVIRONMENT`), so a launcher can tell "choose the environment" apart from "the
layout does not fit" (``--quiet-environment`` leaves that message out, for a launcher that
then runs the check inside a container). ``--gpus-per-node 0`` means a CPU run (gloo): the
GPU checks are skipped.

``--rollout-nodes K`` checks a job whose last K nodes run rollout workers (``ROLLOUT_NODES``
in ``slurm/``; :func:`check_split`): the first ``NNODES - K`` nodes are checked as above, on
the config with ``rollout.placement=separate rollout.worker_launch=external
rollout.num_workers=W`` applied before the overrides; the success line then goes on with the
split, ``... TRAIN_NODES=2 ROLLOUT_NODES=2 WORKERS=8 WORKERS_PER_NODE=4 WORKER_GPUS=2``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

EXIT_CONFIG = 2
"""Exit status of an invalid config or a layout that does not fit it."""
EXIT_ENVIRONMENT = 69
"""Exit status when this interpreter cannot import the project's dependencies (sysexits'
EX_UNAVAILABLE)."""


def environment_problem(exc: ImportError) -> str:
    """The one-line explanation of an import failure: which interpreter, what is missing, how
    to choose the project's environment instead."""
    missing = exc.name or str(exc)
    return (
        f"{sys.executable} cannot import {missing!r} ({exc}): it is not the project's "
        "environment. Activate it (source .venv/bin/activate) or point the launcher at its "
        "interpreter (PYTHON=/path/to/venv/bin/python); to create one, see the README, "
        "'Fresh machine'"
    )


@dataclass(frozen=True, kw_only=True)
class Layout:
    """The resolved process layout of one run."""

    tp: int
    """Tensor parallel size."""
    pp: int
    """Pipeline parallel size."""
    cp: int
    """Context parallel size."""
    dp: int
    """Data parallel size: what is left of the world."""
    world: int
    """Processes in total (nodes x processes per node)."""
    ep: int = 1
    """Expert parallel size (mixture-of-experts models; carved out of TP x CP x DP)."""

    def line(self) -> str:
        """The one-line summary the scripts print and parse (``EP=`` only when > 1)."""
        ep = f" EP={self.ep}" if self.ep > 1 else ""
        return f"TP={self.tp} PP={self.pp} CP={self.cp} DP={self.dp}{ep} WORLD={self.world}"


def check_layout(
    config_path: str | None,
    overrides: Sequence[str],
    *,
    nnodes: int,
    nproc_per_node: int,
    gpus_per_node: int,
    files: bool = False,
) -> Layout:
    """Resolve the config's parallel sizes and check them against the allocation (then, with
    ``files``, what :func:`check_files` checks).

    Raises ``ValueError`` (the message says what to change) when: a process count is not
    positive; more processes per node than GPUs; TP larger than one node (tensor parallelism
    needs NVLink); the world size not divisible by TP x PP x CP; EP x expert-TP not dividing
    the ranks of a pipeline stage; the model's heads, layers or experts not divisible by TP /
    PP / EP; a batch split that does not fit the data-parallel size (prompts over
    mini-batches x DP, micro-batches, a virtual pipeline's share of the token budget:
    ``preflight.batch_problems``). Raises :class:`ConfigError` for an invalid config (the
    token budget against the longest sequence included: a check of the config alone).
    """
    from reco_megatron.config import load_config
    from reco_megatron.trainer.config import TrainConfig

    _check_counts(nnodes, nproc_per_node, gpus_per_node)
    cfg = load_config(TrainConfig, config_path, list(overrides))
    layout = layout_of(
        cfg, nnodes=nnodes, nproc_per_node=nproc_per_node, gpus_per_node=gpus_per_node
    )
    if files:
        check_files(cfg)
    return layout


LAYOUT_ONLY_HINT = (
    "; to preview the layout alone, pass --layout-only (LAYOUT_ONLY=1 for the slurm/ scripts)"
)


def check_files(cfg: Any) -> None:
    """The trainer's pre-flight checks that need no world, on a loaded ``TrainConfig``:
    placeholders, paths, tokenizer, prompt lengths, the reward's trial call, the initial
    checkpoint (:func:`reco_megatron.trainer.preflight.file_problems`).

    Raises:
        ConfigError: every problem, one line each; a placeholder's line says how to preview
            the layout without them.
    """
    from reco_megatron.config import ConfigError
    from reco_megatron.trainer.preflight import PLACEHOLDER, file_problems

    problems = file_problems(cfg)
    if problems:
        raise ConfigError([p + LAYOUT_ONLY_HINT if PLACEHOLDER in p else p for p in problems])


def _check_counts(nnodes: int, nproc_per_node: int, gpus_per_node: int) -> None:
    if nnodes < 1 or nproc_per_node < 1 or gpus_per_node < 0:
        raise ValueError(
            f"nodes={nnodes}, processes per node={nproc_per_node}, GPUs per node="
            f"{gpus_per_node}: nodes and processes must be >= 1 and GPUs >= 0"
        )


def layout_of(cfg: Any, *, nnodes: int, nproc_per_node: int, gpus_per_node: int) -> Layout:
    """:func:`check_layout` on an already loaded ``TrainConfig``."""
    par = cfg.parallel
    tp, pp, cp = (
        par.tensor_model_parallel_size,
        par.pipeline_model_parallel_size,
        par.context_parallel_size,
    )
    world = nnodes * nproc_per_node
    on_gpu = gpus_per_node > 0
    if on_gpu and nproc_per_node > gpus_per_node:
        raise ValueError(
            f"NPROC_PER_NODE={nproc_per_node} processes per node but only {gpus_per_node} "
            f"GPUs per node: run one process per GPU (NPROC_PER_NODE={gpus_per_node}) or "
            "request more GPUs (--gpus-per-node)"
        )
    if on_gpu and tp > nproc_per_node:
        raise ValueError(
            f"parallel.tensor_model_parallel_size={tp} is larger than the {nproc_per_node} "
            "processes of one node: tensor parallelism must stay inside a node (NVLink); "
            f"use TP <= {nproc_per_node} and raise parallel.pipeline_model_parallel_size instead"
        )
    dp = par.data_parallel_size(world)  # raises with the fix when it does not divide
    par.validate_for_model(cfg.model, cfg.model.num_layers, on_gpu=on_gpu)
    from reco_megatron.trainer.preflight import batch_problems

    problems = batch_problems(cfg, dp)  # the batch splits at this DP
    if problems:
        raise ValueError("; ".join(problems))
    return Layout(tp=tp, pp=pp, cp=cp, dp=dp, world=world, ep=par.expert_model_parallel_size)


@dataclass(frozen=True, kw_only=True)
class RolloutSplit:
    """One job's nodes split into training nodes and rollout nodes (separate placement)."""

    train_nodes: int
    """Nodes running the trainer (the first ones of the allocation)."""
    rollout_nodes: int
    """Nodes running rollout workers (the last ones)."""
    workers_per_node: int
    """Worker slots of one rollout node (GPUs per node / GPUs per worker; 1 on the CPU)."""
    gpus_per_worker: int
    """GPUs of one worker: the trainer's TP for vLLM, 1 for the embedded engine, 0 on CPU."""
    num_workers: int
    """``rollout.num_workers``: workers in total, numbered node-major over the rollout nodes."""

    def overrides(self) -> list[str]:
        """The trainer overrides the job scripts add before the user's own (which win)."""
        slots = self.rollout_nodes * self.workers_per_node
        return [*SEPARATE_OVERRIDES, f"rollout.num_workers={slots}"]

    def line(self) -> str:
        """The tokens the scripts parse (after :meth:`Layout.line`)."""
        return (
            f"TRAIN_NODES={self.train_nodes} ROLLOUT_NODES={self.rollout_nodes} "
            f"WORKERS={self.num_workers} WORKERS_PER_NODE={self.workers_per_node} "
            f"WORKER_GPUS={self.gpus_per_worker}"
        )


SEPARATE_OVERRIDES: tuple[str, ...] = (
    "rollout.placement=separate",
    "rollout.worker_launch=external",
)
"""What every rollout-node job adds to the trainer's overrides (then ``num_workers``)."""


def _one_line(exc: Exception) -> str:
    problems = getattr(exc, "problems", None)
    text = "; ".join(problems) if problems else str(exc)
    return " ".join(text.split())


def check_split(
    config_path: str | None,
    overrides: Sequence[str],
    *,
    nnodes: int,
    nproc_per_node: int,
    gpus_per_node: int,
    rollout_nodes: int,
    files: bool = False,
) -> tuple[Layout, RolloutSplit]:
    """Check a job of ``nnodes`` whose last ``rollout_nodes`` run rollout workers.

    The training part (``nnodes - rollout_nodes`` nodes) is checked as :func:`check_layout`
    checks a whole job, on the config with :meth:`RolloutSplit.overrides` applied before
    ``overrides`` (so ``TrainConfig``'s own checks of separate placement speak, e.g.
    ``max_staleness > 0`` needs ``loss.tis_cap``). Raises ``ValueError`` (one line, with the
    fix) when: ``rollout_nodes`` is negative or leaves no training node; the GPUs of a node
    are not a whole number of workers; ``overrides`` turn the placement back to colocated or
    the worker launch to spawn; ``rollout.num_workers`` asks for more workers than the rollout
    nodes hold, or so few that a rollout node idles; the config refuses the split. With
    ``files``, then raises :class:`ConfigError` for what :func:`check_files` finds.
    """
    from reco_megatron.config import ConfigError, load_config
    from reco_megatron.trainer.config import TrainConfig

    k = rollout_nodes
    if k < 0:
        raise ValueError(f"ROLLOUT_NODES={k}: give 0 (colocated) or a number of rollout nodes >= 1")
    if k >= nnodes:
        raise ValueError(
            f"ROLLOUT_NODES={k} of {nnodes} node(s) leaves no node to train on: request at "
            f"least {k + 1} nodes (sbatch --nodes {k + 1}) or lower ROLLOUT_NODES"
        )
    _check_counts(nnodes, nproc_per_node, gpus_per_node)
    user = list(overrides)

    def load(extra: Sequence[str]) -> Any:
        try:
            return load_config(TrainConfig, config_path, [*extra, *user])
        except ConfigError as exc:
            raise ValueError(f"ROLLOUT_NODES={k}: {_one_line(exc)}") from None

    probe = load(SEPARATE_OVERRIDES)  # the user's overrides win, so look at what they made
    roll = probe.rollout
    if roll.placement != "separate":
        raise ValueError(
            f"rollout.placement={roll.placement} with ROLLOUT_NODES={k}: the rollout nodes "
            "serve a separate placement only; drop the override, or set ROLLOUT_NODES=0"
        )
    if roll.worker_launch != "external":
        raise ValueError(
            f"rollout.worker_launch={roll.worker_launch} with ROLLOUT_NODES={k}: the job starts "
            "the workers on the rollout nodes (external); drop the override, or set "
            "ROLLOUT_NODES=0 and let the trainer spawn them"
        )
    # a separate worker is one engine on one GPU (a vLLM worker runs TP 1, docs/rollout.md)
    gpus, per_node = (0, 1) if gpus_per_node == 0 else (1, gpus_per_node)
    slots = k * per_node
    split = RolloutSplit(
        train_nodes=nnodes - k,
        rollout_nodes=k,
        workers_per_node=per_node,
        gpus_per_worker=gpus,
        num_workers=slots,
    )
    cfg = load(split.overrides())
    wanted = cfg.rollout.num_workers
    if wanted > slots or wanted <= slots - per_node:
        need = -(-wanted // per_node)
        raise ValueError(
            f"rollout.num_workers={wanted} with ROLLOUT_NODES={k} x {per_node} worker(s) per "
            f"node: give {slots - per_node + 1}..{slots} workers (every rollout node busy), "
            f"drop the override ({slots}), or set ROLLOUT_NODES={need}"
        )
    split = RolloutSplit(**{**split.__dict__, "num_workers": wanted})
    layout = layout_of(
        cfg, nnodes=nnodes - k, nproc_per_node=nproc_per_node, gpus_per_node=gpus_per_node
    )
    if files:
        check_files(cfg)
    return layout, split


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: see the module docstring. Returns the exit code."""
    parser = argparse.ArgumentParser(
        prog="python -m reco_megatron.launch_check",
        description="Check that nodes x processes fit the config's TP x PP x CP.",
    )
    parser.add_argument("--nnodes", type=int, required=True, help="nodes of the allocation")
    parser.add_argument("--nproc-per-node", type=int, required=True, help="processes per node")
    parser.add_argument(
        "--gpus-per-node", type=int, default=0, help="GPUs per node (0: a CPU run, gloo)"
    )
    parser.add_argument(
        "--quiet-environment",
        action="store_true",
        help=f"exit {EXIT_ENVIRONMENT} without a message when the project cannot be imported",
    )
    parser.add_argument(
        "--rollout-nodes",
        type=int,
        default=0,
        help="the last K nodes run rollout workers (separate placement); 0: colocated",
    )
    parser.add_argument(
        "--layout-only",
        action="store_true",
        help="check the layout alone, not the config's files, tokenizer, prompts and reward",
    )
    parser.add_argument("args", nargs="*", help="CONFIG.yaml then dotted.key=value overrides")
    ns = parser.parse_args(argv)
    try:  # everything that needs the project's dependencies (PyYAML, torch, megatron-core)
        from reco_megatron.config import ConfigError, parse_cli
        from reco_megatron.trainer import config as _train_config  # noqa: F401
        from reco_megatron.utils.noise import quiet_known_warnings
    except ImportError as exc:
        if not ns.quiet_environment:
            sys.stderr.write(f"reco launch check: environment: {environment_problem(exc)}\n")
        return EXIT_ENVIRONMENT
    quiet_known_warnings()  # the file checks import megatron-core: its notes are not problems
    try:
        config_path, overrides = parse_cli(ns.args)
        path = None if config_path is None else str(config_path)
        sizes = {
            "nnodes": ns.nnodes,
            "nproc_per_node": ns.nproc_per_node,
            "gpus_per_node": ns.gpus_per_node,
            "files": not ns.layout_only,
        }
        if ns.rollout_nodes:
            layout, split = check_split(path, overrides, rollout_nodes=ns.rollout_nodes, **sizes)
            line = f"{layout.line()} {split.line()}"
        else:
            line = check_layout(path, overrides, **sizes).line()
    except (ConfigError, ValueError) as exc:
        sys.stderr.write(f"reco launch check failed: {exc}\n")
        return EXIT_CONFIG
    sys.stdout.write(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
