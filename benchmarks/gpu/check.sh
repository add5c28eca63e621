#!/usr/bin/env bash
# shellcheck disable=SC2317  # the step_* functions are called by name, from the driver
# The device check: everything reco-megatron can verify on one CUDA GPU, in one command, with
# no network, in under 5 minutes. Every result lands in OUT_DIR (JSON + markdown + logs).
#
#   bash benchmarks/gpu/check.sh OUT_DIR          # on a machine with one CUDA GPU
#   bash benchmarks/gpu/check.sh --cpu OUT_DIR    # rehearsal on a CPU machine: the same steps,
#                                                 # GPU tests skip, benchmarks at tiny sizes
#
# Before: run benchmarks/gpu/prepare_wheels.sh on a machine with PyPI access (it fills the
# git-ignored .gpu-wheels/); the wheels are installed here with
# `pip install --no-index --no-deps --target .gpu-site`, and .gpu-site goes first on PYTHONPATH.
# The machine's own Python (3.12) must have torch (2.11 or later), triton and transformers.
# Environment: PYTHON (default python3), CUDA_VISIBLE_DEVICES (default 0), WHEELS (default
# .gpu-wheels), SITE (default .gpu-site).
#
# The steps are the functions named in STEPS, run in order; one failing is recorded (status,
# exit code, seconds, log) and the next runs. To add a step: write step_NAME (writing its
# results under "$OUT"), append NAME to STEPS, and give it a time limit in LIMIT.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 2
ROOT=$PWD

MODE=gpu
if [ "${1:-}" = "--cpu" ]; then
  MODE=cpu
  shift
