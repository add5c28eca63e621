# shellcheck shell=bash
# Shared by the reco-megatron Slurm scripts (sourced, not run). No training logic: it resolves
# the allocation, checks the layout and the config's files with `python -m
# reco_megatron.launch_check` (the trainer's pre-flight, without the world), then starts one
# `torchrun` per node with `srun` (optionally inside a pyxis/enroot container) and forwards
# preemption signals to it. Every knob is an environment variable with a default:
#
#   CONFIG           YAML config passed to the trainer (set by the calling script)
#   OUTPUT_DIR       trainer.output_dir; kept per job name so a requeued job resumes from
#                    $OUTPUT_DIR/checkpoints/latest (default: $RECO_ROOT/runs/$SLURM_JOB_NAME)
#   NPROC_PER_NODE   processes per node (default: GPUS_PER_NODE, or 1 on CPU)
#   GPUS_PER_NODE    GPUs per node (default: $SLURM_GPUS_ON_NODE, else 0 = CPU/gloo)
#   CONTAINER_IMAGE  pyxis image (e.g. nvcr.io#nvidia/pytorch:25.04-py3); empty = no container
#   CONTAINER_MOUNTS pyxis mounts (default: the repo, and OUTPUT_DIR's parent)
#   PYTHON           the interpreter (default: the active virtual environment's, else the
#                    repository's .venv/bin/python, else python3 on PATH; inside a container:
#                    python). It must import torch and the project's dependencies: when it
#                    cannot, the scripts say so and exit 69, apart from a layout that does not
#                    fit the config, which exits 2.
#   RDZV_PORT        c10d rendezvous port on the head node (default: 29500 + job id % 1000)
#   DRY_RUN=1        print the srun/torchrun command line instead of running it
#   NNODES           nodes of a dry run outside Slurm (default: the script's #SBATCH --nodes)
#   LAUNCH_CHECK=0   skip the layout check (not recommended)
#   LAYOUT_ONLY=1    check the layout alone: not the config's files (the examples' /path/to/...
#                    placeholders, missing paths, the tokenizer, prompt lengths, the reward's
#                    import and trial call, the initial checkpoint), which the check otherwise
#                    runs as the trainer's pre-flight would. For a preview of a config whose
#                    files are not set yet, or not visible from this host.
#   REQUEUE_ON_TIMEOUT=0  do not `scontrol requeue` after the time-limit warning (USR1)
#   FORWARD_SIGNAL   signal sent to the srun step when the batch shell gets USR1/TERM (TERM)
#   ROLLOUT_NODES=k  the last k nodes generate, the others train (separate placement; default
#                    0: colocated, every node trains and generates). One srun over all nodes
#                    runs slurm/role.sh, which picks each node's role from SLURM_NODEID; the
#                    trainer gets rollout.placement=separate rollout.worker_launch=external
#                    rollout.num_workers=<slots> before the user's overrides. Needs the layout
#                    check (it sizes the workers from the config's TP) and an OUTPUT_DIR that
#                    every node sees (the workers find the trainer in OUTPUT_DIR/rollout/).
#   ROLLOUT_CONNECT_TIMEOUT  seconds a rollout worker waits for the trainer to publish its
#                    address (default 1800: the trainer loads its model first)

reco_log() { printf '[reco %s] %s\n' "$(date +%T)" "$*" >&2; }
reco_die() { printf 'reco: error: %s\n' "$*" >&2; exit 1; }

# Exit status of the launch scripts, before anything is submitted or started:
RECO_EXIT_CONFIG=2        # the config is invalid or the layout does not fit it (the fix is printed)
RECO_EXIT_ENVIRONMENT=69  # no interpreter that can run the project (sysexits EX_UNAVAILABLE)
reco_env_die() { printf 'reco: environment: %s\n' "$*" >&2; exit "$RECO_EXIT_ENVIRONMENT"; }

# RECO_PYTHON: the interpreter for the layout check (and the trainer, without a container):
# $PYTHON, else the active virtual environment, else the repository's .venv, else python3.
reco_find_python() {
  local how
  if [ -n "${PYTHON:-}" ]; then
    RECO_PYTHON=$PYTHON how="PYTHON"
  elif [ -n "${VIRTUAL_ENV:-}" ] && [ -x "$VIRTUAL_ENV/bin/python" ]; then
    RECO_PYTHON=$VIRTUAL_ENV/bin/python how="the active virtual environment"
  elif [ -x "$RECO_ROOT/.venv/bin/python" ]; then
    RECO_PYTHON=$RECO_ROOT/.venv/bin/python how="the repository's .venv"
  else
    RECO_PYTHON=$(command -v python3 || command -v python || true) how="PATH"
  fi
  if [ -z "$RECO_PYTHON" ] || ! command -v "$RECO_PYTHON" >/dev/null; then
    reco_env_die "no Python interpreter found (${how}: '${RECO_PYTHON}'): create the project's" \
      "environment (README, 'Fresh machine') and activate it, or set PYTHON=/path/to/venv/bin/python"
  fi
  RECO_PYTHON_FROM=$how
}

