#!/usr/bin/env bash
# Download, on a machine with PyPI access, the wheels that benchmarks/gpu/check.sh installs on a
# GPU machine without network: what such a machine (Python 3.12, torch, triton, transformers,
# numpy already there) may lack. Pure downloads, no install; the folder is git-ignored, so it
# must be carried with the checkout (docs/gpu.md). The GPU test modules import nothing else:
# no hypothesis, no pyarrow (benchmarks/gpu/rehearse.sh proves it on every CI run).
#
#   bash benchmarks/gpu/prepare_wheels.sh [DEST]     # DEST defaults to .gpu-wheels/
#
# Then copy the checkout (with DEST) to the GPU machine and run benchmarks/gpu/check.sh there.
set -euo pipefail
cd "$(dirname "$0")/../.."
DEST=${1:-.gpu-wheels}
PY=${PY:-python3}
LIMIT_MIB=16 # of the 64 MiB that travel with a call to the lent machine

# name==version, one per line: the versions CI tests with (keep in step with .ci/run).
WHEELS=(
  "megatron-core==0.19.2"          # the engine (the GPU image has none)
  "math-verify==0.9.0"             # math rewards ...
  "latex2sympy2_extended==1.11.0"  # ... and its two dependencies
  "antlr4-python3-runtime==4.13.2"
  "liger-kernel==0.8.5"            # fused-loss baseline for the stats-op benchmark
  "pytest==9.2.0"                  # pytest -m gpu, with its two dependencies
  "pluggy==1.7.0"
  "iniconfig==2.3.1"
  "psutil==7.2.2"                  # megatron's checkpoint save imports it (undeclared)
  "sentencepiece==0.2.3"           # the tiny tokenizer of the trainer tests and rl_step
  "pyzmq==27.3.0"                  # the trainer imports the rollout control channel ...
  "msgpack==1.2.4"                 # ... and its frames (declared dependencies, see pyproject)
)
# pip matches each manylinux tag exactly: name every one a wheel above may carry
PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64
  manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_12_x86_64 manylinux2010_x86_64
  manylinux1_x86_64)

mkdir -p "$DEST"
rm -f "$DEST"/*.whl # one version of each: two would stop the install on the GPU machine
"$PY" -m pip download --quiet --only-binary=:all: --no-deps \
  --python-version 3.12 --implementation cp "${PLATFORMS[@]/#/--platform=}" \
  -d "$DEST" "${WHEELS[@]}"

total_kib=$(du -sk "$DEST" | cut -f1)
printf '%s\n' "$DEST:" && ls -l "$DEST"
printf 'total: %d KiB (%.1f MiB; limit %d MiB)\n' "$total_kib" "$(echo "$total_kib / 1024" | bc -l)" "$LIMIT_MIB"
if [ "$total_kib" -gt $((LIMIT_MIB * 1024)) ]; then
  echo "the wheels exceed ${LIMIT_MIB} MiB: leave room for the checkout on the lent machine" >&2
  exit 1
fi
