"""The value a store of a float32 keeps in a narrower dtype, the same on GPU and under the
CPU interpreter (shared by the kernels that fold decoded keys into stored representations)."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def as_stored(x, dtype: tl.constexpr):
    """``x`` (float32) rounded to ``dtype`` (the value a store keeps), as float32. bf16 is
    rounded to nearest even by hand: the CPU interpreter truncates on that conversion,
    GPUs round, and both must store what torch's ``.to(bfloat16)`` stores."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    else:
        return x.to(dtype).to(tl.float32)


@triton.jit
def e4m3_bits(x):
    """The float8_e4m3fn bytes (uint8) of ``x`` (float32, ``|x| <= 448``), rounded to nearest
    even as torch's ``.to(float8_e4m3fn)`` rounds; by hand because the CPU interpreter's
    conversion rounds ties away and loses the carry into the exponent."""
    b = x.to(tl.uint32, bitcast=True)
    sign = ((b >> 24) & 0x80).to(tl.uint8)
    a = b & 0x7FFFFFFF
    # normal (>= 2^-6): drop 20 of the 23 mantissa bits, ties to even, rebias 127 -> 7
    normal = (((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - (120 << 3)).to(tl.uint8)
    # subnormal: the multiple of 2^-9, rounded to even by the float add (8 carries into 2^-6)
    m = (a.to(tl.float32, bitcast=True) * 512.0 + 8388608.0) - 8388608.0
    return sign | tl.where(a >= 0x3C800000, normal, m.to(tl.uint8))
