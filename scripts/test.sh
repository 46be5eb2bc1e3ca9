#!/usr/bin/env bash
# The README's test command: set-up, then the whole test suite (GPU tests skip on CPU).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PYTHONUNBUFFERED=1
exec .venv/bin/python -m pytest -p no:cacheprovider "$@"
