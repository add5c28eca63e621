"""ReCo RL post-training on megatron-core: the entry point.

Run it::

    # 1 CPU process, the embedded tiny default (examples/tiny_cpu.yaml): ~minutes on 2 cores
    python -m reco_megatron.train examples/tiny_cpu.yaml

    # 2 CPU processes, tensor parallel 2 (gloo): reco-train starts and watches them itself
    python -m reco_megatron.train --nproc-per-node 2 examples/tiny_cpu.yaml \\
        parallel.tensor_model_parallel_size=2

    # 1 node of 8 GPUs (nccl), Llama-3.1-8B-Instruct
    torchrun --nproc-per-node 8 -m reco_megatron.train examples/llama3.1-8b-instruct.yaml

    # N nodes: sbatch --nodes N slurm/reco_llama8b.sh   (srun + torchrun per node)

Arguments: a YAML config, then ``section.key=value`` overrides (``--help-config`` lists every
key with its type, default and meaning). The console script ``reco-train`` is the same.
``--nproc-per-node N`` starts N local ranks the way ``torchrun`` would and answers like one
process (:mod:`reco_megatron.launcher`): a bad config is one message and exit 2, not
torchrun's ``ChildFailedError``.

Exit status: 0 done; 2 invalid configuration, unusable checkpoint, or the output directory is
in use by another trainer; 3 stopped by a stability guard or because more than
``reward.max_failed_frac`` of a step's rewards failed; 75 stopped by SIGTERM, SIGUSR1 or
Ctrl-C after saving a checkpoint, or by a second Ctrl-C at once (run the same command again
to resume; docs/stability.md).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from reco_megatron.config import (
    USAGE,
    ConfigError,
    HelpRequested,
    describe_config,
    load_config,
    parse_cli,
)
from reco_megatron.config.cli import HELP_FLAGS
from reco_megatron.launcher import check_then_launch, split_nproc
from reco_megatron.utils.logging import get_logger
from reco_megatron.utils.noise import quiet_known_warnings

if TYPE_CHECKING:
    from reco_megatron.trainer.config import TrainConfig
    from reco_megatron.trainer.lifecycle import StopSignals

logger = get_logger(__name__)

EXIT_BAD_CONFIG = 2
"""Exit status of a configuration that cannot run (reported before any compute)."""


def _report(kind: str, exc: Exception) -> None:
    """One message on stderr, written once per node (local rank 0: every rank ran the same
    checks on the same files, so the other ranks would repeat it), no traceback."""
    if os.environ.get("LOCAL_RANK", "0") != "0":
        return
    problems = getattr(exc, "problems", None) or [str(exc)]
    if len(problems) == 1:
        sys.stderr.write(f"reco-train: {kind}: {problems[0]}\n")
    else:
        lines = "".join(f"  - {p}\n" for p in problems)
        sys.stderr.write(f"reco-train: {kind} ({len(problems)} problems):\n{lines}")


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the command line, build the :class:`Trainer`, run it. Returns the exit code."""
    quiet_known_warnings()  # before megatron-core and torch's extensions are imported
    from reco_megatron.trainer.config import TrainConfig

    args = list(sys.argv[1:] if argv is None else argv)
    try:
        nproc, args = split_nproc(args)
    except ValueError as exc:
        _report("invalid command line", exc)
        return EXIT_BAD_CONFIG
    if not args:  # the bare defaults are a reference, not a run (their task needs a file's keys)
        _report(
            "no config given",
            ValueError(
                "pass one, e.g. python -m reco_megatron.train examples/tiny_cpu.yaml "
                "(--help-config lists every key; README, 'Fresh machine: quick start')"
            ),
        )
        return EXIT_BAD_CONFIG
    if nproc is not None and not any(arg in HELP_FLAGS for arg in args):
        return check_then_launch(nproc, args, _report)
    try:
        config_path, overrides = parse_cli(args)
        cfg = load_config(TrainConfig, config_path, overrides)
    except HelpRequested:
        sys.stdout.write(f"{USAGE}\n\n{__doc__.split(chr(10))[0]}\n\n")
        sys.stdout.write(describe_config(TrainConfig) + "\n")
        return 0
    except ConfigError as exc:
        _report("invalid configuration", exc)
        return EXIT_BAD_CONFIG
    from reco_megatron.trainer.lifecycle import StopSignals

    signals = StopSignals()  # installed after the pre-flight, kept until main returns
    try:
        return _train(cfg, signals)
    finally:
        signals.restore()  # main may be called in-process (tests, notebooks)


def _train(cfg: TrainConfig, signals: StopSignals) -> int:
    """Build the trainer and run it; the exit status (see the module doc)."""
    from reco_megatron.megatron import CheckpointError
    from reco_megatron.rewards.registry import RewardSpecError
    from reco_megatron.trainer.lifecycle import (
        RunAborted,
        RunLockError,
        StabilityStop,
        report_abort,
    )
    from reco_megatron.trainer.loop import Trainer
    from reco_megatron.trainer.reporting import process_seconds, summary_lines

    try:
        trainer = Trainer(cfg, signals)
    except (ConfigError, RewardSpecError) as exc:  # pre-flight, resume diff, reward self-check
        _report("invalid configuration", exc)
        return EXIT_BAD_CONFIG
    except CheckpointError as exc:  # the checkpoint to resume or start from cannot be used
        _report("unusable checkpoint", exc)
        return EXIT_BAD_CONFIG
    except RunLockError as exc:
        _report("output directory in use", exc)
        return EXIT_BAD_CONFIG
    except RunAborted:
        return report_abort(cfg.trainer.output_dir, int(os.environ.get("RANK", "0")))
    first_step = trainer.step
    if (since_start := process_seconds()) is not None:  # imports and set-up (SFT runs later)
        trainer.phases["startup"] = since_start
    try:
        status = trainer.run()
    except StabilityStop as exc:
        logger.error("%s", exc)
        return 3
    except RunAborted:
        return report_abort(cfg.trainer.output_dir, trainer.rank)
    if status == 0 and trainer.rank == 0:
        for line in summary_lines(
            trainer.out, trainer.phases, first_step=first_step, total_s=process_seconds()
        ):
            logger.info("%s", line)
    return status


if __name__ == "__main__":
    sys.exit(main())
