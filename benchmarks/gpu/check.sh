#!/usr/bin/env bash
# shellcheck disable=SC2317  # the step_* functions are called by name, from the driver
# The device check: what reco-megatron can verify on one CUDA GPU, in one command, with no
# network; about 5-6 minutes on an H200, 9 at most (the sum of the step limits). Every step
# writes its results into OUT_DIR as it goes, so a step stopped by its limit keeps them.
#
#   bash benchmarks/gpu/check.sh [OPTIONS] OUT_DIR        # on a machine with one CUDA GPU
#   bash benchmarks/gpu/check.sh --cpu [OPTIONS] OUT_DIR  # rehearsal without a GPU: the same
#                                                         # steps, GPU tests skip, tiny sizes
# Options:
#   --only a,b,c     run these steps only (install is added when SITE does not exist)
#   --limit NAME=S   step NAME's limit in seconds instead of the table below (repeatable)
#   --export DIR     after every step, put summary.md and check.tar.gz (all of OUT_DIR) into
#                    DIR: the lent GPU machine returns at most 8 files, so pass its $OUT here
#
# Before: benchmarks/gpu/prepare_wheels.sh, where PyPI is reachable, fills the git-ignored
# .gpu-wheels/ with what the GPU image lacks; the install step puts them into SITE with
# `pip install --no-index --no-deps --no-compile --target`, and SITE goes first on PYTHONPATH.
# The machine's own Python 3.12 must have torch (>= 2.11), triton and transformers.
# Environment: PYTHON (python3), CUDA_VISIBLE_DEVICES (0), WHEELS (.gpu-wheels), SITE
# (.gpu-site), STATS_OP_SKIP (ours_compiled,ours_eager: the statistics-op methods left out;
# empty runs them all, ~1 min more for the cold torch.compile).
#
# The steps are the functions named in STEPS, run in order of value; one failing is recorded
# (status, exit code, seconds, log) and the next runs. summary.md is rendered after every
# step (benchmarks/gpu/summary.py). To add a step: write step_NAME, writing its results under
# "$OUT" as it goes (reco_megatron.utils.jsonfile), append NAME to STEPS, give it a limit in
# LIMIT (keep the sum <= 540: with 60 s more, the device tool's 600 s per command), and a
# section in summary.py.
set -uo pipefail
CALLER=$PWD
cd "$(dirname "$0")/../.." || exit 2
ROOT=$PWD
absolute() { case $1 in /*) echo "$1" ;; */*) echo "$CALLER/$1" ;; *) echo "$1" ;; esac; }

STEPS=(install environment stats_op kernel_tests trainer_tests rl_step train_throughput
  rollout_engines)
# Seconds per step on one H200, 1.4-2x the predicted durations (docs/gpu.md says how
# they were predicted); the sum, 540 s, plus 60 s is the time limit for the whole command.
# On the CPU (--cpu) the limits only catch hangs: 10x (a loaded 2-core machine is slow).
declare -A LIMIT=([install]=15 [environment]=30 [stats_op]=80 [kernel_tests]=110
  [trainer_tests]=150 [rl_step]=50 [train_throughput]=60 [rollout_engines]=45)

