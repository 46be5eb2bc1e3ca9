"""FP8 (E4M3) KV pages back to 16- or 32-bit values: ``out[p, g, t, h, d] = q[p, g, t, h, d]
* scales[p, g, h]``, the inverse of ``fp8_page_quantize``.

The scales are powers of two (``fp8_page_quantize``'s rule), so the product is exact in
float32 and, for bfloat16 and float32 outputs, exactly representable: every implementation
returns the same bits. (A float16 output can round values below its normal range.)

``q [P, G, T, H, D]`` is ``float8_e4m3fn`` or a ``uint8`` view of it, ``scales [P, G, H]``
float32, ``out [P, G, T, H, D]`` float32, bfloat16 or float16; all may be strided views with a contiguous
last dim (pages of a pinned host pool read in place on CUDA).

Entry points: ``fp8_page_dequantize`` (dispatch), ``fp8_page_dequantize_triton``,
``fp8_page_dequantize_reference``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from hicache.kernels.fp8_page_quantize import page_tile
from hicache.triton_support import dispatch

_OUTPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check(q: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> None:
    if not isinstance(q, torch.Tensor) or q.dim() != 5 or q.dtype not in (torch.float8_e4m3fn, torch.uint8):
        raise ValueError(f"q must be a 5-D [P, G, T, H, D] float8_e4m3fn or uint8 tensor, got "
                         f"{(tuple(q.shape), q.dtype) if isinstance(q, torch.Tensor) else type(q).__name__}")
    want = (q.shape[0], q.shape[1], q.shape[3])
    if not isinstance(scales, torch.Tensor) or tuple(scales.shape) != want or scales.dtype != torch.float32:
        raise ValueError(f"scales must be float32 [P, G, H]={want}, got "
                         f"{(tuple(scales.shape), scales.dtype) if isinstance(scales, torch.Tensor) else scales}")
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != tuple(q.shape) or out.dtype not in _OUTPUT_DTYPES:
        raise ValueError(f"out must be {_OUTPUT_DTYPES} of q's shape {tuple(q.shape)}, got "
                         f"{(tuple(out.shape), out.dtype) if isinstance(out, torch.Tensor) else type(out).__name__}")
    if q.stride(-1) != 1 or out.stride(-1) != 1:
        raise ValueError(f"q and out must have a contiguous last dim, got strides {q.stride()} and {out.stride()}")
    if scales.device != q.device or out.device != q.device:
        raise ValueError(f"q, scales and out must be on one device, got {q.device}, {scales.device}, {out.device}")


def fp8_page_dequantize_reference(q: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> None:
    """Plain-torch ``fp8_page_dequantize`` (same arguments and result)."""
    _check(q, scales, out)
    values = q if q.dtype == torch.float8_e4m3fn else q.view(torch.float8_e4m3fn)
    out.copy_((values.float() * scales[:, :, None, :, None]).to(out.dtype))


@triton.jit
def _fp8_page_dequantize_kernel(q_ptr, s_ptr, o_ptr, G, T, D, sqp, sqg, sqt, sqh, ssp, ssg, ssh, sop, sog, sot, soh,
                                BT: tl.constexpr, BD: tl.constexpr):
    p, g, h, t, d, m = page_tile(G, T, D, BT, BD)
    raw = tl.load(q_ptr + p * sqp + g * sqg + h * sqh + t[:, None] * sqt + d[None, :], mask=m, other=0)
    scale = tl.load(s_ptr + p * ssp + g * ssg + h * ssh)
    x = raw.to(tl.float8e4nv, bitcast=True).to(tl.float32) * scale
    tl.store(o_ptr + p * sop + g * sog + h * soh + t[:, None] * sot + d[None, :], x.to(o_ptr.dtype.element_ty),
             mask=m)


def fp8_page_dequantize_triton(q: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> None:
    """Triton launcher: one program per page, group and head."""
    _check(q, scales, out)
    P, G, T, H, D = q.shape
    if P and G and H:
        qb = q.view(torch.uint8)
        _fp8_page_dequantize_kernel[(P * G, H)](
            qb, scales, out, G, T, D, *qb.stride()[:4], *scales.stride(), *out.stride()[:4],
            BT=triton.next_power_of_2(max(T, 1)), BD=triton.next_power_of_2(max(D, 1)), num_warps=4)


def fp8_page_dequantize(q: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> None:
    """``q [P, G, T, H, D]`` E4M3 and ``scales [P, G, H]`` -> ``out [P, G, T, H, D]`` (see the
    module docstring)."""
    dispatch("fp8_page_dequantize", q, fp8_page_dequantize_triton, fp8_page_dequantize_reference)(q, scales, out)