# The calling script's `#SBATCH --nodes=N` (1 when it has none).
reco_script_nodes() {
  local n
  n=$(sed -n 's/^#SBATCH --nodes=\([0-9][0-9]*\)[[:space:]]*$/\1/p' "$0" 2>/dev/null | head -n 1)
  echo "${n:-1}"
}

# The allocation: nodes, head node, job id. Outside Slurm (a dry run on a laptop) the nodes
# come from NNODES, else from the script's own #SBATCH --nodes line.
reco_allocation() {
  NNODES=${SLURM_NNODES:-${SLURM_JOB_NUM_NODES:-${NNODES:-$(reco_script_nodes)}}}
  JOB_ID=${SLURM_JOB_ID:-0}
  if [ -n "${SLURM_JOB_NODELIST:-}" ]; then
    HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
  else
    HEAD_NODE=$(hostname)
  fi
  [ -n "$HEAD_NODE" ] || reco_die "cannot resolve the head node from SLURM_JOB_NODELIST=${SLURM_JOB_NODELIST:-}"
  RDZV_PORT=${RDZV_PORT:-$((29500 + JOB_ID % 1000))}
  GPUS_PER_NODE=${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-0}}
  if [ "$GPUS_PER_NODE" -gt 0 ]; then
    NPROC_PER_NODE=${NPROC_PER_NODE:-$GPUS_PER_NODE}
  else
    NPROC_PER_NODE=${NPROC_PER_NODE:-1}
  fi
}

# The environment NCCL / OpenMP / megatron users expect; anything already set wins.
reco_export_env() {
  local cpus=${SLURM_CPUS_PER_TASK:-$(nproc)}
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( cpus / NPROC_PER_NODE > 0 ? cpus / NPROC_PER_NODE : 1 ))}
  export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
  export PYTHONUNBUFFERED=1
  if [ "$GPUS_PER_NODE" -gt 0 ]; then
    # megatron overlaps TP communication with compute only with one hardware queue.
    export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
    export NCCL_IB_DISABLE=${NCCL_IB_DISABLE:-0}
    export NCCL_IB_TIMEOUT=${NCCL_IB_TIMEOUT:-22}
    export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
    export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
  fi
}

# Build RECO_CMD: srun [container] torchrun ... -m reco_megatron.train CONFIG overrides...
# With ROLLOUT_NODES: srun [container] bash slurm/role.sh <split> --worker ... --trainer
# torchrun (over the training nodes) ... separate-placement overrides, then the user's.
reco_build_command() {
  local python=$RECO_PYTHON
  [ -n "${CONTAINER_IMAGE:-}" ] && python=${PYTHON:-python}  # the container's interpreter
  RECO_CMD=(srun --nodes="$NNODES" --ntasks-per-node=1 --kill-on-bad-exit=1)
  if [ -n "${CONTAINER_IMAGE:-}" ]; then
    local mounts=${CONTAINER_MOUNTS:-$RECO_ROOT:$RECO_ROOT,$(dirname "$OUTPUT_DIR"):$(dirname "$OUTPUT_DIR")}
    RECO_CMD+=(--container-image="$CONTAINER_IMAGE" --container-mounts="$mounts"
      --container-workdir="$RECO_ROOT")
  fi
  local train_nodes=$NNODES split=()
  if [ "$ROLLOUT_NODES" != 0 ]; then
    train_nodes=$RECO_TRAIN_NODES
    RECO_CMD+=(bash "$RECO_ROOT/slurm/role.sh" --train-nodes "$RECO_TRAIN_NODES"
      --workers "$RECO_WORKERS" --workers-per-node "$RECO_WORKERS_PER_NODE"
      --gpus-per-worker "$RECO_WORKER_GPUS"
      --worker "$python" -m reco_megatron.rollout_worker
      --address "$OUTPUT_DIR/rollout/address.json"
      --connect-timeout "${ROLLOUT_CONNECT_TIMEOUT:-1800}" --trainer)
    # The user's overrides come after these and win; launch_check refused the unsafe ones.
    split=(rollout.placement=separate rollout.worker_launch=external
      "rollout.num_workers=$((ROLLOUT_NODES * RECO_WORKERS_PER_NODE))")
  fi
  RECO_CMD+=("$python" -m torch.distributed.run
    --nnodes "$train_nodes" --nproc-per-node "$NPROC_PER_NODE"
    --rdzv-backend c10d --rdzv-endpoint "$HEAD_NODE:$RDZV_PORT" --rdzv-id "$JOB_ID"
    --max-restarts 0
    -m reco_megatron.train "$CONFIG" "trainer.output_dir=$OUTPUT_DIR" ${split[@]+"${split[@]}"} "$@")
}

