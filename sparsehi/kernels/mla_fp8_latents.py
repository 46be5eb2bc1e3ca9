"""FP8 MLA latent KV rows in the DeepSeek-V3.2 / FlashMLA sparse layout ("V32_FP8Sparse").

One token's row is ``bytes_per_token`` uint8 bytes:

    [0, Dl)                      Dl float8_e4m3fn values of the latent c_kv (kv_lora_rank Dl)
    [Dl, Dl + 4 * Dl / 128)      Dl / 128 float32 scales, one per 128-value tile of the latent
    [Dl + 4 * Dl / 128, end)     rope_dim bfloat16 values of k_rope (not quantised)

so ``bytes_per_token = Dl + 4 * Dl / 128 + 2 * rope_dim``: 656 bytes for DeepSeek's Dl = 512,
rope_dim = 64 (512 + 16 + 128), 260 for Dl = 128, rope_dim = 64. A latent value is ``fp8 *
scale`` of its tile.

Scales follow FlashMLA's quantiser: ``scale = 2 ** ceil(log2(max(amax / 448, 1e-4)))`` for
the tile's largest magnitude ``amax`` (448 = the largest E4M3 value), i.e. rounded *up* to a
power of two (UE8M0), so ``|x| / scale <= 448`` and ``fp8 * scale`` is exact in bfloat16 and
float32. The values are ``x / scale`` rounded to the nearest E4M3 value.

Here: the layout (:class:`MlaFp8Layout`), torch references :func:`quantize_mla_latents` /
:func:`dequantize_mla_latents`, and the Triton loads of a tile of scaled latent rows that the
sparse MLA decode kernel uses (:func:`load_fp8_latent_rows`, :func:`load_fp8_latent_cols`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

FP8_TILE = 128
"""Latent values per float32 scale."""
FP8_MAX = 448.0
"""The largest float8_e4m3fn magnitude."""
MIN_SCALE_BEFORE_ROUNDING = 1e-4
"""Floor of ``amax / 448`` before rounding to a power of two (FlashMLA's; all-zero tiles)."""

# DeepSeek-V3.2 (kv_lora_rank 512, rope_dim 64)
MLA_FP8_BYTES_PER_TOKEN = 656
MLA_FP8_SCALE_OFFSET = 512
MLA_FP8_ROPE_OFFSET = 528


@dataclass(frozen=True)
class MlaFp8Layout:
    """Byte layout of one token's FP8 row for ``kv_lora_rank`` (a multiple of 128) latent
    values and ``rope_dim`` (even, so rows stay 4-byte aligned) bf16 rope values."""

    kv_lora_rank: int = 512
    rope_dim: int = 64

    def __post_init__(self) -> None:
        if not isinstance(self.kv_lora_rank, int) or self.kv_lora_rank <= 0 or self.kv_lora_rank % FP8_TILE:
            raise ValueError(f"kv_lora_rank must be a positive multiple of {FP8_TILE} for the FP8 latent layout; "
                             f"got {self.kv_lora_rank}")
        if not isinstance(self.rope_dim, int) or self.rope_dim <= 0 or self.rope_dim % 2:
            raise ValueError(f"rope_dim must be a positive even int for the FP8 latent layout; got {self.rope_dim}")

    @classmethod
    def of_row(cls, kv_lora_rank: int, row_bytes: int, name: str = "row_bytes") -> "MlaFp8Layout":
        """The layout whose rows are ``row_bytes`` bytes for ``kv_lora_rank`` latent values
        (ValueError naming ``name`` where no even ``rope_dim > 0`` fits)."""
        if not isinstance(kv_lora_rank, int) or kv_lora_rank <= 0 or kv_lora_rank % FP8_TILE:
            raise ValueError(f"kv_lora_rank must be a positive multiple of {FP8_TILE}; got {kv_lora_rank}")
        rope_bytes = row_bytes - kv_lora_rank - 4 * (kv_lora_rank // FP8_TILE)
        if rope_bytes <= 0 or rope_bytes % 4:
            raise ValueError(f"{name} must be kv_lora_rank + 4 * kv_lora_rank / 128 + 2 * rope_dim (even "
                             f"rope_dim > 0) for kv_lora_rank={kv_lora_rank}; got {row_bytes}")
        return cls(kv_lora_rank, rope_bytes // 2)

    @property
    def num_tiles(self) -> int:
        return self.kv_lora_rank // FP8_TILE

    @property
    def scale_offset(self) -> int:
        return self.kv_lora_rank

    @property
    def rope_offset(self) -> int:
        return self.kv_lora_rank + 4 * self.num_tiles

    @property
    def bytes_per_token(self) -> int:
        return self.rope_offset + 2 * self.rope_dim

    @property
    def dim(self) -> int:
        """Values per token once dequantised (``kv_lora_rank + rope_dim``)."""
        return self.kv_lora_rank + self.rope_dim


def fp8_row_bytes(kv_lora_rank: int, rope_dim: int) -> int:
    """``kv_lora_rank + 4 * kv_lora_rank / 128 + 2 * rope_dim`` (checked as :class:`MlaFp8Layout`)."""
    return MlaFp8Layout(kv_lora_rank, rope_dim).bytes_per_token


def _e4m3() -> torch.dtype:
    f8 = getattr(torch, "float8_e4m3fn", None)
    if f8 is None:
        raise RuntimeError("the FP8 latent layout needs a torch build with float8_e4m3fn")
    return f8


def quantize_mla_latents(kv: torch.Tensor, kv_lora_rank: int = 512) -> torch.Tensor:
    """Pack ``kv [..., kv_lora_rank + rope_dim]`` (bf16, fp16 or fp32; e.g. ``[N, 576]`` or a
    pool's ``[N, 1, 576]``) into the FP8 layout ``[..., bytes_per_token]`` uint8 (``[N, 656]``).
    The latent is quantised per 128-value tile with power-of-two scales (module docstring);
    the rope part is stored as bf16 (bit-exact for bf16 input)."""
    if not isinstance(kv, torch.Tensor) or kv.dim() < 1 or kv.dtype not in (torch.bfloat16, torch.float16,
                                                                             torch.float32):
        raise ValueError(f"kv must be a [..., kv_lora_rank + rope_dim] bf16/fp16/fp32 tensor; got "
                         f"{getattr(kv, 'dtype', type(kv).__name__)} {tuple(getattr(kv, 'shape', ()))}")
    if not isinstance(kv_lora_rank, int) or not 0 < kv_lora_rank < kv.shape[-1]:
        raise ValueError(f"kv_lora_rank must be an int in (0, {kv.shape[-1]}) (kv's last dim); got {kv_lora_rank}")
    layout = MlaFp8Layout(kv_lora_rank, kv.shape[-1] - kv_lora_rank)
    lead = kv.shape[:-1]
    n = math.prod(lead)
    flat = kv.reshape(n, kv.shape[-1])
    lat = flat[:, :kv_lora_rank].float().view(n, layout.num_tiles, FP8_TILE)
    amax = lat.abs().amax(dim=-1) / FP8_MAX
    # 2 ** ceil(log2(x)) without a float log: x = m * 2**e with m in [0.5, 1)
    mant, expo = torch.frexp(amax.clamp_min(MIN_SCALE_BEFORE_ROUNDING))
    scale = torch.ldexp(torch.ones_like(mant), expo - (mant == 0.5).to(expo.dtype))
    values = (lat / scale[..., None]).to(_e4m3()).view(torch.uint8).view(n, kv_lora_rank)
    out = torch.empty((n, layout.bytes_per_token), dtype=torch.uint8, device=kv.device)
    out[:, :layout.scale_offset] = values
    out[:, layout.scale_offset:layout.rope_offset] = scale.contiguous().view(torch.uint8).view(n, 4 * layout.num_tiles)
    out[:, layout.rope_offset:] = flat[:, kv_lora_rank:].to(torch.bfloat16).contiguous().view(torch.uint8)
    return out.view(*lead, layout.bytes_per_token)


def dequantize_mla_latents(packed: torch.Tensor, kv_lora_rank: int = 512) -> torch.Tensor:
    """Unpack the FP8 layout ``packed [..., bytes_per_token]`` uint8 (``[N, 656]``) into ``[...,
    kv_lora_rank + rope_dim]`` bf16 (``[N, 576]``): latent ``fp8 * scale`` (computed in fp32,
    exact for power-of-two scales), rope bit-exact."""
    if not isinstance(packed, torch.Tensor) or packed.dim() < 1 or packed.dtype != torch.uint8:
        raise ValueError(f"packed must be a [..., bytes_per_token] uint8 tensor; got "
                         f"{getattr(packed, 'dtype', type(packed).__name__)} {tuple(getattr(packed, 'shape', ()))}")
    layout = MlaFp8Layout.of_row(kv_lora_rank, packed.shape[-1], name="packed's last dim")
    lead = packed.shape[:-1]
    n = math.prod(lead)
    flat = packed.reshape(n, packed.shape[-1])
    vals = flat[:, :layout.scale_offset].contiguous().view(_e4m3()).float().view(n, layout.num_tiles, FP8_TILE)
    scale = flat[:, layout.scale_offset:layout.rope_offset].contiguous().view(torch.float32)
    out = torch.empty((n, layout.dim), dtype=torch.bfloat16, device=packed.device)
    out[:, :kv_lora_rank] = (vals * scale[..., None]).view(n, kv_lora_rank)
    out[:, kv_lora_rank:] = flat[:, layout.rope_offset:].contiguous().view(torch.bfloat16)
    return out.view(*lead, layout.dim)


@triton.jit
def load_fp8_latent_rows(KV, Scales, idx, valid, stride_kvn, stride_sn,
                         NUM_TILES: tl.constexpr, BLOCK_T: tl.constexpr, TILE: tl.constexpr, BLOCK_N: tl.constexpr):
    """``[N, BLOCK_T * TILE]`` fp32 latent rows ``fp8 * scale`` of slots ``idx`` (zeros where
    not ``valid`` and past ``NUM_TILES`` tiles). ``KV``: the uint8 rows (row stride
    ``stride_kvn`` bytes); ``Scales``: their float32 scales (row stride ``stride_sn``)."""
    offs_t = tl.arange(0, BLOCK_T)
    offs_c = tl.arange(0, TILE)
    row = tl.where(valid, idx, 0).to(tl.int64)
    m2 = valid[:, None] & (offs_t < NUM_TILES)[None, :]                                   # [N, T]
    sc = tl.load(Scales + row[:, None] * stride_sn + offs_t[None, :], mask=m2, other=0.0)
    m3 = m2[:, :, None] & (offs_c < TILE)[None, None, :]                                  # [N, T, TILE]
    raw = tl.load(KV + (row * stride_kvn)[:, None, None] + (offs_t * TILE)[None, :, None] + offs_c[None, None, :],
                  mask=m3, other=0)
    x = raw.to(tl.float8e4nv, bitcast=True).to(tl.float32) * sc[:, :, None]
    return tl.reshape(x, (BLOCK_N, BLOCK_T * TILE))


@triton.jit
def load_fp8_latent_cols(KV, Scales, idx, valid, stride_kvn, stride_sn,
                         NUM_TILES: tl.constexpr, BLOCK_T: tl.constexpr, TILE: tl.constexpr, BLOCK_N: tl.constexpr):
    """:func:`load_fp8_latent_rows` transposed at load time: ``[BLOCK_T * TILE, N]`` fp32."""
    offs_t = tl.arange(0, BLOCK_T)
    offs_c = tl.arange(0, TILE)
    row = tl.where(valid, idx, 0).to(tl.int64)
    m2 = (offs_t < NUM_TILES)[:, None] & valid[None, :]                                   # [T, N]
    sc = tl.load(Scales + offs_t[:, None] + row[None, :] * stride_sn, mask=m2, other=0.0)
    m3 = m2[:, None, :] & (offs_c < TILE)[None, :, None]                                  # [T, TILE, N]
    raw = tl.load(KV + (offs_t * TILE)[:, None, None] + offs_c[None, :, None] + (row * stride_kvn)[None, None, :],
                  mask=m3, other=0)
    x = raw.to(tl.float8e4nv, bitcast=True).to(tl.float32) * sc[:, None, :]
    return tl.reshape(x, (BLOCK_T * TILE, BLOCK_N))
