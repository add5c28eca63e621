#!/bin/bash
# One task of a ROLLOUT_NODES job: `srun` starts this file once per node and each copy picks
# its role from $SLURM_NODEID. Nodes 0..TRAIN-1 exec the trainer command (torchrun over the
# training nodes); the others each start their share of rollout workers and wait for them.
#
#   bash slurm/role.sh --train-nodes 2 --workers 8 --workers-per-node 4 --gpus-per-worker 2 \
#       --worker PYTHON -m reco_megatron.rollout_worker --address RUN/rollout/address.json \
#       --trainer PYTHON -m torch.distributed.run ... -m reco_megatron.train CONFIG ...
#
# Worker ids are node-major: rollout node r (= SLURM_NODEID - TRAIN) runs ids
# r*PER_NODE .. min(WORKERS, (r+1)*PER_NODE)-1, its slot j on CUDA_VISIBLE_DEVICES entries
# j*GPUS .. j*GPUS+GPUS-1 of the node's GPUs (the task's CUDA_VISIBLE_DEVICES if Slurm set
# it, else 0..N-1); --gpus-per-worker 0 (CPU) hides the GPUs (CUDA_VISIBLE_DEVICES="").
# A worker that exits non-zero stops the node's other workers and the task exits with its
# status (srun --kill-on-bad-exit then ends the job); TERM/INT are passed on to the workers.
# DRY_RUN=1 prints the commands this node would run instead of running them.
#
# Why a file and not a function of common.sh run through `bash -c`: srun starts a plain
# script on every node (inside a container too, the repository being mounted), it lints
# clean as written (shellcheck), a test runs it with SLURM_NODEID set, and the srun line stays
# readable (no function body quoted into it).
set -euo pipefail

role_die() { printf 'reco role: error: %s\n' "$*" >&2; exit 2; }
role_log() { printf '[reco role %s node %s] %s\n' "$(date +%T)" "${SLURM_NODEID:-?}" "$*" >&2; }

train_nodes='' workers='' per_node='' gpus=''
worker_cmd=() trainer_cmd=()
while [ $# -gt 0 ]; do
  case $1 in
    --train-nodes) train_nodes=$2; shift 2 ;;
    --workers) workers=$2; shift 2 ;;
    --workers-per-node) per_node=$2; shift 2 ;;
    --gpus-per-worker) gpus=$2; shift 2 ;;
    --worker)
      shift
      while [ $# -gt 0 ] && [ "$1" != --trainer ]; do worker_cmd+=("$1"); shift; done ;;
    --trainer) shift; trainer_cmd=("$@"); break ;;
    *) role_die "unknown argument '$1' (see the header of slurm/role.sh)" ;;
  esac
done
for value in "$train_nodes" "$workers" "$per_node" "$gpus"; do
  case $value in ''|*[!0-9]*) role_die "--train-nodes, --workers, --workers-per-node and" \
    "--gpus-per-worker need whole numbers, got '$train_nodes' '$workers' '$per_node' '$gpus'" ;;
  esac
done
if [ ${#worker_cmd[@]} -eq 0 ] || [ ${#trainer_cmd[@]} -eq 0 ]; then
  role_die "give both the --worker and the --trainer command"
fi
node=${SLURM_NODEID:-}
case $node in ''|*[!0-9]*) role_die "SLURM_NODEID='$node': run this file through srun" ;; esac

if [ "$node" -lt "$train_nodes" ]; then
  if [ "${DRY_RUN:-0}" = 1 ]; then
    printf '%q ' "${trainer_cmd[@]}"
    printf '\n'
    exit 0
  fi
  exec "${trainer_cmd[@]}"
fi

first=$(( (node - train_nodes) * per_node ))
last=$(( first + per_node < workers ? first + per_node : workers ))
[ "$first" -lt "$last" ] || role_die "rollout node $node has no worker: ids run to $((workers - 1))"
devices=()
if [ "$gpus" -gt 0 ]; then
  if [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then
    IFS=, read -r -a devices <<< "$CUDA_VISIBLE_DEVICES"
  else
    for ((i = 0; i < per_node * gpus; i++)); do devices+=("$i"); done
  fi
  [ ${#devices[@]} -ge $(( (last - first) * gpus )) ] || role_die "this node has" \
    "${#devices[@]} GPU(s) (CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-unset}), its" \
    "$((last - first)) worker(s) need $gpus each"
fi

pids=() ids=()
for ((id = first; id < last; id++)); do
  slot=$(( id - first ))
  visible=''
  if [ "$gpus" -gt 0 ]; then
    visible=$(IFS=,; echo "${devices[*]:slot * gpus:gpus}")
  fi
  if [ "${DRY_RUN:-0}" = 1 ]; then
    if [ -n "$visible" ]; then printf 'CUDA_VISIBLE_DEVICES=%s ' "$visible"; else printf "CUDA_VISIBLE_DEVICES='' "; fi
    printf '%q ' "${worker_cmd[@]}" --worker-id "$id"
    printf '\n'
    continue
  fi
  CUDA_VISIBLE_DEVICES=$visible RECO_ROLLOUT_WORKER=$id \
    "${worker_cmd[@]}" --worker-id "$id" &
  pids+=("$!") ids+=("$id")
  role_log "rollout worker $id: pid $! on CUDA_VISIBLE_DEVICES='$visible'"
done
[ "${DRY_RUN:-0}" = 1 ] && exit 0

stop_workers() {
  local pid
  for pid in ${pids[@]+"${pids[@]}"}; do kill -s "$1" "$pid" 2>/dev/null || true; done
}
trap 'role_log "got TERM: passing it on to the workers"; stop_workers TERM' TERM
trap 'role_log "got INT: passing it on to the workers"; stop_workers INT' INT
# Poll rather than `wait -n`: a trapped signal also ends `wait -n` with a status > 128, which
# bash before 5.1 cannot tell apart from a worker killed by a signal.
while [ ${#pids[@]} -gt 0 ]; do
  for i in "${!pids[@]}"; do
    kill -0 "${pids[$i]}" 2>/dev/null && continue
    rc=0
    wait "${pids[$i]}" || rc=$?
    if [ "$rc" != 0 ]; then
      role_log "rollout worker ${ids[$i]} exited with status $rc: stopping this node's others"
      unset 'pids[i]'
      stop_workers TERM
      wait || true
      exit "$rc"
    fi
    role_log "rollout worker ${ids[$i]} finished"
    unset 'pids[i]' 'ids[i]'
  done
  sleep 1 & wait $! || true
done