# Fail fast when nodes x processes do not fit the config's TP x PP x CP, or the config's files,
# tokenizer, prompts or reward would stop the trainer's pre-flight (logic in Python; the files
# are skipped with LAYOUT_ONLY=1). Exit 2 when they do not fit (or the config is invalid), 69
# when no interpreter here or in the container can run the check (not the project's environment).
reco_check_layout() {
  if [ "${LAUNCH_CHECK:-1}" = 0 ]; then
    [ "$ROLLOUT_NODES" = 0 ] && return 0
    printf 'reco: error: ROLLOUT_NODES=%s needs the layout check (it sizes the rollout workers from the config): drop LAUNCH_CHECK=0\n' "$ROLLOUT_NODES" >&2
    exit "$RECO_EXIT_CONFIG"
  fi
  local check=(--nnodes "$NNODES" --nproc-per-node "$NPROC_PER_NODE"
    --gpus-per-node "$GPUS_PER_NODE")
  [ "$ROLLOUT_NODES" = 0 ] || check+=(--rollout-nodes "$ROLLOUT_NODES")
  local checked="files, tokenizer, prompts and reward checked"
  if [ "${LAYOUT_ONLY:-0}" = 1 ]; then
    check+=(--layout-only)
    checked="LAYOUT_ONLY=1: the config's files, tokenizer, prompts and reward not checked"
  fi
  check+=("$CONFIG" "$@")
  local layout rc=0 quiet=()
  # With a container the job does not need a local environment: ask the check not to explain.
  [ -n "${CONTAINER_IMAGE:-}" ] && quiet=(--quiet-environment)
  layout=$(cd "$RECO_ROOT" \
    && "$RECO_PYTHON" -m reco_megatron.launch_check "${quiet[@]}" "${check[@]}") || rc=$?
  if [ "$rc" = "$RECO_EXIT_ENVIRONMENT" ] && [ -n "${CONTAINER_IMAGE:-}" ]; then
    if [ "${DRY_RUN:-0}" = 1 ] && [ "$ROLLOUT_NODES" != 0 ]; then
      reco_env_die "ROLLOUT_NODES=$ROLLOUT_NODES sizes the rollout workers through the layout" \
        "check, which $RECO_PYTHON ($RECO_PYTHON_FROM) cannot run here and a dry run does not" \
        "start $CONTAINER_IMAGE: set PYTHON=/path/to/venv/bin/python for the preview"
    fi
    if [ "${DRY_RUN:-0}" = 1 ]; then
      reco_log "layout check skipped: $RECO_PYTHON ($RECO_PYTHON_FROM) cannot import the" \
        "project's dependencies here, and a dry run does not start $CONTAINER_IMAGE"
      return 0
    fi
    rc=0
    layout=$(srun --nodes=1 --ntasks=1 --container-image="$CONTAINER_IMAGE" \
      --container-mounts="${CONTAINER_MOUNTS:-$RECO_ROOT:$RECO_ROOT}" \
      --container-workdir="$RECO_ROOT" "${PYTHON:-python}" -m reco_megatron.launch_check \
      "${check[@]}") || rc=$?
  fi
  case $rc in
    0) ;;
    "$RECO_EXIT_CONFIG") exit "$RECO_EXIT_CONFIG" ;;  # the check printed the problem and the fix
    "$RECO_EXIT_ENVIRONMENT") exit "$RECO_EXIT_ENVIRONMENT" ;;  # it printed what is missing
    *) reco_env_die "the layout check could not run under $RECO_PYTHON ($RECO_PYTHON_FROM)," \
         "exit $rc: is it the project's environment? Set PYTHON=/path/to/venv/bin/python" ;;
  esac
  if [ "$ROLLOUT_NODES" = 0 ]; then
    reco_log "layout: $layout on $NNODES node(s) x $NPROC_PER_NODE process(es) ($checked)"
    return 0
  fi
  reco_parse_split "$layout"
  reco_log "layout: ${layout%% TRAIN_NODES=*} on $RECO_TRAIN_NODES training node(s) x" \
    "$NPROC_PER_NODE process(es) ($checked)"
  local where="of $RECO_WORKER_GPUS GPU(s)"
  [ "$RECO_WORKER_GPUS" = 0 ] && where="on the CPU"
  reco_log "split: $RECO_TRAIN_NODES training node(s) x $NPROC_PER_NODE process(es)," \
    "$ROLLOUT_NODES rollout node(s) x $RECO_WORKERS_PER_NODE worker(s) $where" \
    "($RECO_WORKERS worker(s), ids node-major)"
}

