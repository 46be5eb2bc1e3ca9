"""The dense selection of a decode step in one launch: every page of every row
(``logical [B, M]``, ``-1`` past ``num_pages``) and its physical page in a table, and
optionally what an attention backend reads (the 0-padded page table and the tokens
attended). Graph-safe: no host sync, fixed shapes.

Entry points: ``dense_pages`` (dispatch), ``dense_pages_triton``, ``dense_pages_reference``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from hicache.triton_support import cdiv, dispatch


@dataclass
class DensePages:
    """Every page of every row (``dense_pages``), ``B`` rows, ``M`` columns.

    logical ``[B, M] int32`` (-1 past ``num_pages``); physical ``[B, M] int32`` (-1 where
    logical is); page_table ``[B, M] int32`` (physical, 0 padded) and attended ``[B] int32``
    (tokens attended: ``seq_lens`` clamped to the pages' tokens), or None when not asked for.
    """

    logical: torch.Tensor
    physical: torch.Tensor
    page_table: Optional[torch.Tensor] = None
    attended: Optional[torch.Tensor] = None


def _check_dense(num_pages, safe_rows, table, seq_lens, page_size) -> None:
    if num_pages.dim() != 1 or num_pages.dtype != torch.int32:
        raise ValueError(f"num_pages must be [B] int32, got {tuple(num_pages.shape)} {num_pages.dtype}")
    if safe_rows.shape != num_pages.shape or safe_rows.dtype != torch.int64:
        raise ValueError(f"safe_rows must be [B={num_pages.shape[0]}] int64, got {tuple(safe_rows.shape)} "
                         f"{safe_rows.dtype}")
    if table.dim() != 2 or table.dtype not in (torch.int32, torch.int64) or table.stride(1) != 1:
        raise ValueError(f"table must be a 2-D int32/int64 tensor contiguous in its last dim, got "
                         f"{tuple(table.shape)} {table.dtype}")
    if not (num_pages.device == safe_rows.device == table.device):
        raise ValueError("num_pages, safe_rows and table must be on one device")
    if seq_lens is not None:
        if seq_lens.shape != num_pages.shape or seq_lens.dtype != torch.int32 or seq_lens.device != table.device:
            raise ValueError(f"seq_lens must be [B={num_pages.shape[0]}] int32 on {table.device}, got "
                             f"{tuple(seq_lens.shape)} {seq_lens.dtype}")
        if not isinstance(page_size, int) or isinstance(page_size, bool) or page_size < 1:
            raise ValueError(f"page_size={page_size!r} is invalid: an int >= 1 (with seq_lens)")


def dense_pages_reference(num_pages: torch.Tensor, safe_rows: torch.Tensor, table: torch.Tensor,
                          seq_lens: Optional[torch.Tensor] = None, page_size: Optional[int] = None) -> DensePages:
    """Torch reference of ``dense_pages``."""
    _check_dense(num_pages, safe_rows, table, seq_lens, page_size)
    N = table.shape[1]
    cols = torch.arange(N, device=table.device, dtype=torch.int32)[None, :]
    logical = torch.where(cols < num_pages[:, None], cols, -1)
    lid = logical.long().clamp(min=0)
    phys = torch.where(logical >= 0, table[safe_rows[:, None], lid], -1).to(torch.int32)
    out = DensePages(logical, phys)
    if seq_lens is not None:  # what an attention backend's page table and lengths would be
        nv = num_pages.long().clamp(0, N)
        out.page_table = torch.where(cols < nv[:, None], phys, 0).to(torch.int32)
        if N == 0:
            out.attended = torch.zeros_like(num_pages)
        else:
            last = (nv - 1).clamp(min=0)
            last_logical = logical.gather(1, last[:, None]).squeeze(1)
            tail = (seq_lens - last_logical * page_size).clamp(0, page_size)
            out.attended = torch.where(nv > 0, last * page_size + tail, 0).to(torch.int32)
    return out


@triton.jit
def _dense_pages_kernel(np_ptr, rows_ptr, seq_ptr, tab_ptr, tab_stride, out_ptr, att_ptr, PLANE, M, PS,
                        WITH_TABLE: tl.constexpr, BLOCK_M: tl.constexpr):
    b = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.load(np_ptr + b)
    row = tl.load(rows_ptr + b)
    inside = c < M
    ok = c < n
    phys = tl.load(tab_ptr + row * tab_stride + c, mask=ok & inside, other=-1).to(tl.int32)
    at = b.to(tl.int64) * M + c
    tl.store(out_ptr + at, tl.where(ok, c, -1), mask=inside)
    tl.store(out_ptr + PLANE + at, tl.where(ok, phys, -1), mask=inside)
    if WITH_TABLE:
        tl.store(out_ptr + 2 * PLANE + at, tl.where(ok, phys, 0), mask=inside)
        if tl.program_id(1) == 0:
            nv = tl.minimum(tl.maximum(n, 0), M).to(tl.int64)
            last = tl.maximum(nv - 1, 0)
            tail = tl.minimum(tl.maximum(tl.load(seq_ptr + b).to(tl.int64) - last * PS, 0), PS)
            tl.store(att_ptr + b, tl.where(nv > 0, last * PS + tail, 0).to(tl.int32))


def dense_pages_triton(num_pages: torch.Tensor, safe_rows: torch.Tensor, table: torch.Tensor,
                       seq_lens: Optional[torch.Tensor] = None, page_size: Optional[int] = None) -> DensePages:
    """Triton launcher of ``dense_pages``: one launch, two allocations."""
    _check_dense(num_pages, safe_rows, table, seq_lens, page_size)
    B, M = num_pages.shape[0], table.shape[1]
    full = seq_lens is not None
    out = torch.empty(3 if full else 2, B, M, dtype=torch.int32, device=table.device)
    att = torch.zeros(B, dtype=torch.int32, device=table.device) if full and M == 0 else (
        torch.empty(B, dtype=torch.int32, device=table.device) if full else None)
    if B and M:
        block = min(1024, triton.next_power_of_2(M))
        _dense_pages_kernel[(B, cdiv(M, block))](
            num_pages, safe_rows, seq_lens if full else num_pages, table, table.stride(0), out, att if full else out,
            B * M, M, page_size if full else 1, WITH_TABLE=full, BLOCK_M=block, num_warps=4)
    return DensePages(out[0], out[1], out[2] if full else None, att)


def dense_pages(num_pages: torch.Tensor, safe_rows: torch.Tensor, table: torch.Tensor,
                seq_lens: Optional[torch.Tensor] = None, page_size: Optional[int] = None) -> DensePages:
    """Every page of every row: ``logical [B, M] int32`` (``c`` for ``c < num_pages[b]``,
    else -1) and ``physical [B, M] int32`` (``table[safe_rows[b], c]``, -1 where logical is);
    with ``seq_lens`` (and ``page_size``) also the attention backend's ``page_table`` (0
    padded) and ``attended`` tokens, in the same launch.

    num_pages ``[B] int32``; safe_rows ``[B] int64`` (no -1: padding rows have
    ``num_pages == 0``); table ``[*, M] int32/int64`` (``M`` columns: the static page bound);
    seq_lens ``[B] int32`` or None.
    """
    impl = dispatch("dense_pages", num_pages, dense_pages_triton, dense_pages_reference)
    return impl(num_pages, safe_rows, table, seq_lens, page_size)
