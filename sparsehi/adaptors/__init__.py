"""Backend adaptors: SparseSelection → an attention backend's metadata, and its decode.

``create_adaptor(name, **kw)`` with name in ``sparsehi.config.SPARSE_BACKENDS``:
``flashattention`` (page table, ``flash_attn_with_kvcache`` contract), ``triton``
(``kv_indptr`` / ``kv_indices``), ``dsa`` (token indices into the MLA buffer).
"""
from __future__ import annotations

from typing import Any

from sparsehi.adaptors.base import BackendAdaptor
from sparsehi.adaptors.dsa import DSAAdaptor, DSAMetadata
from sparsehi.adaptors.flash_attention import FlashAttentionAdaptor, FlashAttentionMetadata
from sparsehi.adaptors.triton_backend import TritonAdaptor, TritonMetadata

ADAPTORS: dict[str, type[BackendAdaptor]] = {
    "flashattention": FlashAttentionAdaptor,
    "triton": TritonAdaptor,
    "dsa": DSAAdaptor,
}


def create_adaptor(name: str, **kw: Any) -> BackendAdaptor:
    """Instantiate the adaptor ``name`` (one of ``ADAPTORS``) with its keyword options
    (``impl``; DSA also ``kv_lora_rank``)."""
    if name not in ADAPTORS:
        raise ValueError(f"adaptor name must be one of {tuple(ADAPTORS)}; got {name!r}")
    return ADAPTORS[name](**kw)


__all__ = [
    "ADAPTORS", "BackendAdaptor", "DSAAdaptor", "DSAMetadata", "FlashAttentionAdaptor",
    "FlashAttentionMetadata", "TritonAdaptor", "TritonMetadata", "create_adaptor",
]
