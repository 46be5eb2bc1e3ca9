"""One sparse layer's selection table in one launch: sink pages, the selected ids, recent
pages, in ascending order, with their physical pages and what attention reads.

Per row (page or token units; ``P`` pages in context, ``sink`` / ``R`` the always-attended
first / last pages, selected ids ascending in ``[n_sink, recent_start)``):

    logical  = [0 .. n_sink) ++ topk[:valid] ++ [recent_start .. P) ++ -1 padding
    physical = the page holding each id: ``fixed`` table for sink and recent ids (sink
               table + recent ring of the hierarchical buffer, or the request's own page
               table), ``topk_phys`` for the selected ids (the swap-in's slots), or the
               own page table when ``topk_phys`` is None
    page_table   = physical with 0 padding (the attention backend's page table)
    attended     = tokens attended: ``(num_valid - 1) * page_size`` + the tokens of the
               last (partial) page, 0 for empty rows

This replaces a concatenation, a sort by id, two gathers and the adapter's page-table
build (a dozen small launches per layer) when the selected ids already come ascending.

``choice`` (a ``sparsehi.row_choice.RowChoice``): rows that do not use
``topk`` / ``valid`` read ``choice.ids`` / ``choice.count`` instead (the plain candidate
list of rows that are not sparse), so the caller need not materialise the substitution.

Entry points: ``selection_table`` (dispatch), ``selection_table_triton``,
``selection_table_reference``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import triton
import triton.language as tl

from hicache.triton_support import cdiv, dispatch


@dataclass
class SelectionTable:
    """logical / physical ``[B, W] int32`` (-1 padded), page_table ``[B, W] int32`` (0
    padded), num_valid ``[B] int32``, attended ``[B] int32`` tokens."""

    logical: torch.Tensor
    physical: torch.Tensor
    page_table: torch.Tensor
    num_valid: torch.Tensor
    attended: torch.Tensor

    @classmethod
    def empty(cls, b: int, w: int, device: torch.device) -> "SelectionTable":
        """Uninitialised buffers for ``b`` rows of ``w`` entries."""
        return cls(*(torch.empty(b, w, dtype=torch.int32, device=device) for _ in range(3)),
                   *(torch.empty(b, dtype=torch.int32, device=device) for _ in range(2)))

    def fill(self, out: Optional["SelectionTable"]) -> "SelectionTable":
        """``out`` with this table's values copied in, or this table when ``out`` is None."""
        if out is None:
            return self
        for name in ("logical", "physical", "page_table", "num_valid", "attended"):
            getattr(out, name).copy_(getattr(self, name))
        return out


def table_blocks(width: int) -> tuple[int, int]:
    """``(BLOCK_W, blocks)``: the entries one table program writes, and the programs a row
    of ``width`` entries takes."""
    block_w = min(512, triton.next_power_of_2(width))
    return block_w, cdiv(width, block_w)


def _check(topk, valid, num_pages, seq_lens, rows, own_table, sink_table, ring_table, topk_phys, sink, recent,
           slot_table=None):
    b, k = topk.shape
    for name, t in (("valid", valid), ("num_pages", num_pages), ("seq_lens", seq_lens), ("rows", rows)):
        if t.shape != (b,):
            raise ValueError(f"{name} must be [B={b}], got {tuple(t.shape)}")
    if topk.dtype != torch.int32 or valid.dtype != torch.int32:
        raise ValueError(f"topk and valid must be int32, got {topk.dtype}, {valid.dtype}")
    if topk_phys is not None and (topk_phys.shape != topk.shape or topk_phys.dtype != torch.int32):
        raise ValueError(f"topk_phys must be [B, K]={tuple(topk.shape)} int32, got {tuple(topk_phys.shape)} {topk_phys.dtype}")
    if slot_table is not None and topk_phys is None:
        raise ValueError("slot_table needs topk_phys (the buffer slot of each selected id)")
    if (sink_table is None) != (ring_table is None):
        raise ValueError("sink_table and ring_table go together (hierarchical buffers) or are both None")
    if sink_table is None and own_table is None:
        raise ValueError("need own_table (the request's pages) or sink_table + ring_table")
    if ring_table is not None and ring_table.shape[1] != recent:
        raise ValueError(f"ring_table must have recent={recent} columns, got {ring_table.shape[1]}")
    if sink < 0 or recent < 1:
        raise ValueError(f"sink must be >= 0 and recent >= 1, got {sink}, {recent}")


