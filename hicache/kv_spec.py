"""Shape of one model's KV cache, shared by the device pool, host pool and transfers."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from hicache.host_kv_dtype import check_kv_cache_dtype

ATTENTION_KINDS = ("mha", "mla")
FP8_LATENT_TILE = 128
"""Latent values per float32 scale in an FP8 latent row."""


def fp8_latent_row_bytes(kv_lora_rank: int, rope_dim: int) -> int:
    """Bytes of one token's FP8 latent row: ``kv_lora_rank`` E4M3 values, a float32 scale per
    ``FP8_LATENT_TILE`` of them, ``rope_dim`` bf16 values."""
    return kv_lora_rank + 4 * (kv_lora_rank // FP8_LATENT_TILE) + 2 * rope_dim


_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float8_e4m3fn, torch.float8_e5m2, torch.uint8, torch.int8)


@dataclass(frozen=True)
class KVCacheSpec:
    """KV geometry of one model (per TP rank).

    MHA: per layer ``k`` and ``v`` of ``[slots, kv_heads, head_dim]``.
    MLA: per layer one ``kv`` of ``[slots, 1, kv_lora_rank + rope_dim]`` (``head_dim`` is that sum).
    ``kv_lora_rank`` (MLA only) is the width of the latent part that doubles as the value;
    ``None`` means ``head_dim - 64`` (DeepSeek: 576 = 512 + 64).

    ``kv_cache_dtype="fp8_e4m3"`` (MLA only; build it with :meth:`mla_fp8`): each token's
    ``kv`` is its row in the DeepSeek-V3.2 / FlashMLA FP8 latent layout, ``head_dim`` uint8
    bytes: ``kv_lora_rank`` E4M3 latent values, ``kv_lora_rank / 128`` float32 scales, then
    the rope part as bf16 (656 bytes for 512 + 64). Pools, host pages and copies move those
    bytes as they are; only attention kernels and readers that dequantise know the layout.
    """

    attention: str
    num_layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    page_size: int
    kv_lora_rank: int | None = None
    kv_cache_dtype: str = "auto"

    @classmethod
    def mla_fp8(cls, num_layers: int, kv_lora_rank: int, rope_dim: int, page_size: int) -> "KVCacheSpec":
        """The spec of an MLA cache of FP8 latent rows: ``kv_lora_rank + 4 * kv_lora_rank / 128
        + 2 * rope_dim`` uint8 bytes a token and layer."""
        row = fp8_latent_row_bytes(kv_lora_rank, rope_dim)
        return cls(attention="mla", num_layers=num_layers, kv_heads=1, head_dim=row, dtype=torch.uint8,
                   page_size=page_size, kv_lora_rank=kv_lora_rank, kv_cache_dtype="fp8_e4m3")

    def __post_init__(self) -> None:
        if self.attention not in ATTENTION_KINDS:
            raise ValueError(f"attention must be one of {ATTENTION_KINDS}, got {self.attention!r}")
        for name in ("num_layers", "kv_heads", "head_dim", "page_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.attention == "mla" and self.kv_heads != 1:
            raise ValueError(f"kv_heads must be 1 for attention='mla', got {self.kv_heads}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if self.kv_lora_rank is not None:
            if self.attention != "mla":
                raise ValueError("kv_lora_rank is only valid for attention='mla'")
            if not 0 < self.kv_lora_rank <= self.head_dim:
                raise ValueError(f"kv_lora_rank must be in (0, head_dim={self.head_dim}], got {self.kv_lora_rank}")
        check_kv_cache_dtype(self.kv_cache_dtype)
        if self.fp8_latent_rows:
            self._check_fp8_rows()

    def _check_fp8_rows(self) -> None:
        r = self.kv_lora_rank
        if self.attention != "mla" or self.dtype != torch.uint8 or r is None or r % FP8_LATENT_TILE:
            raise ValueError(f"kv_cache_dtype='fp8_e4m3' is for MLA caches of uint8 rows with kv_lora_rank a multiple "
                             f"of {FP8_LATENT_TILE} (KVCacheSpec.mla_fp8), got attention={self.attention!r}, "
                             f"dtype={self.dtype}, kv_lora_rank={r}")
        rope_bytes = self.head_dim - fp8_latent_row_bytes(r, 0)
        if rope_bytes <= 0 or rope_bytes % 4:
            raise ValueError(f"kv_cache_dtype='fp8_e4m3': head_dim={self.head_dim} bytes must be kv_lora_rank + "
                             f"kv_lora_rank / 32 + 2 * rope_dim with an even rope_dim > 0 (kv_lora_rank={r})")

    @property
    def fp8_latent_rows(self) -> bool:
        """Rows in the FP8 latent layout (``kv_cache_dtype="fp8_e4m3"``)."""
        return self.kv_cache_dtype == "fp8_e4m3"

    @property
    def rope_dim(self) -> int:
        """MLA: width of the rope part of a token's ``kv`` (FP8 rows: its bf16 values)."""
        if self.attention != "mla":
            raise ValueError("rope_dim is only defined for attention='mla'")
        if self.fp8_latent_rows:
            return (self.head_dim - fp8_latent_row_bytes(self.value_dim, 0)) // 2
        return self.head_dim - self.value_dim

    @property
    def num_buffers(self) -> int:
        """2 for MHA (k, v), 1 for MLA (kv)."""
        return 2 if self.attention == "mha" else 1

    @property
    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def value_dim(self) -> int:
        """Width of the value: MHA ``head_dim``; MLA ``kv_lora_rank`` (FP8 rows: latent values,
        one byte each)."""
        if self.attention == "mha":
            return self.head_dim
        if self.kv_lora_rank is not None:
            return self.kv_lora_rank
        return self.head_dim - 64 if self.head_dim > 64 else self.head_dim

    @property
    def row_bytes(self) -> int:
        """Bytes of one token of one layer in one buffer (``kv_heads * head_dim`` elements)."""
        return self.kv_heads * self.head_dim * self.element_size

    @property
    def token_bytes_per_layer(self) -> int:
        """Bytes of one token of one layer, all buffers (k + v for MHA)."""
        return self.row_bytes * self.num_buffers

    @property
    def token_bytes(self) -> int:
        """Bytes of one token across all layers."""
        return self.token_bytes_per_layer * self.num_layers

    @property
    def page_bytes_per_layer(self) -> int:
        return self.token_bytes_per_layer * self.page_size
