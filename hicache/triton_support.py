"""Where a kernel runs, and the launch arithmetic every kernel module shares.

Triton kernels run on CUDA tensors natively and on CPU tensors only under the Triton
interpreter (``TRITON_INTERPRET=1``, used by the CPU test suite). Every kernel module has a
``*_triton`` launcher and a ``*_reference`` torch implementation taking the same arguments;
its entry point runs the one :func:`dispatch` picks.
"""
from __future__ import annotations

import logging
import os
from typing import Callable, Optional, TypeVar

import torch

logger = logging.getLogger(__name__)
_announced: set[tuple[str, str]] = set()

INT32_MAX = 2**31 - 1

F = TypeVar("F", bound=Callable)


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for integers (``b > 0``)."""
    return -(-a // b)


_SM_COUNT: dict[int, int] = {}


def sm_count(device: torch.device, off_cuda: int = 0) -> int:
    """Streaming multiprocessors of a CUDA ``device`` (looked up once per device; no sync);
    ``off_cuda`` for any other device (the interpreter has no SMs to fill)."""
    if device.type != "cuda":
        return off_cuda
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def exact_dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot``'s ``input_precision`` that keeps products of ``dtype`` inputs exact: IEEE
    for fp32 (TF32 would round them to 10 mantissa bits, whatever ``TRITON_F32_DEFAULT``
    says), TF32 for 16-bit inputs upcast to fp32 (their mantissas fit)."""
    return "ieee" if dtype == torch.float32 else "tf32"


def interpreter_enabled() -> bool:
    """True when Triton kernels are interpreted on the CPU (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def per_program(name: str, value: Optional[int], gpu_default: int, interpreted_default: int) -> int:
    """A launcher's items a program (tokens, rows, ...): ``value`` when given, a power of two
    >= 1 (else a ValueError naming ``name``); None: ``interpreted_default`` under the CPU
    interpreter, whose cost is mostly per program, else ``gpu_default``."""
    if value is None:
        return interpreted_default if interpreter_enabled() else gpu_default
    if not isinstance(value, int) or value < 1 or value & (value - 1):
        raise ValueError(f"{name}={value!r} is invalid: None or a power of two >= 1")
    return value


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
    key = (kernel, path)
    if key not in _announced:
        _announced.add(key)
        logger.info("sparsehi kernel %s runs on %s", kernel, path)


def dispatch(kernel: str, probe: torch.Tensor, triton_impl: F, reference_impl: F, *, triton_ok: bool = True) -> F:
    """The implementation of ``kernel`` to call for ``probe``'s device: ``triton_impl`` where
    :func:`use_triton` says so and ``triton_ok`` (a kernel's own limits), else
    ``reference_impl``. Logs the choice once per kernel and path (:func:`announce_path`).
    Reads no tensor data and allocates nothing: safe inside CUDA-graph capture."""
    if triton_ok and use_triton(probe):
        announce_path(kernel, "triton")
        return triton_impl
    announce_path(kernel, "reference")
    return reference_impl