fi
if [ $# -ne 1 ]; then
  sed -n '3,9p' "$0" >&2
  exit 2
fi
mkdir -p "$1" || exit 2
OUT=$(cd "$1" && pwd)
PYTHON=${PYTHON:-python3}
WHEELS=${WHEELS:-$ROOT/.gpu-wheels}
SITE=${SITE:-$ROOT/.gpu-site}
if [ "$MODE" = gpu ]; then
  export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
else
  export CUDA_VISIBLE_DEVICES=""
fi
export PYTHONPATH="$SITE:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INDEX=1
export MODE OUT PYTHON WHEELS SITE  # each step runs in its own bash under `timeout`

STEPS=(install environment gpu_tests stats_op rl_step rollout_engines)
# seconds per step on the GPU machine (sum: 5 min at most); the CPU rehearsal gets 3x
declare -A LIMIT=([install]=15 [environment]=15 [gpu_tests]=115 [stats_op]=60 [rl_step]=55
  [rollout_engines]=40)

# ---------------------------------------------------------------- the steps
step_install() {
  shopt -s nullglob
  local wheels=("$WHEELS"/*.whl)
  shopt -u nullglob
  if [ ${#wheels[@]} -eq 0 ]; then
    echo "no wheels in $WHEELS: run benchmarks/gpu/prepare_wheels.sh where PyPI is reachable"
    echo "(continuing with what the machine has)"
    return 0
  fi
  rm -rf "$SITE"
  "$PYTHON" -m pip install --no-index --no-deps --target "$SITE" "${wheels[@]}"
}

step_environment() {
  "$PYTHON" - "$OUT/environment.json" <<'PY'
import importlib, json, platform, sys

import torch

out = {"python": sys.version.split()[0], "platform": platform.platform(), "torch": torch.__version__,
       "cuda_available": torch.cuda.is_available(), "torch_cuda": torch.version.cuda}
if torch.cuda.is_available():
    props = torch.cuda.get_device_properties(0)
    out.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1),
               capability=f"{props.major}.{props.minor}")
missing = []
for module in ("megatron.core", "transformers", "triton", "safetensors", "yaml", "numpy",
               "psutil", "sentencepiece", "pyarrow", "math_verify", "matplotlib", "tqdm",
               "pytest", "liger_kernel", "transformer_engine"):
    try:
        mod = importlib.import_module(module)
        out[module] = getattr(mod, "__version__", "?")
    except Exception as exc:  # report, do not stop: later steps say what it breaks
        out[module] = None
        missing.append(f"{module} ({type(exc).__name__}: {exc})")
out["not_importable"] = missing
json.dump(out, open(sys.argv[1], "w"), indent=1)
print(json.dumps(out, indent=1))
PY
}

step_gpu_tests() {
  "$PYTHON" -m pytest -m gpu tests -rs -p no:cacheprovider --junitxml "$OUT/gpu_tests.xml"
}

step_stats_op() {
  # every method side by side in one process (benchmarks/vocab_stats_gpu.py): ours (Triton in
  # place and not, compiled, eager), megatron CE, F.cross_entropy, Liger CE / fused-linear CE
  # when liger-kernel is installed, and the fused output layer at H 4096; the copy-bandwidth
  # bound is measured in the same run
  if [ "$MODE" = gpu ]; then
    "$PYTHON" benchmarks/vocab_stats.py --gpu --shapes 8192x128256 32768x128256 --reps 5 \
      --json "$OUT/stats_op.json"
  else
    TRITON_INTERPRET=1 "$PYTHON" benchmarks/vocab_stats.py --device cpu --shapes 32x512 16x300 \
      --hidden 64 --reps 1 --json "$OUT/stats_op.json"
  fi
}

step_rl_step() {
  local preset=1b
  [ "$MODE" = cpu ] && preset=tiny
  "$PYTHON" benchmarks/gpu/rl_step.py --preset "$preset" --steps 2 --out "$OUT/rl_step"
}

step_rollout_engines() {
  # the megatron rollout engine vs the embedded one, side by side in one process:
  # ~1.2B bf16, 256 prompts x G 8 (the embedded engine: the first 32 prompts), 256 new tokens
  # to fit the check's 5 minutes (the full 512: --new-tokens 512 in a longer run)
  if [ "$MODE" = gpu ]; then
    "$PYTHON" benchmarks/rollout_engines.py --gpu-1b --new-tokens 256 \
      --out "$OUT/rollout_engines.json"
  else
    "$PYTHON" benchmarks/rollout_engines.py --smoke --out "$OUT/rollout_engines.json"
  fi
}

# ---------------------------------------------------------------- the driver
SUMMARY=$OUT/summary.md
{
  echo "# reco-megatron device check ($MODE mode)"
  echo
  echo "$(date -u +%Y-%m-%dT%H:%M:%SZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')," \
    "host $(hostname), CUDA_VISIBLE_DEVICES='$CUDA_VISIBLE_DEVICES'"
  echo
  echo "| step | status | exit | seconds | log |"
  echo "|---|---|---|---|---|"
} >"$SUMMARY"
: >"$OUT/steps.jsonl"
failed=0
for name in "${STEPS[@]}"; do
  limit=${LIMIT[$name]:-60}
  [ "$MODE" = cpu ] && limit=$((limit * 3))
  printf '=== %s (limit %ss)\n' "$name" "$limit"
  start=$(date +%s)
  # a subshell per step, under a hard time limit (exit 124 when it runs out)
  timeout --kill-after=10 "$limit" bash -c "$(declare -f "step_$name"); step_$name" \
    >"$OUT/$name.log" 2>&1
  rc=$?
  seconds=$(($(date +%s) - start))
  if [ $rc -eq 0 ]; then
    status=ok
  elif [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
    status=timeout
  else
    status=failed
  fi
  [ "$status" = ok ] || failed=$((failed + 1))
  tail -n 3 "$OUT/$name.log"
  printf '%s: %s (exit %d, %d s)\n' "$name" "$status" "$rc" "$seconds"
  echo "| $name | $status | $rc | $seconds | $name.log |" >>"$SUMMARY"
  printf '{"step": "%s", "status": "%s", "exit": %d, "seconds": %d, "limit": %d}\n' \
    "$name" "$status" "$rc" "$seconds" "$limit" >>"$OUT/steps.jsonl"
done

{
  echo
  echo "## pytest -m gpu"
  echo
  grep -E '^(PASSED|FAILED|ERROR|SKIPPED)|[0-9]+ (passed|failed|skipped)' "$OUT/gpu_tests.log" || true
  if [ -f "$OUT/stats_op.json" ]; then
    echo
    echo "## Statistics op (benchmarks/vocab_stats.py --device)"
    echo
    "$PYTHON" -c 'import json, sys; print(json.load(open(sys.argv[1]))["table"])' \
      "$OUT/stats_op.json"
  fi
  if [ -f "$OUT/rl_step/rl_step.md" ]; then
    echo
    echo "## RL step (benchmarks/gpu/rl_step.py)"
    echo
    cat "$OUT/rl_step/rl_step.md"
  fi
} >>"$SUMMARY" 2>&1
echo
echo "summary: $SUMMARY ($failed of ${#STEPS[@]} steps not ok)"
exit $((failed > 0))
