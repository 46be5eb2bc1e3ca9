"""One launch after the LRU diff: the copy of the misses and the selection table together.

In hierarchical mode a sparse layer's swap-in is the LRU diff (``lru_diff``), the copy of its
misses host -> device (``swap_in_copy``) and the page table attention reads
(``selection_table`` over the buffer slots the diff returned). The copy and the table both
read only the diff's outputs, so one grid holds both: its last ``z`` slice builds the table
(one program per column block of a row), the others copy (as ``swap_in_copy``). That is one
launch fewer per sparse layer; at small batches, where each launch's latency is most of a
layer's swap-in, that is what it saves.

Arguments: those of ``swap_in_copy`` (host / device 6-D pool views, the diff's load lists,
request rows ``[B] int64`` with ``-1`` padding, the host-page and slot-page tables, page size;
keywords ``host_tokens`` (``[R, T]``, the host slot of each token, read instead of
``host_pages``, which may then be None) and ``resident`` (``(v2p [N], v2p_page_size)``: tokens
whose host page is still in GPU memory are read from the device view), see swap_in_copy.py)
and those of ``selection_table`` in hierarchical form (``topk [B, K] int32`` ascending,
``valid [B]``, ``num_pages [B]``, ``seq_lens [B]``, ``table_rows [B] int64`` (padding mapped to
row 0), ``sink`` / ``recent`` pages, ``sink_table`` / ``ring_table`` ``[R, *] int32``,
``device_slots [B, K] int32`` from the diff, ``slot_table [R, S] int32``; ``choice``, a
``sparsehi.row_choice.RowChoice``: rows that do not use ``topk`` / ``valid`` read its ids and count, as the diff
did). Returns the ``SelectionTable``.

Entry points: ``swap_in_copy_and_table`` (dispatch), ``swap_in_copy_and_table_triton``,
``swap_in_copy_and_table_reference``.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import triton
import triton.language as tl

from hicache.triton_support import cdiv, dispatch
from sparsehi.kernels.selection_table import (SelectionTable, _check as _check_table, _selection_table_block,
                                              choice_args, selection_table_reference, table_blocks)
from sparsehi.kernels.swap_in_copy import (DEFAULT_BLOCK_BYTES, _check as _check_copy, _swap_in_copy_block,
                                           copy_geometry, source_args, swap_in_copy_reference)


@triton.jit
def _swap_in_and_table_kernel(
    src_ptr, dst_ptr, ids_ptr, slots_ptr, nload_ptr, rows_ptr, hp_ptr, sp_ptr,
    layer, K_LOAD, src_slots, dst_slots, hp_cols, sp_cols,
    stride_ids, stride_hp, stride_sp,
    s_sp, s_st, s_sl, s_sb, s_sh, d_sp, d_st, d_sl, d_sb, d_sh,
    ht_ptr, v2p_ptr, ht_cols, v2p_n, stride_ht, stride_htc, stride_v2p,
    topk_ptr, valid_ptr, npages_ptr, seq_ptr, trows_ptr, sink_ptr, ring_ptr, tphys_ptr, slot_ptr,
    lid_out, phys_out, pt_out, nv_out, att_out,
    stride_topk, stride_sink, stride_ring, stride_tphys, stride_slot, stride_out, slot_cols,
    use_ptr, alt_ptr, alt_valid_ptr, stride_alt,
    G,
    PS: tl.constexpr, SRC_PS: tl.constexpr, DST_PS: tl.constexpr, NUM_SEG: tl.constexpr, NSEGS: tl.constexpr,
    PARTS: tl.constexpr, SEG: tl.constexpr, TOKS: tl.constexpr, TILE: tl.constexpr,
    K: tl.constexpr, SINK: tl.constexpr, RECENT: tl.constexpr, PAGE: tl.constexpr, W: tl.constexpr,
    BLOCK_W: tl.constexpr, WBLOCKS: tl.constexpr, HAS_ALT: tl.constexpr,
    HAS_TOKENS: tl.constexpr, RESIDENT: tl.constexpr, VPS: tl.constexpr,
):
    # grid (max(G, WBLOCKS), B, NSEGS + 1), x fastest: a row's copy programs launch together
    # (as swap_in_copy's row-major order); the last z slice holds the table programs
    x = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    z = tl.program_id(2)
    if z < NSEGS:
        if x < G:
            _swap_in_copy_block(b, x, G, z, src_ptr, dst_ptr, ids_ptr, slots_ptr, nload_ptr, rows_ptr, hp_ptr, sp_ptr,
                                layer, K_LOAD, src_slots, dst_slots, hp_cols, sp_cols, stride_ids, stride_hp,
                                stride_sp, s_sp, s_st, s_sl, s_sb, s_sh, d_sp, d_st, d_sl, d_sb, d_sh,
                                ht_ptr, v2p_ptr, ht_cols, v2p_n, stride_ht, stride_htc, stride_v2p,
                                PS, SRC_PS, DST_PS, NUM_SEG, PARTS, SEG, TOKS, TILE, HAS_TOKENS, RESIDENT, VPS)
    else:
        if x < WBLOCKS:
            _selection_table_block(b, x, topk_ptr, valid_ptr, npages_ptr, seq_ptr, trows_ptr, topk_ptr, sink_ptr,
                                   ring_ptr, tphys_ptr, slot_ptr, lid_out, phys_out, pt_out, nv_out, att_out,
                                   stride_topk, 0, stride_sink, stride_ring, stride_tphys, stride_slot, stride_out,
                                   1, slot_cols, use_ptr, alt_ptr, alt_valid_ptr, stride_alt,
                                   K, SINK, RECENT, PAGE, W, BLOCK_W, True, True, True, HAS_ALT)


def swap_in_copy_and_table_reference(src, dst, layer, load_ids, load_slots, num_loads, rows, host_pages, slot_pages,
                                     page_size, topk, valid, num_pages, seq_lens, table_rows, *, sink, recent,
                                     sink_table, ring_table, device_slots,
                                     block_bytes: int = DEFAULT_BLOCK_BYTES, out: Optional[SelectionTable] = None,
                                     choice: Any = None,
                                     host_tokens: Optional[torch.Tensor] = None,
                                     resident: Optional[tuple[torch.Tensor, int]] = None) -> SelectionTable:
    """Torch reference: ``swap_in_copy_reference`` then ``selection_table_reference``
    (``block_bytes`` shapes the Triton launch only; ``out`` is filled and returned)."""
    swap_in_copy_reference(src, dst, layer, load_ids, load_slots, num_loads, rows, host_pages, slot_pages, page_size,
                           host_tokens=host_tokens, resident=resident)
    table = selection_table_reference(topk, valid, num_pages, seq_lens, table_rows, sink=sink, recent=recent,
                                      page_size=page_size, sink_table=sink_table, ring_table=ring_table,
                                      topk_phys=device_slots, slot_table=slot_pages, choice=choice)
    return table.fill(out)


def swap_in_copy_and_table_triton(src, dst, layer, load_ids, load_slots, num_loads, rows, host_pages, slot_pages,
                                  page_size, topk, valid, num_pages, seq_lens, table_rows, *, sink, recent,
                                  sink_table, ring_table, device_slots, block_bytes: int = DEFAULT_BLOCK_BYTES,
                                  out: Optional[SelectionTable] = None,
                                  choice: Any = None,
                                  host_tokens: Optional[torch.Tensor] = None,
                                  resident: Optional[tuple[torch.Tensor, int]] = None) -> SelectionTable:
    """One launch (see the module docstring); ``out`` reuses table buffers. No host syncs."""
    _check_copy(src, dst, layer, load_ids, load_slots, num_loads, rows, host_pages, slot_pages, page_size,
                host_tokens, resident)
    _check_table(topk, valid, num_pages, seq_lens, table_rows, None, sink_table, ring_table, device_slots, sink,
                 recent, slot_pages)
    if choice is not None:
        choice.check(topk, valid)
    if not isinstance(block_bytes, int) or block_bytes < 1:
        raise ValueError(f"block_bytes={block_bytes!r} is invalid: an int >= 1")
    b, k = topk.shape
    if load_ids.shape[0] != b:
        raise ValueError(f"load lists have {load_ids.shape[0]} rows, topk {b}: one batch")
    w = sink + k + recent
    out = out if out is not None else SelectionTable.empty(b, w, topk.device)
    if b == 0:
        return out
    kl = load_ids.shape[1]
    g = copy_geometry(src, dst, load_ids, load_slots, block_bytes)
    ws, wd, nseg, li, ls = g.src, g.dst, g.nseg, g.load_ids, g.load_slots
    seg, parts, toks, tile = g.seg, g.parts, g.toks, g.tile
    runs = max(1, cdiv(kl * page_size, toks))
    block_w, wblocks = table_blocks(w)
    nsegs = src.shape[3] * nseg
    (hp, hp_cols, stride_hp), extra, flags = source_args(host_pages, slot_pages, host_tokens, resident)
    _swap_in_and_table_kernel[(max(runs, wblocks), b, nsegs + 1)](
        ws, wd, li, ls, num_loads, rows, hp, slot_pages,
        layer, kl, src.shape[0] * src.shape[1], dst.shape[0] * dst.shape[1], hp_cols, slot_pages.shape[1],
        li.stride(0), stride_hp, slot_pages.stride(0),
        ws.stride(0), ws.stride(1), ws.stride(2), ws.stride(3), ws.stride(4),
        wd.stride(0), wd.stride(1), wd.stride(2), wd.stride(3), wd.stride(4),
        *extra,
        topk, valid, num_pages, seq_lens, table_rows, sink_table, ring_table, device_slots, slot_pages,
        out.logical, out.physical, out.page_table, out.num_valid, out.attended,
        topk.stride(0), sink_table.stride(0), ring_table.stride(0), device_slots.stride(0), slot_pages.stride(0),
        out.logical.stride(0), slot_pages.shape[1],
        *choice_args(choice, topk, valid),
        runs,
        PS=page_size, SRC_PS=src.shape[1], DST_PS=dst.shape[1], NUM_SEG=nseg, NSEGS=nsegs, PARTS=parts, SEG=seg,
        TOKS=toks, TILE=tile, K=k, SINK=sink, RECENT=recent, PAGE=page_size, W=w, BLOCK_W=block_w, WBLOCKS=wblocks,
        HAS_ALT=choice is not None, **flags, num_warps=4,
    )
    return out


def swap_in_copy_and_table(src, dst, layer, load_ids, load_slots, num_loads, rows, host_pages, slot_pages, page_size,
                           topk, valid, num_pages, seq_lens, table_rows, *, sink, recent, sink_table, ring_table,
                           device_slots, out: Optional[SelectionTable] = None,
                           choice: Any = None, host_tokens: Optional[torch.Tensor] = None,
                           resident: Optional[tuple[torch.Tensor, int]] = None) -> SelectionTable:
    """The copy of the misses and the selection table (see the module docstring): Triton
    when the device side is CUDA, the torch references elsewhere."""
    impl = dispatch("swap_in_copy_and_table", dst if dst.is_cuda else src, swap_in_copy_and_table_triton,
                    swap_in_copy_and_table_reference)
    return impl(src, dst, layer, load_ids, load_slots, num_loads, rows, host_pages, slot_pages, page_size, topk, valid,
                num_pages, seq_lens, table_rows, sink=sink, recent=recent, sink_table=sink_table,
                ring_table=ring_table, device_slots=device_slots, out=out, choice=choice, host_tokens=host_tokens,
                resident=resident)
