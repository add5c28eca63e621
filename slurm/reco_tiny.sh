#!/bin/bash
# The embedded default on CPU (gloo): a tiny Llama-style model, the countdown task, minutes.
# Used by CI against a one-node Slurm on localhost (tests/launch/test_slurm_cluster.py).
#
#   sbatch slurm/reco_tiny.sh                                    # 1 process
#   sbatch slurm/reco_tiny.sh trainer.max_steps=2 sft.steps=2    # overrides go to the trainer
#   NPROC_PER_NODE=2 sbatch --cpus-per-task=2 slurm/reco_tiny.sh parallel.tensor_model_parallel_size=2
#   DRY_RUN=1 bash slurm/reco_tiny.sh
#
# PYTHON picks the interpreter (default: the active venv, else .venv/bin/python). Knobs:
# slurm/common.sh.
#SBATCH --job-name=reco-tiny
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task=1
#SBATCH --time=00:30:00
#SBATCH --signal=B:USR1@60
#SBATCH --requeue
#SBATCH --output=slurm-%x-%j.out
set -euo pipefail

if [ -z "${RECO_ROOT:-}" ]; then
  here=$(dirname "${BASH_SOURCE[0]}")
  if [ -f "$here/common.sh" ]; then RECO_ROOT=$(cd "$here/.." && pwd); else RECO_ROOT=${SLURM_SUBMIT_DIR:-$PWD}; fi
fi
# shellcheck source=slurm/common.sh
source "$RECO_ROOT/slurm/common.sh"

CONFIG=${CONFIG:-examples/tiny_cpu.yaml}
GPUS_PER_NODE=${GPUS_PER_NODE:-0}
reco_launch "$@"
