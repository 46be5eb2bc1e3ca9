#!/usr/bin/env bash
# The README's main-job command: set-up, then the long-context decode demo (`sparsehi run`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/sparsehi run "$@"
