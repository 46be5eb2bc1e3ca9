#!/usr/bin/env bash
# The README's test command: set-up of both environments, then the whole test suite in
# .venv (GPU tests skip on CPU; tests/sglang skip there, SGLang is not installed in it),
# and tests/sglang in .venv-sglang against SGLang 0.5.23. Fails if either run fails.
# Without arguments the SGLang environment's set-up and tests/sglang run in the background,
# beside .venv's set-up and the main suite, and their output is printed after the main
# suite's; on a machine without CUDA the main suite runs on pytest-xdist workers (one more
# than the cores, at most 4: a worker waiting on a child process, a server's timeout or an
# injected delay leaves its core to the others), so all cores stay busy
# (SPARSEHI_TEST_WORKERS=N sets the count, 0 turns xdist off).
# Arguments go to the main run as they are (no xdist unless you pass -n), and then leave the
# SGLang run out unless SPARSEHI_SGLANG=1; SPARSEHI_SKIP_SGLANG=1 always leaves it out.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
# the set-ups compile only the modules the common imports reach (pip's --no-compile): a test
# process importing another module writes its .pyc once for the processes after it, also where
# the environment turns bytecode writing off
unset PYTHONDONTWRITEBYTECODE
sglang=0
if [ "${SPARSEHI_SKIP_SGLANG:-0}" != "1" ] && { [ "$#" -eq 0 ] || [ "${SPARSEHI_SGLANG:-0}" = "1" ]; }; then
    sglang=1
fi
if [ "$sglang" = 1 ]; then
    log=$(mktemp "${TMPDIR:-/tmp}/sparsehi-test-sglang.XXXXXX")
    # in a process group of its own, so that an early exit here stops all of it
    setsid -w bash -c 'bash scripts/setup_sglang_env.sh && echo "[test] tests/sglang in .venv-sglang (SGLang 0.5.23)" &&
                    exec .venv-sglang/bin/python -m pytest -p no:cacheprovider tests/sglang' >"$log" 2>&1 &
    sg_pid=$!
    trap 'kill -- "-$sg_pid" 2>/dev/null || true; rm -f "$log"' EXIT
    trap 'exit 130' INT TERM
    echo "[test] SGLang environment set-up and tests/sglang started in the background (output after the main suite's)"
fi
bash scripts/setup.sh
args=("$@")
if [ "$#" -eq 0 ]; then
    workers=${SPARSEHI_TEST_WORKERS:-}
    if [ -z "$workers" ]; then
        workers=0
        if .venv/bin/python -c "import sys, torch; sys.exit(torch.cuda.is_available())" 2>/dev/null; then  # no CUDA
            workers=$(( $(nproc) + 1 )); [ "$workers" -le 4 ] || workers=4; [ "$workers" -ge 3 ] || workers=0
        fi
    fi
    [ "$workers" = 0 ] || args=(-n "$workers")
fi
rc=0
.venv/bin/python -m pytest -p no:cacheprovider "${args[@]}" || rc=$?
if [ "$sglang" = 1 ]; then
    src=0
    wait "$sg_pid" || src=$?
    echo "[test] SGLang environment set-up and tests/sglang (run beside the main suite):"
    cat "$log"
    [ "$rc" -ne 0 ] || rc=$src
fi
exit "$rc"
