"""The dtypes KV may take outside the GPU (host pool, L3) and what each adds to an L3
namespace; torch-free, so option checks can name them without importing the page format
(``hicache.kv_page_format``)."""
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