def selection_table_reference(topk: torch.Tensor, valid: torch.Tensor, num_pages: torch.Tensor,
                              seq_lens: torch.Tensor, rows: torch.Tensor, *, sink: int, recent: int,
                              page_size: int, own_table: Optional[torch.Tensor] = None,
                              sink_table: Optional[torch.Tensor] = None, ring_table: Optional[torch.Tensor] = None,
                              topk_phys: Optional[torch.Tensor] = None,
                              slot_table: Optional[torch.Tensor] = None,
                              choice: Any = None) -> SelectionTable:
    """Torch reference (see the module docstring). ``topk [B, K] int32`` ascending valid
    ids then -1; ``rows [B] int64`` table rows (>= 0; padding rows have num_pages 0);
    tables ``[R, *] int32``; with ``slot_table [R, S]`` the entries of ``topk_phys`` are
    buffer slots and their pages are ``slot_table[row, slot]``."""
    _check(topk, valid, num_pages, seq_lens, rows, own_table, sink_table, ring_table, topk_phys, sink, recent,
           slot_table)
    if choice is not None:
        topk, valid = choice.apply(topk, valid)
    dev = topk.device
    b, k = topk.shape
    w = sink + k + recent
    P = num_pages.long()
    n_sink = P.clamp(max=sink)
    rs = torch.maximum(n_sink, P - recent)
    n_rec = P - rs
    v = valid.long().clamp(0, k)
    j = torch.arange(w, device=dev)[None, :]
    in_sink = j < n_sink[:, None]
    in_top = (j >= n_sink[:, None]) & (j < (n_sink + v)[:, None])
    rec_j = j - (n_sink + v)[:, None]
    in_rec = (rec_j >= 0) & (rec_j < n_rec[:, None])
    tcol = (j - n_sink[:, None]).clamp(0, max(k - 1, 0))
    top_ids = topk.long().gather(1, tcol) if k else torch.zeros(b, w, dtype=torch.long, device=dev)
    lid = torch.where(in_sink, j, torch.where(in_top, top_ids, torch.where(in_rec, rs[:, None] + rec_j, -1)))
    ok = lid >= 0
    safe = lid.clamp(min=0)
    r = rows.long()[:, None]
    if sink_table is not None:
        fixed = torch.where(safe < sink, sink_table.long()[r, safe.clamp(max=max(sink, 1) - 1)],
                            ring_table.long()[r, safe % recent])
    else:
        fixed = own_table.long()[r, safe.clamp(max=own_table.shape[1] - 1)]
    if topk_phys is not None:
        tphys = topk_phys.long().gather(1, tcol) if k else fixed
        if slot_table is not None:
            tphys = slot_table.long()[r, tphys.clamp(0, slot_table.shape[1] - 1)]
    else:
        tphys = own_table.long()[r, safe.clamp(max=own_table.shape[1] - 1)]
    phys = torch.where(ok, torch.where(in_top, tphys, fixed), -1)
    nv = n_sink + v + n_rec
    last = (nv - 1).clamp(min=0)
    last_lid = lid.gather(1, last[:, None])[:, 0]
    tail = (seq_lens.long() - last_lid * page_size).clamp(0, page_size)
    attended = torch.where(nv > 0, last * page_size + tail, 0)
    return SelectionTable(lid.to(torch.int32), phys.to(torch.int32), torch.where(ok, phys, 0).to(torch.int32),
                          nv.to(torch.int32), attended.to(torch.int32))


