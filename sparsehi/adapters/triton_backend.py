"""TritonAdapter: a SparseSelection as SGLang Triton / FlashInfer decode metadata.

Those backends take token granularity: ``kv_indptr [B+1]`` and ``kv_indices [nnz]`` token
slots, row ``b`` at ``kv_indices[kv_indptr[b]:kv_indptr[b+1]]``. Selected pages are
expanded to their token slots on the device. The metadata has a fixed shape for CUDA
graphs: ``kv_indices`` always holds ``B * max_kv_len`` entries, rows packed from the
front as ``kv_indptr`` bounds them, the tail past ``kv_indptr[B]`` is slot 0 (padding).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from sparsehi.adapters.base import BackendAdapter
from sparsehi.adapters.flash_attention import (_bad, build_page_table, check_sparse_selection, cumulative_lengths,
                                               split_mha_cache)
from sparsehi.kernels.paged_decode import check_decode_inputs
from sparsehi.kernels.ragged_decode import ragged_decode, ragged_decode_reference, ragged_decode_triton
from sparsehi.selection import SparseSelection

IMPLS = ("auto", "triton", "reference")


def expand_to_token_slots(selection: SparseSelection) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token slots of a selection, on its device, no host sync.

    Returns ``slots [B, T] int64`` (T = N * page_size; token ``t`` of row ``b`` is slot
    ``page_table[b, t // ps] * ps + t % ps``), ``valid [B, T] bool`` (``t <
    cache_seqlens[b]``) and ``seqlens [B] int32``.
    """
    page_table, seqlens = build_page_table(selection)
    ps = selection.page_size
    T = page_table.shape[1] * ps
    t = torch.arange(T, device=page_table.device)
    slots = page_table.long()[:, t // ps] * ps + (t % ps)[None, :]
    valid = t[None, :] < seqlens.long()[:, None]
    return slots, valid, seqlens


@dataclass
class TritonMetadata:
    """Ragged decode metadata for one layer.

    kv_indptr:  ``[B+1] int32`` row bounds into kv_indices.
    kv_indices: ``[B * max_kv_len] int32`` token slots, packed rows, 0 padded at the end.
    max_kv_len: static bound of one row's length (``max_pages * page_size``).
    """

    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    max_kv_len: int


class TritonAdapter(BackendAdapter):
    """Sparse selection → ``kv_indptr`` / ``kv_indices`` ragged decode.

    impl: ``auto`` (Triton on CUDA, torch reference on CPU), ``triton`` or ``reference``.
    """

    name = "triton"

    def __init__(self, impl: str = "auto", validate: bool = False) -> None:
        if impl not in IMPLS:
            _bad("impl", f"one of {IMPLS}", impl)
        self.impl = impl
        self.validate = bool(validate)

    def build_metadata(self, selection: SparseSelection) -> TritonMetadata:
        check_sparse_selection(selection)
        self.check_values(selection)
        slots, valid, seqlens = expand_to_token_slots(selection)
        B, T = slots.shape
        indptr = cumulative_lengths(seqlens)
        # packed position of each valid token; invalid ones go to a dump entry past the end
        dest = torch.where(valid, indptr[:-1].long()[:, None] + torch.arange(T, device=slots.device)[None, :],
                           torch.full((), B * T, dtype=torch.long, device=slots.device))
        buf = torch.zeros(B * T + 1, dtype=torch.int32, device=slots.device)
        buf.scatter_(0, dest.reshape(-1), slots.reshape(-1).to(torch.int32))
        return TritonMetadata(kv_indptr=indptr, kv_indices=buf[: B * T], max_kv_len=T)

    def forward_decode(self, q: torch.Tensor, layer_cache: Any, metadata: TritonMetadata, *,
                       sm_scale: float) -> torch.Tensor:
        """q ``[B, Hq, D]``; layer_cache ``(k_buffer, v_buffer)`` ``[num_slots, Hkv, D]``.
        Returns ``[B, Hq, Dv]``."""
        if not isinstance(metadata, TritonMetadata):
            _bad("metadata", "a TritonMetadata from build_metadata", type(metadata))
        k_buffer, v_buffer = split_mha_cache(layer_cache, "TritonAdapter")
        B, *_ = check_decode_inputs(q, k_buffer, v_buffer, 1)
        if metadata.kv_indptr.shape[0] != B + 1:
            _bad("q", f"with batch {metadata.kv_indptr.shape[0] - 1} (the metadata's)", B)
        if self._value_checks():
            from sparsehi.adapters.checks import check_pool_range

            check_pool_range("metadata.kv_indices", metadata.kv_indices[None], k_buffer.shape[0], "slot")
        fn = {"auto": ragged_decode, "triton": ragged_decode_triton, "reference": ragged_decode_reference}[self.impl]
        return fn(q, k_buffer, v_buffer, metadata.kv_indptr, metadata.kv_indices,
                  max_kv_len=metadata.max_kv_len, sm_scale=sm_scale)
