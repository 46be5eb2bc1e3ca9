"""Where Triton kernels run: on CUDA tensors natively, on CPU tensors only under the
Triton interpreter (``TRITON_INTERPRET=1``, used by the CPU test suite).

Every kernel module in this project has a ``*_triton`` launcher and a ``*_reference``
torch implementation; the public entry point picks one with :func:`use_triton`.
"""
from __future__ import annotations

import logging
import os

import torch

logger = logging.getLogger(__name__)
_announced: set[str] = set()


def interpreter_enabled() -> bool:
    """True when Triton kernels are interpreted on the CPU (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def use_triton(t: torch.Tensor) -> bool:
    """Run the Triton kernel for a tensor on this device?

    CUDA tensors: always (unless ``SPARSEHI_FORCE_REFERENCE=1``). CPU tensors: only when
    ``SPARSEHI_FORCE_TRITON=1`` and the interpreter is on; the CPU demo otherwise uses the
    torch references, which compute the same result.
    """
    if os.environ.get("SPARSEHI_FORCE_REFERENCE", "0") == "1":
        return False
    if t.is_cuda:
        return True
    return interpreter_enabled() and os.environ.get("SPARSEHI_FORCE_TRITON", "0") == "1"


def announce_path(kernel: str, path: str) -> None:
    """Log once which implementation a kernel entry point runs (triton / reference / library)."""
    key = f"{kernel}:{path}"
    if key not in _announced:
        _announced.add(key)
        logger.info("sparsehi kernel %s runs on %s", kernel, path)
