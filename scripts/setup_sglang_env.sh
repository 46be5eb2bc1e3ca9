#!/usr/bin/env bash
# Idempotent set-up of the SGLang test environment .venv-sglang (tests/sglang run in it), CPU
# only, about 2.4 GB:
# - torch==2.13.0+cpu, the CPU wheel .venv uses (pip takes it from local disk; the `+cpu` pin
#   makes pip fail rather than pull a CUDA build where that wheel is not at hand), and
#   triton==3.8.0 (the Triton of torch 2.14.1, which SGLang 0.5.23 pins; on CPU its kernels
#   and ours run under TRITON_INTERPRET=1, set by tests/conftest.py). Installed here, not
#   shared with .venv: --system-site-packages or a .pth into .venv would also bring in
#   .venv's other packages (matplotlib, mooncake, pytest-xdist, ...) and hide a requirement
#   missing from the list below; from local disk it takes seconds, beside scripts/setup.sh;
# - sglang==0.5.23 without its dependency set, and only the modules its imports need
#   (scripts/sglang-env-requirements.txt). Its dependency set pins torch==2.14.1 (a CUDA
#   build) and several GB of CUDA kernels: sglang-kernel, flashinfer, deep-gemm, nvidia-*.
#   None is installed here. The modules the plugin and the tests import reach sgl_kernel only
#   behind SGLang's own platform guards (`if _is_cuda:` in triton_backend, `if _is_xpu:` in
#   memory_pool, the AMX store only with SGLANG_USE_CPU_ENGINE=1), which are off on CPU torch;
#   layers/attention/flashattention_backend imports sgl_kernel unguarded, and neither the
#   plugin nor the tests import it (our flashattention adapter builds its own metadata and
#   falls back from sgl_kernel.flash_attn to Triton / torch on CPU);
# - torchvision==0.28.0 (torch 2.13's release) without dependencies: sglang.srt.configs, which
#   memory_pool imports, imports torchvision.transforms for its vision-model configs. PyPI has
#   only the CUDA build, whose C++ ops (_C.so) cannot load into CPU torch; torchvision is made
#   for that (its ops then raise "Couldn't load custom C++ ops" when called, which no test
#   does), except that _meta_registrations.py registers fake kernels for torchvision::nms and
#   ::qnms without its usual `_has_ops()` check, so `import torchvision` fails. Set-up adds
#   that check to those two registrations (the only change made to an installed package);
# - this package editable without dependencies (its entry point makes SGLang's
#   load_plugins() find the plugin).
# Nothing CUDA is installed: set-up fails if torch is a CUDA build or any nvidia-*,
# sglang-kernel or sgl-kernel package is present. Fast when nothing changed (stamp file);
# any change to this script, the requirements or pyproject.toml rebuilds it from scratch.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv-sglang
PY="$VENV/bin/python"
HASH=$(cat pyproject.toml scripts/sglang-env-requirements.txt scripts/setup_sglang_env.sh scripts/pip-version.txt |
       sha256sum | cut -c1-16)
STAMP="$VENV/.sglang-env-$HASH"
if [ -f "$STAMP" ] && "$PY" -c "import sglang.srt.plugins, sparsehi.sglang_plugin, torch" 2>/dev/null; then
    exit 0
fi
start=$(date +%s)
rm -rf "$VENV"
python3 -m venv "$VENV"
# --no-compile: pip would compile all 17,000 files installed (85 CPU-s), of which the
# tests import about 4,700; the import check at the end compiles those with bytecode writing on
# (PYTHONDONTWRITEBYTECODE may be set in the environment, and then no test process would
# write them but compile them anew each time), and scripts/test.sh keeps writing on for the rest
PIP=("$PY" -m pip install -q --disable-pip-version-check --no-compile)
# pip 26 (scripts/pip-version.txt), as scripts/setup.sh installs it: pip 23 checks each file
# the index lists (all versions of torch, numpy, transformers, ...) against the platform tags
# one tag at a time (this set-up: 112 CPU-s with pip 23, 87 with pip 26)
PIP_VERSION=$(cat scripts/pip-version.txt)
"${PIP[@]}" "pip==$PIP_VERSION" ||
    echo "[setup-sglang] WARNING: pip $PIP_VERSION did not install; going on with $("$PY" -m pip --version)" >&2
echo "[setup-sglang] torch==2.13.0+cpu triton==3.8.0 and the modules SGLang's imports need"
"${PIP[@]}" torch==2.13.0+cpu triton==3.8.0 -r scripts/sglang-env-requirements.txt
echo "[setup-sglang] sglang==0.5.23 and torchvision==0.28.0 (--no-deps), sparsehi (editable, --no-deps)"
# flock: the editable build writes sparsehi.egg-info in the repository, as scripts/setup.sh's
# does (scripts/test.sh runs the two set-ups at the same time)
flock pyproject.toml "${PIP[@]}" --no-deps torchvision==0.28.0 sglang==0.5.23 -e .
"$PY" - <<'EOF'
# torchvision 0.28.0's _meta_registrations.py: give the nms / qnms fake kernels the
# `_has_ops()` check its other registrations have (see the comment at the top of this script)
import pathlib, sys, sysconfig
p = pathlib.Path(sysconfig.get_paths()["purelib"]) / "torchvision" / "_meta_registrations.py"
s = p.read_text()
old = '@torch.library.register_fake("torchvision::'
anchor = "import torchvision.extension  # noqa: F401\n"
if s.count(old) != 2 or s.count(anchor) != 1:
    sys.exit(f"[setup-sglang] {p} is not the torchvision 0.28.0 file this step expects")
helper = ("\n\ndef _register_fake_if_ops(name):  # added by sparsehi's scripts/setup_sglang_env.sh\n"
          "    return torch.library.register_fake(name) if torchvision.extension._has_ops() else (lambda fn: fn)\n")
p.write_text(s.replace(old, '@_register_fake_if_ops("torchvision::').replace(anchor, anchor + helper))
EOF
env -u PYTHONDONTWRITEBYTECODE "$PY" -W ignore - <<'EOF'
import sys, torch
from importlib.metadata import distributions
cuda = sorted(d.metadata["Name"] for d in distributions()
              if d.metadata["Name"].lower().replace("_", "-").startswith(("nvidia-", "sglang-kernel", "sgl-kernel")))
if torch.version.cuda or cuda:
    sys.exit(f"[setup-sglang] a CUDA package got in: torch {torch.__version__}, {cuda}")
import sglang.srt.plugins, sglang.srt.server_args, sglang.srt.mem_cache.memory_pool, sparsehi.sglang_plugin  # noqa
EOF
touch "$STAMP"
echo "[setup-sglang] done in $(( $(date +%s) - start )) s"