# RECO_TRAIN_NODES, RECO_WORKERS, RECO_WORKERS_PER_NODE, RECO_WORKER_GPUS from the check's
# success line (`... TRAIN_NODES=2 ROLLOUT_NODES=2 WORKERS=8 WORKERS_PER_NODE=4 WORKER_GPUS=2`).
reco_parse_split() {
  local token
  RECO_TRAIN_NODES='' RECO_WORKERS='' RECO_WORKERS_PER_NODE='' RECO_WORKER_GPUS=''
  for token in $1; do
    case $token in
      TRAIN_NODES=*) RECO_TRAIN_NODES=${token#*=} ;;
      WORKERS=*) RECO_WORKERS=${token#*=} ;;
      WORKERS_PER_NODE=*) RECO_WORKERS_PER_NODE=${token#*=} ;;
      WORKER_GPUS=*) RECO_WORKER_GPUS=${token#*=} ;;
    esac
  done
  if [ -z "$RECO_TRAIN_NODES" ] || [ -z "$RECO_WORKERS" ] || [ -z "$RECO_WORKERS_PER_NODE" ] \
    || [ -z "$RECO_WORKER_GPUS" ]; then
    reco_die "the layout check did not size the split: '$1'"
  fi
}

# Forward USR1 (the --signal warning before the time limit) and TERM (preemption) to the
# srun step, so torchrun passes it on to the trainer processes, which may checkpoint.
reco_forward_signal() {
  [ "$1" = USR1 ] && RECO_GOT_USR1=1
  reco_log "got $1: sending ${FORWARD_SIGNAL:-TERM} to the training step (pid $RECO_SRUN_PID)"
  kill -s "${FORWARD_SIGNAL:-TERM}" "$RECO_SRUN_PID" 2>/dev/null || true
}

# The whole launch: allocation, env, check, then run (or print, with DRY_RUN=1).
reco_launch() {
  [ -n "${CONFIG:-}" ] || reco_die "CONFIG is empty: CONFIG=examples/<model>.yaml sbatch ..."
  if ! [ -f "$RECO_ROOT/$CONFIG" ] && ! [ -f "$CONFIG" ]; then
    printf 'reco: error: config %s not found (relative paths are from %s)\n' "$CONFIG" \
      "$RECO_ROOT" >&2
    exit "$RECO_EXIT_CONFIG"
  fi
  ROLLOUT_NODES=${ROLLOUT_NODES:-0}
  case $ROLLOUT_NODES in
    ''|*[!0-9]*)
      printf 'reco: error: ROLLOUT_NODES=%s: give a whole number of rollout nodes (0: colocated)\n' \
        "$ROLLOUT_NODES" >&2
      exit "$RECO_EXIT_CONFIG" ;;
  esac
  ROLLOUT_NODES=$((10#$ROLLOUT_NODES))
  reco_find_python
  reco_allocation
  OUTPUT_DIR=${OUTPUT_DIR:-$RECO_ROOT/runs/${SLURM_JOB_NAME:-reco}}
  reco_export_env
  reco_check_layout "$@"
  reco_build_command "$@"
  if [ "${DRY_RUN:-0}" = 1 ]; then
    printf '%q ' "${RECO_CMD[@]}"
    printf '\n'
    return 0
  fi
  if [ "${SLURM_RESTART_COUNT:-0}" -gt 0 ]; then
    reco_log "requeue #$SLURM_RESTART_COUNT: the trainer resumes from $OUTPUT_DIR/checkpoints/latest"
  fi
  mkdir -p "$OUTPUT_DIR"
  reco_log "output dir $OUTPUT_DIR; head node $HEAD_NODE:$RDZV_PORT"
  cd "$RECO_ROOT" || reco_die "cannot cd to $RECO_ROOT"
  "${RECO_CMD[@]}" &
  RECO_SRUN_PID=$!
  trap 'reco_forward_signal USR1' USR1
  trap 'reco_forward_signal TERM' TERM
  local rc=0
  # wait returns early (> 128) when a trapped signal arrives: wait again for the step.
  while true; do
    wait "$RECO_SRUN_PID" && rc=0 || rc=$?
    kill -0 "$RECO_SRUN_PID" 2>/dev/null || break
  done
  reco_log "training step exited with code $rc"
  # Time limit ahead (USR1 from --signal): requeue so the next run resumes from the checkpoint.
  if [ "${RECO_GOT_USR1:-0}" = 1 ] && [ "${REQUEUE_ON_TIMEOUT:-1}" = 1 ] && [ "$JOB_ID" != 0 ]; then
    reco_log "requeueing job $JOB_ID (REQUEUE_ON_TIMEOUT=0 disables)"
    scontrol requeue "$JOB_ID" || reco_log "scontrol requeue failed: resubmit with the same OUTPUT_DIR"
  fi
  return "$rc"
}
