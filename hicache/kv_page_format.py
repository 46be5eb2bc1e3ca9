"""How one page of KV is stored outside the GPU (host pool, L3): the model's dtype, or FP8.

A page holds ``page_size`` tokens of every layer and buffer (k and v, or MLA's latent). In
the model's dtype it is the ``page_first`` host layout's page, ``[layers, buffers,
page_size, heads, dim]``. With ``host_kv_dtype="fp8_e4m3"`` the same values are stored as
E4M3 with one power-of-two scale per layer, buffer and head (``fp8_page_quantize``), and the
scales travel in the page, after its values:

    [layers, buffers, page_size, heads, dim] uint8 (E4M3) | [layers, buffers, heads] float32

so an FP8 page read from L3 describes itself. The format is part of the page's identity
(``namespace_tag``): an L3 namespace of FP8 pages is never read as the model's dtype.

A KV cache of FP8 latent rows (``KVCacheSpec.kv_cache_dtype="fp8_e4m3"``, MLA) keeps its
pages as they are on the GPU, ``[layers, 1, page_size, 1, row_bytes]`` uint8: each row carries
its own scales, so the page has none (and ``host_kv_dtype="fp8_e4m3"`` is refused there);
its namespace tag is ``kv-mla-fp8e4m3-t128``.

Only complete pages are quantised (a page's scale depends on all its tokens); the tokens of
a page still being filled stay in the model's dtype on the GPU until it is complete.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from hicache.host_kv_dtype import HOST_KV_DTYPES, check_host_kv_dtype, namespace_suffix
from hicache.kernels.fp8_page_dequantize import fp8_page_dequantize
from hicache.kernels.fp8_page_quantize import fp8_page_quantize
from hicache.kv_spec import KVCacheSpec

__all__ = ["HOST_KV_DTYPES", "KVPageFormat", "check_host_kv_dtype", "fp8_round_trip", "namespace_suffix"]

_FP8_SOURCE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class KVPageFormat:
    """The bytes of one KV page outside the GPU for ``spec`` (see the module docstring)."""

    spec: KVCacheSpec
    host_kv_dtype: str = "auto"

    def __post_init__(self) -> None:
        check_host_kv_dtype(self.host_kv_dtype)
        if self.quantized and self.spec.fp8_latent_rows:
            raise ValueError("host_kv_dtype='fp8_e4m3' cannot be combined with kv_cache_dtype='fp8_e4m3': the KV "
                             "cache's latent rows are FP8 already and go to host and L3 as they are; use "
                             "host_kv_dtype='auto'")
        if self.quantized and self.spec.dtype not in _FP8_SOURCE_DTYPES:
            raise ValueError(f"host_kv_dtype='fp8_e4m3' needs a model KV dtype in {_FP8_SOURCE_DTYPES}, "
                             f"got {self.spec.dtype}")
        if self.quantized and self.value_bytes % 4:
            raise ValueError(f"host_kv_dtype='fp8_e4m3' needs a page's values to fill whole 4-byte words (the "
                             f"scales follow them), got {self.value_bytes} bytes for {self.value_shape}")

    @property
    def quantized(self) -> bool:
        return self.host_kv_dtype == "fp8_e4m3"

    @property
    def value_shape(self) -> tuple[int, int, int, int, int]:
        """``[layers, buffers, page_size, heads, dim]`` of a page's values."""
        s = self.spec
        return (s.num_layers, s.num_buffers, s.page_size, s.kv_heads, s.head_dim)

    @property
    def scale_shape(self) -> tuple[int, int, int]:
        """``[layers, buffers, heads]`` of an FP8 page's scales."""
        s = self.spec
        return (s.num_layers, s.num_buffers, s.kv_heads)

    @property
    def value_bytes(self) -> int:
        n = 1
        for d in self.value_shape:
            n *= d
        return n * (1 if self.quantized else self.spec.element_size)

    @property
    def scale_bytes(self) -> int:
        if not self.quantized:
            return 0
        s = self.spec
        return s.num_layers * s.num_buffers * s.kv_heads * 4

    @property
    def page_bytes(self) -> int:
        """Bytes of one page record: values, then scales (FP8)."""
        return self.value_bytes + self.scale_bytes

    @property
    def namespace_tag(self) -> str:
        """Names the page format in an L3 namespace: ``kv-<dtype>`` or ``kv-fp8e4m3-p2s``
        (power-of-two scales per layer, buffer and head); ``kv-mla-fp8e4m3-t128`` for FP8
        latent rows (power-of-two scales per 128 latent values, in each row)."""
        if self.spec.fp8_latent_rows:
            return "kv-mla-fp8e4m3-t128"
        if self.quantized:
            return "kv-fp8e4m3-p2s"
        return "kv-" + str(self.spec.dtype).removeprefix("torch.")

    def split(self, records: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``records [P, page_bytes]`` uint8 (FP8 pages) -> views ``values [P, layers,
        buffers, page_size, heads, dim]`` uint8 (E4M3 bits) and ``scales [P, layers, buffers,
        heads]`` float32. The scales' bytes must be 4-byte aligned in memory."""
        if not self.quantized:
            raise ValueError("split applies to FP8 pages (host_kv_dtype='fp8_e4m3') only")
        if records.dim() != 2 or records.dtype != torch.uint8 or records.shape[1] != self.page_bytes:
            raise ValueError(f"records must be uint8 [P, {self.page_bytes}], got {tuple(records.shape)} {records.dtype}")
        values = records[:, :self.value_bytes].unflatten(1, self.value_shape)
        scales = records[:, self.value_bytes:].view(torch.float32).unflatten(1, self.scale_shape)
        return values, scales

    def quantize_into(self, pages: torch.Tensor, records: torch.Tensor) -> None:
        """Complete pages ``[P, layers, buffers, page_size, heads, dim]`` (the model's dtype)
        -> FP8 page records ``records [P, page_bytes]`` uint8 (written in place)."""
        values, scales = self.split(records)
        if tuple(pages.shape[1:]) != self.value_shape or pages.shape[0] != records.shape[0]:
            raise ValueError(f"pages must be [P={records.shape[0]}, *{self.value_shape}], got {tuple(pages.shape)}")
        fp8_page_quantize(_groups(pages), _groups(values), scales.flatten(1, 2))

    def dequantize(self, records: torch.Tensor, out: torch.Tensor) -> None:
        """FP8 page records ``[P, page_bytes]`` uint8 -> ``out [P, layers, buffers,
        page_size, heads, dim]`` in the model's dtype (exact: ``q * 2**k``)."""
        values, scales = self.split(records)
        if tuple(out.shape[1:]) != self.value_shape or out.shape[0] != records.shape[0]:
            raise ValueError(f"out must be [P={records.shape[0]}, *{self.value_shape}], got {tuple(out.shape)}")
        fp8_page_dequantize(_groups(values), scales.flatten(1, 2), _groups(out))


def _groups(t: torch.Tensor) -> torch.Tensor:
    """``[P, layers, buffers, T, H, D]`` -> ``[P, layers * buffers, T, H, D]`` (a view: a
    page's layers and buffers are contiguous to each other)."""
    return t.flatten(1, 2)


def fp8_round_trip(x: torch.Tensor) -> torch.Tensor:
    """``x [P, G, T, H, D]`` (pages, groups, tokens, heads, dim) as FP8 pages store it: quantised with
    ``fp8_page_quantize`` and read back, in ``x``'s dtype. What a reference run that keeps
    its KV on the GPU uses to compare exactly with a run whose host pages are FP8."""
    q = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    scales = torch.empty((x.shape[0], x.shape[1], x.shape[3]), dtype=torch.float32, device=x.device)
    fp8_page_quantize(x, q, scales)
    out = torch.empty_like(x)
    fp8_page_dequantize(q, scales, out)
    return out
