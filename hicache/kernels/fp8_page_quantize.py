"""FP8 (E4M3) quantisation of KV pages with one power-of-two scale per page, group and head.

For each page ``p``, group ``g`` (a layer's k or v, or MLA's latent) and head ``h`` of
``x [P, G, T, H, D]`` (``T`` tokens of a page, ``D`` the head's width):

    amax      = max |x[p, g, :, h, :]|                    (float32)
    scale     = 2**k, the least power of two with amax <= 448 * scale
                (k from amax's exponent and mantissa bits, clamped to [-126, 126]; 1 when amax == 0)
    q[p, g, :, h, :] = round_to_nearest_even_e4m3(x[p, g, :, h, :] * 2**-k)
    scales[p, g, h] = scale

448 is E4M3's largest finite value, so no value saturates. The scale is a power of two
(as in the OCP microscaling formats), built from its exponent bits as is its inverse, so
that ``x * 2**-k`` and the dequantisation ``q * scale`` are exact in float32: the Triton kernel, the torch reference and any later
reader compute bitwise the same values, and a page read back is always exactly
``q * scale``, whatever did the arithmetic. A page's values use the top binade of E4M3 or
the one below it, so the relative error of a value is at most 2**-4 (E4M3's 3 mantissa bits)
for values above the format's subnormal range. Inputs must be finite.

``q`` may be ``float8_e4m3fn`` or a ``uint8`` view of it; both outputs may be strided views
(e.g. pages of the host pool written in place, zero-copy over pinned memory on CUDA).

Entry points: ``fp8_page_quantize`` (dispatch), ``fp8_page_quantize_triton``,
``fp8_page_quantize_reference``; ``power_of_two_exponent_reference`` (the scale rule alone);
the device functions ``page_scale``, ``e4m3_bits`` and ``page_tile``, which other kernels inline.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from hicache.triton_support import dispatch

E4M3_MAX = 448.0
_MANTISSA_OF_1_75 = 0x600000  # 1.75 = 448 / 2**8: mantissa bits above this need one more binade
_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() != 5 or x.dtype not in _INPUT_DTYPES:
        raise ValueError(f"x must be a 5-D [P, G, T, H, D] tensor of {_INPUT_DTYPES}, got "
                         f"{(tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else type(x).__name__}")
    if not isinstance(q, torch.Tensor) or tuple(q.shape) != tuple(x.shape) \
            or q.dtype not in (torch.float8_e4m3fn, torch.uint8):
        raise ValueError(f"q must be float8_e4m3fn or uint8 of x's shape {tuple(x.shape)}, got "
                         f"{(tuple(q.shape), q.dtype) if isinstance(q, torch.Tensor) else type(q).__name__}")
    want = (x.shape[0], x.shape[1], x.shape[3])
    if not isinstance(scales, torch.Tensor) or tuple(scales.shape) != want or scales.dtype != torch.float32:
        raise ValueError(f"scales must be float32 [P, G, H]={want}, got "
                         f"{(tuple(scales.shape), scales.dtype) if isinstance(scales, torch.Tensor) else scales}")
    if x.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError(f"x and q must have a contiguous last dim, got strides {x.stride()} and {q.stride()}")
    if q.device != x.device or scales.device != x.device:
        raise ValueError(f"x, q and scales must be on one device, got {x.device}, {q.device}, {scales.device}")


def power_of_two_exponent_reference(amax: torch.Tensor) -> torch.Tensor:
    """``amax`` (float32, >= 0, any shape) -> ``k`` (int32) of the module's rule: the scale is
    ``2**k``."""
    bits = amax.float().contiguous().view(torch.int32)
    exponent = ((bits >> 23) & 0xFF) - 127
    k = exponent - 8 + ((bits & 0x7FFFFF) > _MANTISSA_OF_1_75).to(torch.int32)
    return torch.where(amax > 0, k.clamp(-126, 126), torch.zeros_like(k))


def power_of_two_reference(k: torch.Tensor) -> torch.Tensor:
    """``2**k`` (float32) for int32 ``k`` in [-126, 127], from its exponent bits."""
    return ((k + 127) << 23).view(torch.float32)


def fp8_page_quantize_reference(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> None:
    """Plain-torch ``fp8_page_quantize`` (same arguments and result)."""
    _check(x, q, scales)
    xf = x.float()
    k = power_of_two_exponent_reference(xf.abs().amax(dim=(2, 4)))  # [P, G, H]
    scale, inverse = power_of_two_reference(k), power_of_two_reference(-k)
    out = (xf * inverse[:, :, None, :, None]).to(torch.float8_e4m3fn)
    q.copy_(out if q.dtype == torch.float8_e4m3fn else out.view(torch.uint8))
    scales.copy_(scale)


@triton.jit
def e4m3_bits(v):
    """float32 ``v`` with ``|v| <= 448`` -> its E4M3 (fn) encoding, rounded to nearest even,
    in integer arithmetic (the same bits on every backend; the interpreter's own float8
    cast does not round to nearest even)."""
    b = v.to(tl.int32, bitcast=True)
    sign = (b >> 24) & 0x80
    a = b & 0x7FFFFFFF
    exp_field = a >> 23
    # normal E4M3 (|v| >= 2**-6): keep 3 of the 23 mantissa bits; a carry moves the exponent
    normal = ((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - (120 << 3)
    # subnormal E4M3 (|v| < 2**-6): |v| / 2**-9 rounded to an integer in [0, 8] (8 encodes 2**-6)
    mant = (a & 0x7FFFFF) | 0x800000
    shift = tl.minimum(14 - (exp_field - 127), 25)
    sub = (mant + (1 << (shift - 1)) - 1 + ((mant >> shift) & 1)) >> shift
    sub = tl.where(exp_field == 0, 0, sub)
    return sign | tl.where(exp_field >= 121, normal, sub)


@triton.jit
def page_scale(amax):
    """float32 ``amax >= 0`` -> ``(2**k, 2**-k)``, the module's scale rule, from exponent bits."""
    bits = amax.to(tl.int32, bitcast=True)
    k = ((bits >> 23) & 0xFF) - 127 - 8 + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)
    k = tl.where(amax > 0, tl.minimum(tl.maximum(k, -126), 126), 0)
    return ((k + 127) << 23).to(tl.float32, bitcast=True), ((127 - k) << 23).to(tl.float32, bitcast=True)


