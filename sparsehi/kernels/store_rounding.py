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