usage() {
  sed -n '3,14p' "$0" >&2
  exit 2
}
MODE=gpu
ONLY=""
EXPORT=""
while [ $# -gt 1 ]; do
  case $1 in
    --cpu) MODE=cpu ;;
    --only) ONLY=$2 && shift ;;
    --export) EXPORT=$(absolute "$2") && shift ;;
    --limit)
      name=${2%%=*}
      if [ -z "${LIMIT[$name]:-}" ] || ! [[ ${2#*=} =~ ^[0-9]+$ ]]; then
        echo "--limit $2: want NAME=SECONDS with NAME one of: ${STEPS[*]}" >&2
        exit 2
      fi
      LIMIT[$name]=${2#*=}
      shift
      ;;
    *) usage ;;
  esac
  shift
done
if [ $# -ne 1 ] || [ "${1:0:1}" = - ]; then usage; fi
OUT=$(absolute "$1")
[[ $OUT == */* ]] || OUT=$CALLER/$OUT
mkdir -p "$OUT" || exit 2
OUT=$(cd "$OUT" && pwd)
# paths given relative to where the command was started
PYTHON=$(absolute "${PYTHON:-python3}")
WHEELS=$(absolute "${WHEELS:-$ROOT/.gpu-wheels}")
SITE=$(absolute "${SITE:-$ROOT/.gpu-site}")
STATS_OP_SKIP=${STATS_OP_SKIP-ours_compiled,ours_eager}
if [ "$MODE" = gpu ]; then
  export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
else
  export CUDA_VISIBLE_DEVICES=""
fi
export PYTHONPATH="$SITE:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
# the image's own pytest plugins (xdist, cov, timeout, benchmark, hypothesis) stay unloaded:
# the carried pytest may not match them, and the check needs none
export PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INDEX=1
export PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
export MODE OUT PYTHON WHEELS SITE STATS_OP_SKIP # each step runs in its own bash

if [ -n "$ONLY" ]; then
  IFS=, read -ra wanted <<<"$ONLY"
  for name in "${wanted[@]}"; do
    [ -n "${LIMIT[$name]:-}" ] || { echo "--only: no step '$name' (${STEPS[*]})" >&2 && exit 2; }
  done
  [ -d "$SITE" ] || [[ ,$ONLY, == *,install,* ]] || wanted=(install "${wanted[@]}")
  STEPS=("${wanted[@]}")
fi

# ---------------------------------------------------------------- the steps
step_install() {
  shopt -s nullglob
  local wheels=("$WHEELS"/*.whl)
  shopt -u nullglob
  if [ ${#wheels[@]} -eq 0 ]; then
    echo "no wheels in $WHEELS: run benchmarks/gpu/prepare_wheels.sh where PyPI is reachable"
    echo "and carry the folder with the checkout; continuing with what the machine has"
    return 0
  fi
  rm -rf "$SITE"
  "$PYTHON" -m pip install --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" \
    "${wheels[@]}"
}

step_environment() {
  "$PYTHON" benchmarks/gpu/environment.py "$OUT/environment.json"
}

step_stats_op() {
  # the statistics op and the output layer, every method side by side in one process
  # (benchmarks/vocab_stats_gpu.py), minus STATS_OP_SKIP; rows land in the JSON per shape
  if [ "$MODE" = gpu ]; then
    "$PYTHON" benchmarks/vocab_stats.py --gpu --reps 5 --skip "$STATS_OP_SKIP" \
      --json "$OUT/stats_op.json"
  else
    TRITON_INTERPRET=1 "$PYTHON" benchmarks/vocab_stats.py --device cpu --shapes 32x512 16x300 \
      --hidden 64 --reps 1 --skip "$STATS_OP_SKIP" --json "$OUT/stats_op.json"
  fi
}

# GPU tests: every test module that uses the gpu marker (benchmarks/gpu/gpu_tests.py reads
# the sources, so a new module joins by itself); the modules that run the trainer in
# subprocesses form their own step, after the kernels. One JSON line per test as it ends.
gpu_pytest() {
  local name=$1 files
  files=$("$PYTHON" benchmarks/gpu/gpu_tests.py "${name%_tests}") || return 1
  [ -n "$files" ] || { echo "no gpu test module for $name" && return 1; }
  # shellcheck disable=SC2086  # one word per file
  "$PYTHON" -m pytest -m gpu -v -rs -p no:cacheprovider -p tests.gpu._results_plugin \
    --results-jsonl "$OUT/$name.jsonl" --junitxml "$OUT/$name.xml" $files
}

step_kernel_tests() {
  gpu_pytest kernel_tests
}

step_trainer_tests() {
  gpu_pytest trainer_tests
}

step_rl_step() {
  # 2 RL steps through the trainer; on the CPU the tiny model, saving a checkpoint too (on the
  # GPU the trainer tests save and resume)
  if [ "$MODE" = gpu ]; then
    "$PYTHON" benchmarks/gpu/rl_step.py --preset 1b --steps 2 --out "$OUT/rl_step"
  else
    "$PYTHON" benchmarks/gpu/rl_step.py --preset tiny --steps 2 --checkpoint --out "$OUT/rl_step"
  fi
}

step_train_throughput() {
  # the update of a 2-layer Llama-3.1-8B slice (bf16, distributed optimizer) at 4096 and 16384
  # tokens per sequence (and packed mixed-length documents), torch's attention against
  # megatron's local one on the same weights: tokens/s, MFU, peak memory
  if [ "$MODE" = gpu ]; then
    "$PYTHON" benchmarks/gpu/train_throughput.py --out "$OUT/train_throughput.json"
  else
    "$PYTHON" benchmarks/gpu/train_throughput.py --tiny --out "$OUT/train_throughput.json"
  fi
}

step_rollout_engines() {
  # the megatron rollout engine vs the embedded one, side by side in one process on the same
  # prompts: ~1.2B bf16, 64 prompts x G 8 x 256 new tokens, one chunk of 512 rows each (the
  # benchmark's defaults, 256 prompts and 512 new tokens, take minutes)
  if [ "$MODE" = gpu ]; then
    "$PYTHON" benchmarks/rollout_engines.py --gpu-1b --prompts 64 --max-batch-size 512 \
      --new-tokens 256 --out "$OUT/rollout_engines.json"
  else
    "$PYTHON" benchmarks/rollout_engines.py --smoke --out "$OUT/rollout_engines.json"
  fi
}

# ---------------------------------------------------------------- the driver
RUNNING=""
render() {
  "$PYTHON" benchmarks/gpu/summary.py "$OUT" >"$OUT/summary.log" 2>&1
  local rc=$?
  if [ -n "$EXPORT" ]; then
    mkdir -p "$EXPORT"
    cp "$OUT/summary.md" "$EXPORT/.summary.md.tmp" && mv "$EXPORT/.summary.md.tmp" "$EXPORT/summary.md"
    tar -czf "$EXPORT/.check.tar.gz.tmp" -C "$(dirname "$OUT")" "$(basename "$OUT")" \
      && mv "$EXPORT/.check.tar.gz.tmp" "$EXPORT/check.tar.gz"
  fi
  return $rc
}
on_signal() {
  # stopped from outside (the lent machine's time limit, Ctrl-C): stop the running step's
  # process group, record it, render what there is
  if [ -n "$RUNNING" ]; then
    kill -TERM -- "-$RUNNING" 2>/dev/null
    sleep 2
    kill -KILL -- "-$RUNNING" 2>/dev/null
    printf '{"step": "%s", "status": "killed", "exit": 143, "seconds": %d, "limit": %d}\n' \
      "$CURRENT" "$(($(date +%s) - start))" "$limit" >>"$OUT/steps.jsonl"
  fi
  render
  echo "stopped by a signal; summary: $OUT/summary.md" >&2
  exit 143
}
trap on_signal TERM INT

total=0
for name in "${STEPS[@]}"; do
  [ "$MODE" = cpu ] && LIMIT[$name]=$((LIMIT[$name] * 10))
  total=$((total + LIMIT[$name]))
done
limits=$(for name in "${STEPS[@]}"; do printf '"%s": %d, ' "$name" "${LIMIT[$name]}"; done)
printf '{"mode": "%s", "started": "%s", "commit": "%s", "host": "%s", "cuda_visible_devices": "%s", "limits": {%s}, "limit_total": %d}\n' \
  "$MODE" "$(date -u +%Y-%m-%dT%H:%M:%SZ)" "$(git rev-parse --short HEAD 2>/dev/null || echo '?')" \
  "$(hostname)" "$CUDA_VISIBLE_DEVICES" "${limits%, }" "$total" >"$OUT/check.json"
: >"$OUT/steps.jsonl"
echo "device check ($MODE mode) into $OUT: ${STEPS[*]}; limits sum to $total s" \
  "(give the whole command $((total + 60)) s)"
render

failed=0
for name in "${STEPS[@]}"; do
  limit=${LIMIT[$name]}
  CURRENT=$name
  printf '=== %s (limit %ss, %s)\n' "$name" "$limit" "$(date +%T)"
  start=$(date +%s)
  # a bash per step, under a hard limit: timeout runs it in its own process group, sends TERM
  # at the limit (exit 124) and KILL 5 s later if it still runs (exit 137)
  timeout --kill-after=5 "$limit" bash -c "$(declare -f); step_$name" \
    </dev/null >"$OUT/$name.log" 2>&1 &
  RUNNING=$!
  printf '{"step": "%s", "pgid": %d, "limit": %d}\n' "$name" "$RUNNING" "$limit" >"$OUT/running.json"
  wait "$RUNNING"
  rc=$?
  RUNNING=""
  rm -f "$OUT/running.json"
  seconds=$(($(date +%s) - start))
  case $rc in
    0) status=ok ;;
    124) status=timeout ;;
    137) status=killed ;;
    *) status=failed ;;
  esac
  [ "$status" = ok ] || failed=$((failed + 1))
  tail -n 3 "$OUT/$name.log"
  printf '%s: %s (exit %d, %d s of %d)\n' "$name" "$status" "$rc" "$seconds" "$limit"
  printf '{"step": "%s", "status": "%s", "exit": %d, "seconds": %d, "limit": %d}\n' \
    "$name" "$status" "$rc" "$seconds" "$limit" >>"$OUT/steps.jsonl"
  render || true
done

if ! render; then
  echo "summary.md: a section did not render (summary.log):" >&2
  cat "$OUT/summary.log" >&2
  failed=$((failed + 1))
fi
echo
cat "$OUT/summary.md"
echo
grep -E '^\| [a-z_]+ \| (ok|failed|timeout|killed) ' "$OUT/summary.md"
echo "summary: $OUT/summary.md ($failed of ${#STEPS[@]} steps not ok)"
exit $((failed > 0))
