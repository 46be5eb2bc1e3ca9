#!/usr/bin/env bash
# Idempotent set-up of the SGLang test environment .venv-sglang (tests/sglang run in it):
# torch 2.14.1 + torchvision 0.29.1 (the build SGLang 0.5.23 pins), sglang==0.5.23 without
# its dependency set, only the modules its imports need (scripts/sglang-env-requirements.txt),
# and this package editable without dependencies (its entry point makes SGLang's
# load_plugins() find the plugin). Fast when nothing changed (stamp file).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv-sglang
PY="$VENV/bin/python"
HASH=$(cat pyproject.toml scripts/sglang-env-requirements.txt scripts/setup_sglang_env.sh | sha256sum | cut -c1-16)
STAMP="$VENV/.sglang-env-$HASH"
if [ -f "$STAMP" ] && "$PY" -c "import sglang.srt.plugins, sparsehi.sglang_plugin, torch" 2>/dev/null; then
    exit 0
fi
start=$(date +%s)
[ -x "$PY" ] || python3 -m venv "$VENV"
PIP=("$PY" -m pip install -q --disable-pip-version-check)
echo "[setup-sglang] torch==2.14.1 torchvision==0.29.1"
"${PIP[@]}" torch==2.14.1 torchvision==0.29.1
echo "[setup-sglang] sglang==0.5.23 (--no-deps) and the modules its imports need"
"${PIP[@]}" --no-deps sglang==0.5.23
"${PIP[@]}" -r scripts/sglang-env-requirements.txt
echo "[setup-sglang] sparsehi (editable, --no-deps)"
"${PIP[@]}" --no-deps -e .
"$PY" -c "import sglang.srt.plugins, sglang.srt.server_args, sparsehi.sglang_plugin" >/dev/null
rm -f "$VENV"/.sglang-env-*
touch "$STAMP"
echo "[setup-sglang] done in $(( $(date +%s) - start )) s"
