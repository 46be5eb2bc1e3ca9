"""Shape of one model's KV cache, shared by the device pool, host pool and transfers."""
from __future__ import annotations

from dataclasses import dataclass

import torch

ATTENTION_KINDS = ("mha", "mla")
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float8_e4m3fn, torch.float8_e5m2, torch.uint8, torch.int8)


@dataclass(frozen=True)
class KVCacheSpec:
    """KV geometry of one model (per TP rank).

    MHA: per layer ``k`` and ``v`` of ``[slots, kv_heads, head_dim]``.
    MLA: per layer one ``kv`` of ``[slots, 1, kv_lora_rank + rope_dim]`` (``head_dim`` is that sum).
    ``kv_lora_rank`` (MLA only) is the width of the latent part that doubles as the value;
    ``None`` means ``head_dim - 64`` (DeepSeek: 576 = 512 + 64).
    """

    attention: str
    num_layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    page_size: int
    kv_lora_rank: int | None = None

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

    @property
    def num_buffers(self) -> int:
        """2 for MHA (k, v), 1 for MLA (kv)."""
        return 2 if self.attention == "mha" else 1

    @property
    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def value_dim(self) -> int:
        """Width of the value: MHA ``head_dim``; MLA ``kv_lora_rank``."""
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
