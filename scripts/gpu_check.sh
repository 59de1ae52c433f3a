#!/usr/bin/env bash
# `make gpu-check` (docs/gpu.md): python -m benchmarks.gpu_check with the machine's python3 (PYTHON=... for
# another), the repository and the carried pure-Python dependencies (.gpu/deps, scripts/gpu_deps.sh) on
# PYTHONPATH. No virtual environment, no network. Arguments go to benchmarks/gpu_check.py, e.g.
#   scripts/gpu_check.sh --out "$OUT/gpu.md" --workdir "$OUT/work"
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
export PYTHONPATH="$root:$root/.gpu/deps${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export WANDB_MODE="${WANDB_MODE:-disabled}" GPU_CHECK_COMMAND="scripts/gpu_check.sh${*:+ $*}"
exec "${PYTHON:-python3}" -m benchmarks.gpu_check "$@"
