#!/bin/sh
# The GPU check (see benchmarks/gpu_check.py): run from the repository root on a machine with CUDA.
#   benchmarks/gpu_check.sh --out gpu_check.json
# GPU figures come only from a GPU; --dry-run writes the JSON's shape anywhere.
set -eu
cd "$(dirname "$0")/.."
exec "${PYTHON:-python}" -m benchmarks.gpu_check "$@"
