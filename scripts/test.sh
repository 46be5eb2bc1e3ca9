#!/usr/bin/env bash
# The README's test command: set-up of both environments, then the whole test suite in
# .venv (GPU tests skip on CPU; tests/sglang skip there, SGLang is not installed in it),
# then tests/sglang in .venv-sglang against SGLang 0.5.23. Fails if either run fails.
# Arguments go to the main run (and then leave the SGLang run out unless SPARSEHI_SGLANG=1);
# SPARSEHI_SKIP_SGLANG=1 always leaves out the SGLang environment.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PYTHONUNBUFFERED=1
rc=0
.venv/bin/python -m pytest -p no:cacheprovider "$@" || rc=$?
# With pytest arguments (a selection) the SGLang run is left out unless SPARSEHI_SGLANG=1.
if [ "${SPARSEHI_SKIP_SGLANG:-0}" != "1" ] && { [ "$#" -eq 0 ] || [ "${SPARSEHI_SGLANG:-0}" = "1" ]; }; then
    bash scripts/setup_sglang_env.sh
    echo "[test] tests/sglang in .venv-sglang (SGLang 0.5.23)"
    src=0
    .venv-sglang/bin/python -m pytest -p no:cacheprovider tests/sglang || src=$?
    [ "$rc" -ne 0 ] || rc=$src
fi
exit "$rc"