@triton.jit
def _selection_table_block(
    b, cb,
    topk_ptr, valid_ptr, npages_ptr, seq_ptr, rows_ptr,
    own_ptr, sink_ptr, ring_ptr, tphys_ptr, slot_ptr,
    lid_out, phys_out, pt_out, nv_out, att_out,
    stride_topk, stride_own, stride_sink, stride_ring, stride_tphys, stride_slot, stride_out, own_cols, slot_cols,
    use_ptr, alt_ptr, alt_valid_ptr, stride_alt,
    K: tl.constexpr, SINK: tl.constexpr, RECENT: tl.constexpr, PAGE: tl.constexpr, W: tl.constexpr,
    BLOCK_W: tl.constexpr, HIER: tl.constexpr, HAS_TPHYS: tl.constexpr, HAS_SLOTS: tl.constexpr,
    HAS_ALT: tl.constexpr,
):
    """Column block ``cb`` of batch row ``b`` (int64); the row's scalars are recomputed by
    each block. ``HAS_ALT``: the row reads ``alt`` / ``alt_valid`` where ``use`` is False
    (a ``sparsehi.row_choice.RowChoice``)."""
    P = tl.load(npages_ptr + b).to(tl.int32)
    n_sink = tl.minimum(P, SINK)
    rs = tl.maximum(n_sink, P - RECENT)
    n_rec = P - rs
    if HAS_ALT:
        u = tl.load(use_ptr + b) != 0
        vin = tl.where(u, tl.load(valid_ptr + b), tl.load(alt_valid_ptr + b))
    else:
        u = b >= 0
        vin = tl.load(valid_ptr + b)
    v = tl.minimum(tl.maximum(vin, 0), K)
    row = tl.load(rows_ptr + b).to(tl.int64)
    nv = n_sink + v + n_rec
    j = cb * BLOCK_W + tl.arange(0, BLOCK_W)
    jm = j < W
    in_sink = j < n_sink
    in_top = (j >= n_sink) & (j < n_sink + v)
    rec_j = j - (n_sink + v)
    in_rec = (rec_j >= 0) & (rec_j < n_rec)
    tcol = tl.minimum(tl.maximum(j - n_sink, 0), K - 1)
    if HAS_ALT:
        ut = (tl.zeros_like(j) + u.to(tl.int32)) != 0  # the scalar as a tile (masks must be tiles)
        top_ids = tl.where(ut, tl.load(topk_ptr + b * stride_topk + tcol, mask=in_top & jm & ut, other=0),
                           tl.load(alt_ptr + b * stride_alt + tcol, mask=in_top & jm & ~ut, other=0))
    else:
        top_ids = tl.load(topk_ptr + b * stride_topk + tcol, mask=in_top & jm, other=0)
    lid = tl.where(in_sink, j, tl.where(in_top, top_ids, tl.where(in_rec, rs + rec_j, -1)))
    ok = (lid >= 0) & jm
    safe = tl.maximum(lid, 0).to(tl.int64)
    if HIER:
        sp = tl.load(sink_ptr + row * stride_sink + tl.minimum(safe, max(SINK, 1) - 1), mask=ok & (safe < SINK), other=0)
        rp = tl.load(ring_ptr + row * stride_ring + safe % RECENT, mask=ok & (safe >= SINK), other=0)
        fixed = tl.where(safe < SINK, sp, rp)
    else:
        fixed = tl.load(own_ptr + row * stride_own + tl.minimum(safe, own_cols - 1), mask=ok & ~in_top, other=0)
    if HAS_TPHYS:
        tp = tl.load(tphys_ptr + b * stride_tphys + tcol, mask=in_top & jm, other=0)
        if HAS_SLOTS:
            tsl = tl.minimum(tl.maximum(tp, 0), slot_cols - 1).to(tl.int64)
            tp = tl.load(slot_ptr + row * stride_slot + tsl, mask=in_top & jm, other=0)
    else:
        tp = tl.load(own_ptr + row * stride_own + tl.minimum(safe, own_cols - 1), mask=in_top & jm, other=0)
    phys = tl.where(ok, tl.where(in_top, tp, fixed), -1)
    tl.store(lid_out + b * stride_out + j, lid, mask=jm)
    tl.store(phys_out + b * stride_out + j, phys, mask=jm)
    tl.store(pt_out + b * stride_out + j, tl.where(ok, phys, 0), mask=jm)
    if cb == 0:
        # the last attended id: the recent window's last page, else the last selected id,
        # else the last sink page
        last = tl.maximum(nv - 1, 0)
        last_top = tl.load(topk_ptr + b * stride_topk + tl.maximum(v - 1, 0))
        if HAS_ALT:
            last_top = tl.where(u, last_top, tl.load(alt_ptr + b * stride_alt + tl.maximum(v - 1, 0)))
        last_lid = tl.where(n_rec > 0, P - 1, tl.where(v > 0, last_top, n_sink - 1))
        tail = tl.minimum(tl.maximum(tl.load(seq_ptr + b) - last_lid * PAGE, 0), PAGE)
        tl.store(nv_out + b, nv)
        tl.store(att_out + b, tl.where(nv > 0, last * PAGE + tail, 0))


def choice_args(choice: Any, topk: torch.Tensor, valid: torch.Tensor) -> tuple:
    """``(use, alt, alt_valid, stride_alt)`` kernel arguments of a row choice (placeholders,
    never read, without one)."""
    if choice is None:
        return valid, topk, valid, 0
    return choice.use, choice.ids, choice.count, choice.ids.stride(0)


