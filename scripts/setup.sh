#!/usr/bin/env bash
# Idempotent set-up: .venv with torch (CPU 2.13.0 unless a CUDA torch is already present)
# and this package installed editable with the `dev` and `mooncake` extras (Mooncake's
# client and its mooncake_master, for the L3 storage tests; importing the client needs
# Debian's libibverbs1, installed here when missing). Fast when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv
PY="$VENV/bin/python"
STAMP="$VENV/.sparsehi-installed-$(cat pyproject.toml scripts/setup.sh scripts/pip-version.txt | sha256sum | cut -c1-16)"

has_ibverbs() { python3 -c "import ctypes; ctypes.CDLL('libibverbs.so.1')" 2>/dev/null; }
ensure_ibverbs() {
    has_ibverbs && return 0
    local warn="[setup] WARNING: libibverbs.so.1 is missing and could not be installed; the Mooncake
[setup] storage tests will be skipped. Install it (Debian/Ubuntu: apt-get install libibverbs1)."
    local sudo=""
    if [ "$(id -u)" -ne 0 ]; then
        if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
            sudo="sudo -n"
        else
            echo "$warn (not root, and no password-less sudo)" >&2
            return 0
        fi
    fi
    if ! command -v apt-get >/dev/null 2>&1; then
        echo "$warn (no apt-get)" >&2
        return 0
    fi
    echo "[setup] installing libibverbs1 (Mooncake's client links it)"
    if ! { $sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq libibverbs1; } \
            >/dev/null 2>&1 || ! has_ibverbs; then
        echo "$warn" >&2
    fi
}
# apt-get (on a fresh machine only) runs beside pip; the Mooncake checks wait for it
ensure_ibverbs &
IB_PID=$!
# the Mooncake client counts as installed when it imports, or (no libibverbs) when its files are there
mooncake_ok() {
    [ -f "$STAMP.no-mooncake" ] && return 0  # its wheel did not install here: not tried again
    if has_ibverbs; then
        "$PY" -c "import mooncake.store" 2>/dev/null
    else
        "$PY" -c "import importlib.util as u, sys; sys.exit(u.find_spec('mooncake') is None)" 2>/dev/null
    fi
}
if [ -f "$STAMP" ]; then
    wait "$IB_PID" || true
    if "$PY" -c "import sparsehi, hicache, torch, triton" 2>/dev/null && mooncake_ok; then
        exit 0
    fi
fi
# pip 23 (Python 3.11's venv) checks each file an index lists against about 1,000 platform
# tags one by one: resolving the extras below reads 60,000 links (every release of torch,
# numpy, ...) in 25 CPU-s, pip 26 in 15 (a set lookup). The upgrade takes 2 CPU-s; set-up
# goes on with the venv's pip where it fails. The version is scripts/pip-version.txt's, which
# scripts/setup_sglang_env.sh installs too.
PIP_VERSION=$(cat scripts/pip-version.txt)
upgrade_pip() {
    "$1" -c "import sys, pip; sys.exit(tuple(map(int, pip.__version__.split('.')[:2])) < (24, 1))" 2>/dev/null ||
        "$1" -m pip install -q --disable-pip-version-check --no-compile "pip==$PIP_VERSION" ||
        echo "[setup] WARNING: pip $PIP_VERSION did not install; resolving with $("$1" -m pip --version)" >&2
}
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
upgrade_pip "$PY"
if ! "$PY" -c "import torch" 2>/dev/null; then
    echo "[setup] installing torch==2.13.0 (CPU wheel)"
    "$PY" -m pip install -q --no-compile torch==2.13.0
fi
echo "[setup] installing sparsehi[dev,mooncake] (editable)"
# flock: the editable build writes sparsehi.egg-info here, and scripts/setup_sglang_env.sh
# (which scripts/test.sh runs at the same time) builds it too
if ! flock pyproject.toml "$PY" -m pip install -q --no-compile -e ".[dev,mooncake]"; then
    # no Mooncake wheel for this platform: everything else still works, its tests skip
    echo "[setup] WARNING: the mooncake extra (mooncake-transfer-engine-non-cuda) did not install;" \
         "installing sparsehi[dev] only, the Mooncake storage tests will be skipped" >&2
    flock pyproject.toml "$PY" -m pip install -q --no-compile -e ".[dev]"
    NO_MOONCAKE=1
fi
# pip's own compiling (left out above) writes .pyc for every file installed, about 7800 of them
# and 45 CPU-s, where a process imports about 1200: compile what the package and its test
# runner import, by importing them once with bytecode writing on (it may be off in the
# environment, and then nothing else would write them); scripts/test.sh keeps it on, so the
# first test that imports anything else compiles that once.
env -u PYTHONDONTWRITEBYTECODE "$PY" -c "import sparsehi, hicache, torch, triton, triton.language, numpy, pytest
import importlib.util as u; [__import__(m) for m in ('xdist', 'hypothesis') if u.find_spec(m)]"
wait "$IB_PID" 2>/dev/null || true
rm -f "$VENV"/.sparsehi-installed-*
touch "$STAMP"
if [ "${NO_MOONCAKE:-0}" = 1 ]; then touch "$STAMP.no-mooncake"; fi
