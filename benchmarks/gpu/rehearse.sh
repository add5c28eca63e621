#!/usr/bin/env bash
# The device check rehearsed on the lent GPU image minus the GPU (CI runs this on every push):
#
#   1. a venv with only what the image has: torch, triton, transformers, numpy and their own
#      dependencies, borrowed from DONOR by symbolic links (benchmarks/gpu/image_venv.py); no
#      megatron-core, pytest, hypothesis, pyarrow, psutil or sentencepiece;
#   2. the carried wheels, downloaded by prepare_wheels.sh and installed by check.sh's install
#      step exactly as on the lent machine (pip --no-index --no-deps --no-compile --target);
#   3. check.sh --cpu with that venv's Python: every step must end ok, every section of
#      summary.md must render, and the GPU test modules must collect there exactly the tests
#      they collect in DONOR's full environment (on CPU they then skip);
#   4. a step killed mid-run: stats_op is SIGKILLed (its whole process group) as soon as its
#      first rows are on disk; its result file must still parse, say it is partial, and show
#      in summary.md.
#
#   bash benchmarks/gpu/rehearse.sh [OUT_DIR]     # DONOR (.venv312/bin/python), IMAGE (.venv-image)
#
# Limits: the versions are DONOR's (torch 2.14.1, triton 3.8, transformers 5.24 in CI), not
# the image's (torch 2.11.0+cu130, triton 3.6, transformers 5.17), and there is no GPU, so the
# CUDA paths (kernels compiled for the GPU, NCCL, the GPU tests' bodies) are not exercised.
set -euo pipefail
cd "$(dirname "$0")/../.."
DONOR=${DONOR:-.venv312/bin/python}
IMAGE=${IMAGE:-.venv-image}
OUT=${1:-$(mktemp -d)}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
export PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1
unset PYTHONPATH # the image's Python sees the image, the carried wheels and this checkout only
say() { printf '\n=== rehearsal: %s (%s)\n' "$1" "$(date +%T)"; }

say "the image's Python, borrowed from $DONOR"
"$DONOR" benchmarks/gpu/image_venv.py "$IMAGE"

say "the carried wheels"
PY=$DONOR bash benchmarks/gpu/prepare_wheels.sh

say "the GPU tests the full environment collects (in the background)"
# shellcheck disable=SC2046  # one word per module
PYTHONPATH=$PWD "$DONOR" -m pytest -m gpu --collect-only -q -p no:cacheprovider \
  $("$DONOR" benchmarks/gpu/gpu_tests.py all) >"$OUT/expected_gpu_tests.log" 2>&1 &
collect=$!

say "check.sh --cpu with the image's Python"
check_rc=0
PYTHON=$IMAGE/bin/python bash benchmarks/gpu/check.sh --cpu --export "$OUT/export" "$OUT/check" \
  || check_rc=$?

say "a step killed mid-run: stats_op, SIGKILL once its first rows are written"
killed=$OUT/killed
PYTHON=$IMAGE/bin/python bash benchmarks/gpu/check.sh --cpu --only stats_op "$killed" \
  >"$OUT/killed.console" 2>&1 &
check=$!
for _ in $(seq 1200); do # at most 10 min
  grep -qs '"method"' "$killed/stats_op.json" && break
  kill -0 "$check" 2>/dev/null || break
  sleep 0.5
done
pgid=$(sed -n 's/.*"pgid": \([0-9]*\).*/\1/p' "$killed/running.json" 2>/dev/null || true)
if [ -n "$pgid" ]; then
  echo "killing the stats_op step (process group $pgid)"
  kill -KILL -- "-$pgid" || true
fi
wait "$check" || true
tail -n 4 "$OUT/killed.console"

wait "$collect" || { cat "$OUT/expected_gpu_tests.log" && exit 1; }
grep '::' "$OUT/expected_gpu_tests.log" >"$OUT/expected_gpu_tests.txt"

say "verdict"
PYTHONPATH=$PWD "$DONOR" benchmarks/gpu/rehearsal_check.py "$OUT" --check-exit "$check_rc"
