#!/usr/bin/env bash
# `make gpu-check` (docs/gpu.md): scripts/gpu_check.py with the machine's python3 (PYTHON=... for another),
# the repository and the carried pure-Python dependencies (.gpu/deps, scripts/gpu_deps.sh) on PYTHONPATH.
# No virtual environment, no network. Arguments go to scripts/gpu_check.py, e.g.
#   scripts/gpu_check.sh --out "$OUT/gpu.md" --workdir "$OUT/work"
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
export PYTHONPATH="$root:$root/.gpu/deps${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export WANDB_MODE="${WANDB_MODE:-disabled}" GPU_CHECK_COMMAND="scripts/gpu_check.sh${*:+ $*}"
exec "${PYTHON:-python3}" scripts/gpu_check.py "$@"