@triton.jit
def page_tile(G, T, D, BT: tl.constexpr, BD: tl.constexpr):
    """This program's ``(page, group, head)`` (grid ``(pages * G, heads)``), its token and
    dim ranges ``t [BT]``, ``d [BD]`` and their mask ``[BT, BD]``."""
    n = tl.program_id(0).to(tl.int64)
    t = tl.arange(0, BT)
    d = tl.arange(0, BD)
    return n // G, n % G, tl.program_id(1).to(tl.int64), t, d, (t[:, None] < T) & (d[None, :] < D)


@triton.jit
def _fp8_page_quantize_kernel(x_ptr, q_ptr, s_ptr, G, T, D, sxp, sxg, sxt, sxh, sqp, sqg, sqt, sqh, ssp, ssg, ssh,
                              BT: tl.constexpr, BD: tl.constexpr):
    p, g, h, t, d, m = page_tile(G, T, D, BT, BD)
    x = tl.load(x_ptr + p * sxp + g * sxg + h * sxh + t[:, None] * sxt + d[None, :], mask=m, other=0.0)
    x = x.to(tl.float32)
    scale, inverse = page_scale(tl.max(tl.max(tl.abs(x), axis=1), axis=0))
    q = e4m3_bits(x * inverse)
    tl.store(q_ptr + p * sqp + g * sqg + h * sqh + t[:, None] * sqt + d[None, :], q.to(tl.uint8), mask=m)
    tl.store(s_ptr + p * ssp + g * ssg + h * ssh, scale)


def fp8_page_quantize_triton(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> None:
    """Triton launcher: one program per page, group and head (a ``T x D`` block)."""
    _check(x, q, scales)
    P, G, T, H, D = x.shape
    if P and G and H:
        qb = q.view(torch.uint8)
        _fp8_page_quantize_kernel[(P * G, H)](
            x, qb, scales, G, T, D, *x.stride()[:4], *qb.stride()[:4], *scales.stride(),
            BT=triton.next_power_of_2(max(T, 1)), BD=triton.next_power_of_2(max(D, 1)), num_warps=4)


def fp8_page_quantize(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> None:
    """``x [P, G, T, H, D]`` -> ``q [P, G, T, H, D]`` E4M3 values and ``scales [P, G, H]``
    float32 (see the module docstring)."""
    dispatch("fp8_page_quantize", x, fp8_page_quantize_triton, fp8_page_quantize_reference)(x, q, scales)
