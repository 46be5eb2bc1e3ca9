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
