"""Backend adapters: SparseSelection → an attention backend's metadata, and its decode.

``create_adapter(name, **kw)`` with name in ``sparsehi.config.SPARSE_BACKENDS``:
``flashattention`` (page table, ``flash_attn_with_kvcache`` contract), ``triton``
(``kv_indptr`` / ``kv_indices``), ``dsa`` (token indices into the MLA buffer).
"""
from __future__ import annotations

from typing import Any

from sparsehi.adapters.base import BackendAdapter
from sparsehi.adapters.dsa import DSAAdapter, DSAMetadata
from sparsehi.adapters.flash_attention import FlashAttentionAdapter, FlashAttentionMetadata
from sparsehi.adapters.triton_backend import TritonAdapter, TritonMetadata

ADAPTERS: dict[str, type[BackendAdapter]] = {
    "flashattention": FlashAttentionAdapter,
    "triton": TritonAdapter,
    "dsa": DSAAdapter,
}


def create_adapter(name: str, **kw: Any) -> BackendAdapter:
    """Instantiate the adapter ``name`` (one of ``ADAPTERS``) with its keyword options
    (``impl``; DSA also ``kv_lora_rank``)."""
    if name not in ADAPTERS:
        raise ValueError(f"adapter name must be one of {tuple(ADAPTERS)}; got {name!r}")
    return ADAPTERS[name](**kw)


__all__ = [
    "ADAPTERS", "BackendAdapter", "DSAAdapter", "DSAMetadata", "FlashAttentionAdapter",
    "FlashAttentionMetadata", "TritonAdapter", "TritonMetadata", "create_adapter",
]
