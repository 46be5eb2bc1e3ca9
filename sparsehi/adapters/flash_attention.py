"""FlashAttentionAdapter: a SparseSelection as ``flash_attn_with_kvcache`` paged metadata.

The selected pages (sink, Top-k, recent window) become one row of a page table in logical
order; FlashAttention then sees a short contiguous sequence whose only partial page is the
last one, which is exactly what the selection guarantees (the page being written is always
selected and comes last). Padding entries of the page table are page 0, the page hicache
reserves as padding (-1 would also be masked by the Triton kernel).

Backend order: ``sgl_kernel.flash_attn`` (FA3, any page size) → ``flash_attn`` (FA2, only
for page sizes that are multiples of 256) → the project's Triton paged decode kernel
(same contract) → the torch reference on CPU tensors. Which one ran is logged once.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from hicache.triton_support import announce_path, use_triton
from sparsehi.adapters.base import BackendAdapter
from sparsehi.kernels.paged_decode import (
    check_decode_inputs,
    flash_attn_with_kvcache_triton,
    paged_decode_reference,
)
from sparsehi.selection import SparseMode, SparseSelection

IMPLS = ("auto", "flash_attn", "triton", "reference")


def _bad(name: str, allowed: str, got: object) -> None:
    raise ValueError(f"{name} must be {allowed}; got {got}")


def check_sparse_selection(selection: SparseSelection) -> tuple[int, int]:
    """Shape / dtype / device checks of a ``SparseSelection`` for the adapters (no host
    sync); returns (B, N). Not to be confused with
    :func:`sparsehi.algorithms.base.check_selection`, which checks a ``retrieve_topk`` result."""
    if not isinstance(selection, SparseSelection):
        _bad("selection", "a sparsehi.selection.SparseSelection", type(selection))
    lid, pid = selection.logical_ids, selection.physical_ids
    if not isinstance(lid, torch.Tensor) or lid.dim() != 2:
        _bad("selection.logical_ids", "a [B, N] tensor", getattr(lid, "shape", type(lid)))
    if not isinstance(pid, torch.Tensor) or tuple(pid.shape) != tuple(lid.shape):
        _bad("selection.physical_ids", f"a tensor of logical_ids' shape {tuple(lid.shape)}", getattr(pid, "shape", type(pid)))
    B, N = lid.shape
    for name in ("num_valid", "seq_lens"):
        t = getattr(selection, name)
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != (B,):
            _bad(f"selection.{name}", f"a [B={B}] tensor", getattr(t, "shape", type(t)))
    for name in ("logical_ids", "physical_ids", "num_valid", "seq_lens"):
        t = getattr(selection, name)
        if t.dtype not in (torch.int32, torch.int64):
            _bad(f"selection.{name}", "int32 (or int64)", t.dtype)
        if t.device != lid.device:
            _bad(f"selection.{name}", f"on logical_ids' device {lid.device}", t.device)
    ps = selection.page_size
    if not isinstance(ps, int) or ps < 1:
        _bad("selection.page_size", "an int >= 1", ps)
    if selection.mode is SparseMode.TOKEN_WISE and ps != 1:
        _bad("selection.page_size", "1 in token-wise mode", ps)
    return B, N


def build_page_table(selection: SparseSelection) -> tuple[torch.Tensor, torch.Tensor]:
    """Page table and attended lengths of a selection, on its device, no host sync.

    Returns ``page_table`` ``[B, N] int32`` (physical pages in logical order, 0 padded) and
    ``cache_seqlens`` ``[B] int32`` = ``(num_valid - 1) * page_size`` + the tokens of the
    last (possibly partial) selected page; 0 for empty rows. Lengths are clamped to the
    table so an inconsistent selection can never make a kernel read past it.
    """
    B, N = check_sparse_selection(selection)
    if selection.page_table is not None and selection.attended is not None:
        return selection.page_table, selection.attended  # built with the selection
    ps = selection.page_size
    dev = selection.logical_ids.device
    nv = selection.num_valid.long().clamp_(0, N)
    valid = _arange(N, dev)[None, :] < nv[:, None]
    # built in the selection's own dtype: one op fewer per layer than a round trip via int64
    page_table = torch.where(valid, selection.physical_ids, 0).to(torch.int32)
    if N == 0:
        return page_table, torch.zeros(B, dtype=torch.int32, device=dev)
    last = (nv - 1).clamp_(min=0)
    last_logical = selection.logical_ids.gather(1, last[:, None]).squeeze(1)
    tail = (selection.seq_lens - last_logical * ps).clamp_(0, ps)
    seqlens = torch.where(nv > 0, last * ps + tail, 0)
    return page_table, seqlens.to(torch.int32)


_ARANGE: dict = {}


def _arange(n: int, device: torch.device) -> torch.Tensor:
    """Cached read-only ``torch.arange(n)`` (int64) per device: built once, not per layer."""
    t = _ARANGE.get((n, device))
    if t is None:
        t = _ARANGE[(n, device)] = torch.arange(n, device=device)
    return t


def cumulative_lengths(seqlens: torch.Tensor) -> torch.Tensor:
    """``[B] -> [B+1] int32`` exclusive prefix sums (``cu_seqlens_k`` / ``kv_indptr``)."""
    zero = _ZERO.get(seqlens.device)
    if zero is None:
        zero = _ZERO[seqlens.device] = torch.zeros(1, dtype=torch.int32, device=seqlens.device)
    return torch.cat([zero, torch.cumsum(seqlens, 0, dtype=torch.int32)])


_ZERO: dict = {}


@dataclass
class FlashAttentionMetadata:
    """``flash_attn_with_kvcache`` decode metadata for one layer.

    page_table:    ``[B, max_pages] int32`` physical pages, logical order, 0 padded.
    cache_seqlens: ``[B] int32`` tokens attended per row.
    cu_seqlens_k:  ``[B+1] int32`` prefix sums of cache_seqlens (built on first access:
                   ``flash_attn_with_kvcache`` does not take it, varlen kernels do).
    page_size:     tokens per page; max_seqlen_k: static bound ``max_pages * page_size``.
    """

    page_table: torch.Tensor
    cache_seqlens: torch.Tensor
    page_size: int
    max_seqlen_k: int

    @functools.cached_property
    def cu_seqlens_k(self) -> torch.Tensor:
        return cumulative_lengths(self.cache_seqlens)


def _load_library() -> Optional[tuple[str, Callable[..., Any]]]:
    try:
        from sgl_kernel.flash_attn import flash_attn_with_kvcache  # type: ignore

        return "sgl_kernel.flash_attn", flash_attn_with_kvcache
    except Exception:
        pass
    try:
        from flash_attn import flash_attn_with_kvcache  # type: ignore

        return "flash_attn", flash_attn_with_kvcache
    except Exception:
        return None


def split_mha_cache(layer_cache: Any, adapter: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(k_buffer, v_buffer)`` from a layer cache, or a ValueError saying what is allowed."""
    if not isinstance(layer_cache, (tuple, list)) or len(layer_cache) != 2:
        n = len(layer_cache) if isinstance(layer_cache, (tuple, list)) else type(layer_cache)
        _bad("layer_cache", f"(k_buffer, v_buffer) for {adapter} (MHA; MLA caches go to the 'dsa' adapter)", n)
    return layer_cache[0], layer_cache[1]


