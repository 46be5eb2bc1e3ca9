"""Quantise MLA latent KV rows into the FP8 latent layout in one launch.

``kv [..., kv_lora_rank + rope_dim]`` (bf16, fp16 or fp32) becomes ``[..., bytes_per_token]``
uint8 rows of the DeepSeek-V3.2 layout (``mla_fp8_latents``): per 128-value tile of the latent
a power-of-two float32 scale ``2 ** ceil(log2(max(amax / 448, 1e-4)))``, the values divided
by it and rounded to the nearest E4M3 value, the rope part stored as bf16. The bytes are
those of the torch reference ``mla_fp8_latents.quantize_mla_latents``: the scale comes from
the float's bits (no log), a division by a power of two is exact, and bf16 rounding of a
non-bf16 rope and the E4M3 rounding are done by hand (``store_rounding.as_stored``,
``hicache.kernels.fp8_page_quantize.e4m3_bits``; the interpreter's conversions round
otherwise).

The decode stores each new token's row this way in every layer (``kv_cache_format.stored_kv``):
the reference takes about fifteen small launches a layer, this kernel one program per row.

Entry points: ``mla_fp8_quantize`` (dispatch), ``mla_fp8_quantize_triton``,
``mla_fp8_quantize_reference``.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from hicache.kernels.fp8_page_quantize import e4m3_bits
from hicache.triton_support import dispatch
from sparsehi.kernels.mla_fp8_latents import (FP8_MAX, FP8_TILE, MIN_SCALE_BEFORE_ROUNDING, MlaFp8Layout,
                                             quantize_mla_latents)
from sparsehi.kernels.store_rounding import as_stored

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _check(kv: torch.Tensor, kv_lora_rank: int) -> MlaFp8Layout:
    if not isinstance(kv, torch.Tensor) or kv.dim() < 1 or kv.dtype not in _DTYPES:
        raise ValueError(f"kv must be a [..., kv_lora_rank + rope_dim] bf16/fp16/fp32 tensor; got "
                         f"{getattr(kv, 'dtype', type(kv).__name__)} {tuple(getattr(kv, 'shape', ()))}")
    if not isinstance(kv_lora_rank, int) or not 0 < kv_lora_rank < kv.shape[-1]:
        raise ValueError(f"kv_lora_rank must be an int in (0, {kv.shape[-1]}) (kv's last dim); got {kv_lora_rank}")
    return MlaFp8Layout(kv_lora_rank, kv.shape[-1] - kv_lora_rank)


def mla_fp8_quantize_reference(kv: torch.Tensor, kv_lora_rank: int = 512) -> torch.Tensor:
    """Torch reference (``quantize_mla_latents``): ``[..., bytes_per_token]`` uint8."""
    _check(kv, kv_lora_rank)
    return quantize_mla_latents(kv, kv_lora_rank)


@triton.jit
def _mla_fp8_quantize_kernel(x_ptr, val_ptr, scale_ptr, rope_ptr, stride_x, stride_v, stride_s, stride_r,
                             scale_off, rope_off, D_LAT: tl.constexpr, NUM_TILES: tl.constexpr,
                             BLOCK_T: tl.constexpr, TILE: tl.constexpr, ROPE: tl.constexpr, BLOCK_R: tl.constexpr,
                             FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr):
    # one program per row: its NUM_TILES x TILE latent values, their scales and the rope
    n = tl.program_id(0).to(tl.int64)
    t = tl.arange(0, BLOCK_T)
    c = tl.arange(0, TILE)
    col = t[:, None] * TILE + c[None, :]
    m = (t[:, None] < NUM_TILES) & (c[None, :] < TILE)
    x = tl.load(x_ptr + n * stride_x + col, mask=m, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), 1)
    s = tl.maximum(tl.math.div_rn(amax, FP8_MAX), MIN_SCALE)
    # 2 ** ceil(log2(s)): s itself when its mantissa field is 0, else the next power of two
    bits = s.to(tl.int32, bitcast=True)
    pow_bits = (bits & 0x7F800000) + tl.where((bits & 0x7FFFFF) == 0, 0, 0x800000)
    scale = pow_bits.to(tl.float32, bitcast=True)
    inverse = (0x7F000000 - pow_bits).to(tl.float32, bitcast=True)  # 2 ** -e, exact for normal scales
    q = x * inverse[:, None]
    tl.store(val_ptr + n * stride_v + col, e4m3_bits(q), mask=m)
    tl.store(scale_ptr + n * stride_s + scale_off + t, scale, mask=t < NUM_TILES)
    r = tl.arange(0, BLOCK_R)
    rm = r < ROPE
    rope = tl.load(x_ptr + n * stride_x + D_LAT + r, mask=rm, other=0.0).to(tl.float32)
    # as torch's .to(bfloat16) rounds (bf16 input comes back unchanged)
    tl.store(rope_ptr + n * stride_r + rope_off + r, as_stored(rope, tl.bfloat16).to(tl.bfloat16), mask=rm)


def mla_fp8_quantize_triton(kv: torch.Tensor, kv_lora_rank: int = 512) -> torch.Tensor:
    """Triton launcher: one program per row; same bytes as the reference. No host sync, one
    allocation (the output), fixed grid: safe inside CUDA-graph capture."""
    lay = _check(kv, kv_lora_rank)
    lead = kv.shape[:-1]
    n = math.prod(lead)
    out = torch.empty((n, lay.bytes_per_token), dtype=torch.uint8, device=kv.device)
    if n == 0:
        return out.view(*lead, lay.bytes_per_token)
    x = kv.reshape(n, kv.shape[-1])
    if x.stride(-1) != 1:
        x = x.contiguous()
    scales = out.view(torch.float32)
    rope = out.view(torch.bfloat16)
    _mla_fp8_quantize_kernel[(n,)](
        x, out, scales, rope, x.stride(0), out.stride(0), scales.stride(0), rope.stride(0),
        lay.scale_offset // 4, lay.rope_offset // 2,
        D_LAT=kv_lora_rank, NUM_TILES=lay.num_tiles, BLOCK_T=triton.next_power_of_2(lay.num_tiles), TILE=FP8_TILE,
        ROPE=lay.rope_dim, BLOCK_R=triton.next_power_of_2(lay.rope_dim), FP8_MAX=FP8_MAX,
        MIN_SCALE=MIN_SCALE_BEFORE_ROUNDING, num_warps=4,
    )
    return out.view(*lead, lay.bytes_per_token)


def mla_fp8_quantize(kv: torch.Tensor, kv_lora_rank: int = 512) -> torch.Tensor:
    """FP8 latent rows of ``kv`` (module docstring): Triton on CUDA, the torch reference
    elsewhere. The kernel makes the E4M3 bytes by integer arithmetic, so it needs no native
    FP8 conversion (no compute capability floor)."""
    impl = dispatch("mla_fp8_quantize", kv, mla_fp8_quantize_triton, mla_fp8_quantize_reference)
    return impl(kv, kv_lora_rank)
