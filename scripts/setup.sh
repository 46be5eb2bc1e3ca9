#!/usr/bin/env bash
# Idempotent set-up: .venv with torch (CPU 2.13.0 unless a CUDA torch is already present)
# and this package installed editable with the `dev` extra. Fast when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv
PY="$VENV/bin/python"
STAMP="$VENV/.sparsehi-installed-$(cat pyproject.toml | sha256sum | cut -c1-16)"
if [ -f "$STAMP" ] && "$PY" -c "import sparsehi, hicache, torch, triton" 2>/dev/null; then
    exit 0
fi
has_cuda_torch() { "$1" -c "import sys, torch; sys.exit(0 if torch.version.cuda else 1)" 2>/dev/null; }
if [ ! -x "$PY" ]; then
    if has_cuda_torch python3; then
        # keep the machine's CUDA torch: never replace it with a CPU or a second CUDA build
        echo "[setup] CUDA torch found in system python: venv sees system site-packages"
        python3 -m venv --system-site-packages "$VENV"
    else
        python3 -m venv "$VENV"
    fi
fi
if ! "$PY" -c "import torch" 2>/dev/null; then
    echo "[setup] installing torch==2.13.0 (CPU wheel)"
    "$PY" -m pip install -q torch==2.13.0
fi
echo "[setup] installing sparsehi[dev] (editable)"
"$PY" -m pip install -q -e ".[dev]"
rm -f "$VENV"/.sparsehi-installed-*
touch "$STAMP"