class FlashAttentionAdapter(BackendAdapter):
    """Sparse selection → FlashAttention paged decode.

    impl: ``auto`` (library if importable and usable, else Triton on CUDA, torch reference
    on CPU), or one of ``flash_attn`` / ``triton`` / ``reference`` to force a path
    (``triton`` on CPU tensors needs ``TRITON_INTERPRET=1``).
    """

    name = "flashattention"

    def __init__(self, impl: str = "auto", validate: bool = False) -> None:
        if impl not in IMPLS:
            _bad("impl", f"one of {IMPLS}", impl)
        self.impl = impl
        self.validate = bool(validate)
        self._library = _load_library() if impl in ("auto", "flash_attn") else None
        if impl == "flash_attn" and self._library is None:
            raise ValueError("impl='flash_attn' needs sgl_kernel or flash_attn installed; use impl='auto' or 'triton'")

    def build_metadata(self, selection: SparseSelection) -> FlashAttentionMetadata:
        check_sparse_selection(selection)
        self.check_values(selection)
        page_table, seqlens = build_page_table(selection)
        return FlashAttentionMetadata(page_table=page_table, cache_seqlens=seqlens,
                                      page_size=selection.page_size,
                                      max_seqlen_k=page_table.shape[1] * selection.page_size)

    def _path(self, q: torch.Tensor, page_size: int) -> str:
        if self.impl != "auto":
            return self.impl
        if self._library is not None and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
            if self._library[0] == "sgl_kernel.flash_attn" or page_size % 256 == 0:
                return "flash_attn"
        return "triton" if use_triton(q) else "reference"

    def forward_decode(self, q: torch.Tensor, layer_cache: Any, metadata: FlashAttentionMetadata, *,
                       sm_scale: float) -> torch.Tensor:
        """q ``[B, Hq, D]``; layer_cache ``(k_buffer, v_buffer)`` ``[num_slots, Hkv, D]``.
        Returns ``[B, Hq, Dv]``."""
        if not isinstance(metadata, FlashAttentionMetadata):
            _bad("metadata", "a FlashAttentionMetadata from build_metadata", type(metadata))
        k_buffer, v_buffer = split_mha_cache(layer_cache, "FlashAttentionAdapter")
        ps = metadata.page_size
        B, Hq, Hkv, D, Dv = check_decode_inputs(q, k_buffer, v_buffer, ps)
        if metadata.page_table.shape[0] != B:
            _bad("q", f"with batch {metadata.page_table.shape[0]} (the metadata's)", B)
        if metadata.page_table.device != q.device:
            _bad("metadata", f"on q's device {q.device}", metadata.page_table.device)
        num_pages = k_buffer.shape[0] // ps
        if self._value_checks():
            from sparsehi.adapters.checks import check_pool_range

            check_pool_range("metadata.page_table", metadata.page_table, num_pages, "page")
        k_cache = k_buffer.view(num_pages, ps, Hkv, D)
        v_cache = v_buffer.view(num_pages, ps, Hkv, Dv)
        q4 = q.unsqueeze(1)
        path = self._path(q, ps)
        if path == "flash_attn":
            lib_name, fn = self._library  # type: ignore[misc]
            announce_path("FlashAttentionAdapter", lib_name)
            if lib_name == "sgl_kernel.flash_attn":
                out = fn(q4, k_cache, v_cache, cache_seqlens=metadata.cache_seqlens,
                         page_table=metadata.page_table, softmax_scale=sm_scale, causal=True)
            else:
                out = fn(q4, k_cache, v_cache, cache_seqlens=metadata.cache_seqlens,
                         block_table=metadata.page_table, softmax_scale=sm_scale, causal=True)
            if isinstance(out, tuple):
                out = out[0]
        elif path == "triton":
            announce_path("FlashAttentionAdapter", "triton paged_decode")
            out = flash_attn_with_kvcache_triton(q4, k_cache, v_cache, metadata.cache_seqlens,
                                                 metadata.page_table, softmax_scale=sm_scale)
        else:
            announce_path("FlashAttentionAdapter", "torch reference")
            # vectorised (no per-row loop, no host sync); flash_attn_with_kvcache_reference
            # is the per-row ground truth the tests hold both against
            return paged_decode_reference(q, k_buffer, v_buffer, metadata.page_table,
                                          metadata.cache_seqlens, page_size=ps, sm_scale=sm_scale)
        return out[:, 0]
