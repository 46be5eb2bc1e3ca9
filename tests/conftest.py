"""Test setup: on a machine without CUDA, Triton kernels run under the interpreter.

TRITON_INTERPRET must be set before any module defining a ``@triton.jit`` kernel is
imported, hence here, at conftest import time.

The interpreter computes ``tl.dot`` with numpy's matmul, that is OpenBLAS. Its AVX2/FMA
(Haswell) sgemm kernel, which it picks on current x86 CPUs, does not give a row the same
bits at every position in the block (seen on an AMD EPYC: rows 5-8 of a 16-row product
differ in the last bits from the same rows computed alone), so the row-invariance tests of
the interpreted kernels would test OpenBLAS rather than the kernels. On x86-64 with AVX the
Sandybridge kernel is chosen instead, whose rows do not depend on their position (the GPU's
MMA sums each output's products in one fixed order too). It must be set before numpy loads.
"""
import os
import platform
import sys


def _row_invariant_blas() -> None:
    if "numpy" in sys.modules or "OPENBLAS_CORETYPE" in os.environ or platform.machine() != "x86_64":
        return
    try:
        with open("/proc/cpuinfo") as f:
            avx = " avx " in f.read().replace("\n", " ")
    except OSError:
        return
    if avx:
        os.environ["OPENBLAS_CORETYPE"] = "Sandybridge"


_row_invariant_blas()

import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET") == "1":
    from interpreter_patching import install as _patch_once_per_launch

    _patch_once_per_launch()

import pytest  # noqa: E402


def pytest_sessionstart(session):
    """Under pytest-xdist, the controller rewrites the test modules' asserts into pytest's pyc
    cache before the workers start (its own xdist hook runs last): each worker would rewrite
    all of them otherwise, at the same time, 14 CPU-s each on a 2-core machine. A worker finds
    the cached pyc that its own import would have written; anything unexpected leaves it to
    the workers, as before."""
    config = session.config
    if hasattr(config, "workerinput") or not config.pluginmanager.hasplugin("dsession") or sys.dont_write_bytecode:
        return
    try:
        _rewrite_test_modules(config)
    except Exception:  # noqa: BLE001 - an internal API of pytest's: the workers rewrite as before
        pass


def _rewrite_test_modules(config, root=None) -> None:
    from fnmatch import fnmatch
    from pathlib import Path

    from _pytest.assertion import rewrite as rw

    if config.getoption("assertmode") != "rewrite":
        return
    state = config.stash[rw.assertstate_key]
    patterns = config.getini("python_files")
    for fn in sorted(Path(root or Path(__file__).parent).rglob("*.py")):
        if fn.name != "conftest.py" and not any(fnmatch(fn.name, p) for p in patterns):
            continue
        cache_dir = rw.get_cache_dir(fn)
        pyc = cache_dir / (fn.name[:-3] + rw.PYC_TAIL)
        if rw.try_makedirs(cache_dir) and rw._read_pyc(fn, pyc, state.trace) is None:
            source_hash, co = rw._rewrite_test(fn, config)
            rw._write_pyc(state, co, source_hash, pyc)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture
def one_thread():
    """Run the test on one torch thread: the runtime tests do many small matmuls, which one
    thread runs faster and without sensitivity to other processes' load."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
