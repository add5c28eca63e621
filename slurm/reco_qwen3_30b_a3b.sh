#!/bin/bash
# ReCo on Qwen3-30B-A3B (mixture of experts), nodes of 8 H100 (examples/qwen3-30b-a3b.yaml).
#
#   sbatch slurm/reco_qwen3_30b_a3b.sh                                  # 2 nodes x 8 GPUs
#   sbatch --nodes 4 slurm/reco_qwen3_30b_a3b.sh trainer.max_steps=500  # 4 nodes: DP 8
#   LAYOUT_ONLY=1 DRY_RUN=1 bash slurm/reco_qwen3_30b_a3b.sh            # print the launch line
#
# Layout (from the config): TP 4 + sequence parallel, EP 4 x expert-TP 4, DP = nodes x 2.
# Edit checkpoint.init_hf and data.* in the config (or pass them as overrides): until then the
# check (DRY_RUN=1 without LAYOUT_ONLY=1, and the job) stops on its /path/to/... placeholders,
# in one line, exit 2; LAYOUT_ONLY=1 previews the layout alone. Submit from the
# repository root. Requeued after preemption, it reuses OUTPUT_DIR (per job name) and the
# trainer resumes from OUTPUT_DIR/checkpoints/latest (same EP size). Knobs: see slurm/common.sh.
#SBATCH --job-name=reco-qwen3-30b-a3b
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=96
#SBATCH --mem=0
#SBATCH --time=12:00:00
#SBATCH --exclusive
#SBATCH --signal=B:USR1@180
#SBATCH --requeue
#SBATCH --output=slurm-%x-%j.out
set -euo pipefail

if [ -z "${RECO_ROOT:-}" ]; then
  here=$(dirname "${BASH_SOURCE[0]}")
  if [ -f "$here/common.sh" ]; then RECO_ROOT=$(cd "$here/.." && pwd); else RECO_ROOT=${SLURM_SUBMIT_DIR:-$PWD}; fi
fi
# shellcheck source=slurm/common.sh
source "$RECO_ROOT/slurm/common.sh"

CONFIG=${CONFIG:-examples/qwen3-30b-a3b.yaml}
GPUS_PER_NODE=${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-8}}
NPROC_PER_NODE=${NPROC_PER_NODE:-$GPUS_PER_NODE}
reco_launch "$@"
