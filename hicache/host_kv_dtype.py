"""The dtypes KV may take outside the GPU (host pool, L3), the formats of the KV cache
itself (``KV_CACHE_DTYPES``), and what each adds to an L3 namespace; torch-free, so option
checks can name them without importing the page format (``hicache.kv_page_format``)."""
from __future__ import annotations

HOST_KV_DTYPES = ("auto", "fp8_e4m3")
"""``auto``: the model's KV dtype; ``fp8_e4m3``: E4M3 values with per-page, per-head scales."""


def check_host_kv_dtype(value: object, name: str = "host_kv_dtype") -> str:
    """``value`` if it names a host KV dtype, else a ``ValueError`` listing them."""
    if value not in HOST_KV_DTYPES:
        raise ValueError(f"{name} must be one of {HOST_KV_DTYPES}, got {value!r}")
    return value  # type: ignore[return-value]


def namespace_suffix(host_kv_dtype: str) -> str:
    """What an L3 namespace adds for pages in ``host_kv_dtype``: nothing for the model's
    dtype, ``-kv-fp8e4m3-p2s`` for FP8 pages (see ``KVPageFormat.namespace_tag``)."""
    return "" if check_host_kv_dtype(host_kv_dtype) == "auto" else "-kv-fp8e4m3-p2s"


KV_CACHE_DTYPES = ("auto", "fp8_e4m3")
"""The KV cache's own format on every tier (SGLang's ``--kv-cache-dtype``): ``auto``: the
model's dtype; ``fp8_e4m3`` (MLA only): each token's latent row in the DeepSeek-V3.2 /
FlashMLA FP8 layout (E4M3 latent, one float32 power-of-two scale per 128 values, bf16
rope), stored as uint8 bytes (``KVCacheSpec.mla_fp8``)."""


def check_kv_cache_dtype(value: object, name: str = "kv_cache_dtype") -> str:
    """``value`` if it names a KV cache format, else a ``ValueError`` listing them."""
    if value not in KV_CACHE_DTYPES:
        raise ValueError(f"{name} must be one of {KV_CACHE_DTYPES}, got {value!r}")
    return value  # type: ignore[return-value]


def kv_cache_namespace_suffix(kv_cache_dtype: str) -> str:
    """What an L3 namespace adds for a KV cache in ``kv_cache_dtype``: nothing for the
    model's dtype, ``-kv-mla-fp8e4m3-t128`` for FP8 latent rows (see
    ``KVPageFormat.namespace_tag``)."""
    return "" if check_kv_cache_dtype(kv_cache_dtype) == "auto" else "-kv-mla-fp8e4m3-t128"
