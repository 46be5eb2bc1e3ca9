"""GQA decode attention over ragged token-slot lists (SGLang Triton / FlashInfer form).

Row ``b`` attends to the token slots ``kv_indices[kv_indptr[b]:kv_indptr[b+1]]`` of the
flat pool buffers ``[num_slots, Hkv, D]``. The kernel is the paged decode kernel with
page size 1 and per-row start offsets taken from ``kv_indptr`` (see ``paged_decode.py``),
so the two forms share one tuned implementation.
"""
from __future__ import annotations

from typing import Optional

import torch

from hicache.triton_support import dispatch
from sparsehi.kernels.flash_decoding import fail
from sparsehi.kernels.paged_decode import (DecodeLaunchConfig, check_decode_inputs, decode_over_table,
                                           gathered_decode_reference)


def _check_ragged(kv_indptr: torch.Tensor, kv_indices: torch.Tensor, B: int, max_kv_len: int,
                  device: torch.device) -> None:
    if not isinstance(kv_indptr, torch.Tensor) or tuple(kv_indptr.shape) != (B + 1,):
        fail("kv_indptr", f"a [B+1={B + 1}] tensor", getattr(kv_indptr, "shape", type(kv_indptr)))
    if not isinstance(kv_indices, torch.Tensor) or kv_indices.dim() != 1:
        fail("kv_indices", "a 1-D [nnz] tensor", getattr(kv_indices, "shape", type(kv_indices)))
    for name, t in (("kv_indptr", kv_indptr), ("kv_indices", kv_indices)):
        if t.dtype not in (torch.int32, torch.int64):
            fail(name, "int32 or int64", t.dtype)
        if t.device != device:
            fail(name, f"on q's device {device}", t.device)
    if not isinstance(max_kv_len, int) or max_kv_len < 0:
        fail("max_kv_len", "an int >= 0 bounding every row's length", max_kv_len)


def ragged_decode_triton(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                         kv_indptr: torch.Tensor, kv_indices: torch.Tensor, *, max_kv_len: int,
                         sm_scale: float, config: Optional[DecodeLaunchConfig] = None) -> torch.Tensor:
    """Triton ragged decode.

    q ``[B, Hq, D]``; k_buffer ``[num_slots, Hkv, D]``; v_buffer ``[num_slots, Hkv, Dv]``;
    kv_indptr ``[B+1]`` int32 row bounds into kv_indices ``[nnz]`` int32 token slots;
    max_kv_len: static bound of ``kv_indptr[b+1] - kv_indptr[b]`` (sets the split count;
    rows longer than it are cut; entries past the end of ``kv_indices`` are never read nor
    attended). Returns ``[B, Hq, Dv]``; empty rows are zeros.
    """
    B, *_ = check_decode_inputs(q, k_buffer, v_buffer, 1)
    _check_ragged(kv_indptr, kv_indices, B, max_kv_len, q.device)
    lens = (kv_indptr[1:] - kv_indptr[:-1]).clamp(0, max_kv_len).to(torch.int32)
    if kv_indices.stride(0) != 1:  # the kernel indexes the table as a flat array
        kv_indices = kv_indices.contiguous()
    return decode_over_table(q, k_buffer, v_buffer, kv_indices, kv_indptr[:-1], lens,
                             page_size=1, max_tokens=max_kv_len, sm_scale=sm_scale,
                             table_len=kv_indices.numel(), config=config)


def ragged_decode_reference(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                            kv_indptr: torch.Tensor, kv_indices: torch.Tensor, *, max_kv_len: int,
                            sm_scale: float, config: Optional[DecodeLaunchConfig] = None) -> torch.Tensor:
    """Torch reference of :func:`ragged_decode_triton` (same arguments and result)."""
    B, *_ = check_decode_inputs(q, k_buffer, v_buffer, 1)
    _check_ragged(kv_indptr, kv_indices, B, max_kv_len, q.device)
    t = torch.arange(max_kv_len, device=q.device)
    start = kv_indptr[:-1].long()[:, None]
    lens = (kv_indptr[1:] - kv_indptr[:-1]).long().clamp(0, max_kv_len)
    # entries past the end of kv_indices are not attended (as in the kernel)
    mask = (t[None, :] < lens[:, None]) & (start + t[None, :] >= 0) & (start + t[None, :] < kv_indices.numel())
    pos = torch.where(mask, start + t[None, :], torch.zeros_like(start))
    if kv_indices.numel() == 0:
        slots = torch.zeros_like(pos)
    else:
        slots = kv_indices.long()[pos.clamp(max=kv_indices.numel() - 1)]
    mask = mask & (slots >= 0) & (slots < k_buffer.shape[0])
    slots = torch.where(mask, slots, torch.zeros_like(slots))
    return gathered_decode_reference(q, k_buffer[slots], v_buffer[slots], mask, sm_scale)


def ragged_decode(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                  kv_indptr: torch.Tensor, kv_indices: torch.Tensor, *, max_kv_len: int,
                  sm_scale: float, config: Optional[DecodeLaunchConfig] = None) -> torch.Tensor:
    """Ragged GQA decode; Triton on CUDA, the torch reference elsewhere."""
    impl = dispatch("ragged_decode", q, ragged_decode_triton, ragged_decode_reference)
    return impl(q, k_buffer, v_buffer, kv_indptr, kv_indices, max_kv_len=max_kv_len, sm_scale=sm_scale,
                config=config)