@triton.jit
def _selection_table_kernel(
    topk_ptr, valid_ptr, npages_ptr, seq_ptr, rows_ptr,
    own_ptr, sink_ptr, ring_ptr, tphys_ptr, slot_ptr,
    lid_out, phys_out, pt_out, nv_out, att_out,
    stride_topk, stride_own, stride_sink, stride_ring, stride_tphys, stride_slot, stride_out, own_cols, slot_cols,
    use_ptr, alt_ptr, alt_valid_ptr, stride_alt,
    K: tl.constexpr, SINK: tl.constexpr, RECENT: tl.constexpr, PAGE: tl.constexpr, W: tl.constexpr,
    BLOCK_W: tl.constexpr, HIER: tl.constexpr, HAS_TPHYS: tl.constexpr, HAS_SLOTS: tl.constexpr,
    HAS_ALT: tl.constexpr,
):
    # grid (row, column block)
    _selection_table_block(tl.program_id(0).to(tl.int64), tl.program_id(1), topk_ptr, valid_ptr, npages_ptr, seq_ptr, rows_ptr, own_ptr, sink_ptr, ring_ptr, tphys_ptr,
                           slot_ptr, lid_out, phys_out, pt_out, nv_out, att_out, stride_topk, stride_own, stride_sink,
                           stride_ring, stride_tphys, stride_slot, stride_out, own_cols, slot_cols,
                           use_ptr, alt_ptr, alt_valid_ptr, stride_alt,
                           K, SINK, RECENT, PAGE, W, BLOCK_W, HIER, HAS_TPHYS, HAS_SLOTS, HAS_ALT)


def selection_table_triton(topk, valid, num_pages, seq_lens, rows, *, sink, recent, page_size, own_table=None,
                           sink_table=None, ring_table=None, topk_phys=None, slot_table=None,
                           out: Optional[SelectionTable] = None, choice: Any = None) -> SelectionTable:
    """Triton launcher; same arguments and results as the reference (``out`` reuses buffers)."""
    _check(topk, valid, num_pages, seq_lens, rows, own_table, sink_table, ring_table, topk_phys, sink, recent,
           slot_table)
    if choice is not None:
        choice.check(topk, valid)
    dev = topk.device
    b, k = topk.shape
    w = sink + k + recent
    if out is None:
        out = SelectionTable.empty(b, w, dev)
    if b == 0:
        return out
    hier = sink_table is not None
    dummy = topk
    own = own_table if own_table is not None else dummy
    block_w, wblocks = table_blocks(w)
    _selection_table_kernel[(b, wblocks)](
        topk, valid, num_pages, seq_lens, rows,
        own, sink_table if hier else dummy, ring_table if hier else dummy, topk_phys if topk_phys is not None else dummy,
        slot_table if slot_table is not None else dummy,
        out.logical, out.physical, out.page_table, out.num_valid, out.attended,
        topk.stride(0), own.stride(0), sink_table.stride(0) if hier else 0, ring_table.stride(0) if hier else 0,
        topk_phys.stride(0) if topk_phys is not None else 0, slot_table.stride(0) if slot_table is not None else 0,
        out.logical.stride(0), own.shape[1] if own_table is not None else 1,
        slot_table.shape[1] if slot_table is not None else 1,
        *choice_args(choice, topk, valid),
        K=k, SINK=sink, RECENT=recent, PAGE=page_size, W=w, BLOCK_W=block_w,
        HIER=hier, HAS_TPHYS=topk_phys is not None, HAS_SLOTS=slot_table is not None, HAS_ALT=choice is not None,
        num_warps=4,
    )
    return out


def selection_table(topk, valid, num_pages, seq_lens, rows, *, sink, recent, page_size, own_table=None,
                    sink_table=None, ring_table=None, topk_phys=None, slot_table=None,
                    choice: Any = None) -> SelectionTable:
    """The selection table (see the module docstring); Triton on CUDA, the torch reference
    elsewhere."""
    impl = dispatch("selection_table", topk, selection_table_triton, selection_table_reference)
    return impl(topk, valid, num_pages, seq_lens, rows, sink=sink, recent=recent, page_size=page_size,
                own_table=own_table, sink_table=sink_table, ring_table=ring_table, topk_phys=topk_phys,
                slot_table=slot_table, choice=choice)
