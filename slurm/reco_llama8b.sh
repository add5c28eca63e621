#!/bin/bash
# ReCo on Llama-3.1-8B-Instruct, nodes of 8 H100 (examples/llama3.1-8b-instruct.yaml).
#
#   sbatch slurm/reco_llama8b.sh                                 # 1 node x 8 GPUs
#   sbatch --nodes 4 slurm/reco_llama8b.sh trainer.max_steps=500 # 4 nodes, data parallel 32
#   CONTAINER_IMAGE=nvcr.io#nvidia/pytorch:25.04-py3 sbatch slurm/reco_llama8b.sh
#   DRY_RUN=1 bash slurm/reco_llama8b.sh             # check all, print the srun/torchrun line
#   LAYOUT_ONLY=1 DRY_RUN=1 bash slurm/reco_llama8b.sh   # the layout alone (files not checked)
#   ROLLOUT_NODES=2 sbatch --nodes 4 slurm/reco_llama8b.sh loss.tis_cap=2.0  # 2 train, 2 generate
#   SLURM_NNODES=4 ROLLOUT_NODES=2 LAYOUT_ONLY=1 DRY_RUN=1 bash slurm/reco_llama8b.sh loss.tis_cap=2.0
#
# Edit checkpoint.init_hf and data.* in the config (or pass them as overrides): until then the
# dry run (and a submitted job) stops at once on the config's /path/to/... placeholders, in one
# line, exit 2; LAYOUT_ONLY=1 previews the layout without them. Submit from the
# repository root. Requeued after preemption, it reuses OUTPUT_DIR (per job name) and the
# trainer resumes from OUTPUT_DIR/checkpoints/latest. Knobs: see slurm/common.sh.
#SBATCH --job-name=reco-llama8b
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=96
#SBATCH --mem=0
#SBATCH --time=08:00:00
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

CONFIG=${CONFIG:-examples/llama3.1-8b-instruct.yaml}
GPUS_PER_NODE=${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-8}}
NPROC_PER_NODE=${NPROC_PER_NODE:-$GPUS_PER_NODE}
reco_launch "$@"
