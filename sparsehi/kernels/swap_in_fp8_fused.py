"""One launch after the LRU diff with FP8 host KV: the dequantising copy of the misses and the
selection table together (the FP8 form of ``swap_in_fused``).

With FP8 host pages a hierarchical sparse layer's swap-in is the LRU diff (``lru_diff``),
the copy of its misses out of the FP8 host pool into the GPU buffer, dequantised
(``swap_in_fp8_copy``: values ``[pages, layers, buffers, page_size, heads, dim]`` uint8 times
one float32 scale per page, layer, buffer and head), and the page table attention reads
(``selection_table`` over the buffer slots the diff returned). The copy and the table both
read only the diff's outputs, so one grid holds both: its last ``z`` slice builds the table
(one program per column block of a row), the others copy. A copy program moves ``BT`` tokens
of one page, one buffer and one head (about ``block_bytes`` of output, 4 KiB by default, as
the bf16 copy's runs): grid ``(max(K_load * parts, column blocks), B, buffers * heads + 1)``
with ``parts = ceil(page_size / BT)``, so a single request's few misses still spread over
many SMs and a large batch's hundreds over thousands of programs. Every value is written as
``swap_in_fp8_copy`` writes it (the same device block, bit for bit).

Arguments: those of ``swap_in_fp8_copy`` (``values`` / ``scales`` the FP8 host pool's
``fp8_values`` / ``fp8_scales``, ``dev`` the device pool's 6-D view, ``layer``, the diff's
``load_ids`` / ``load_slots [B, K_load] int32`` and ``num_loads [B] int32``, request ``rows
[B] int64`` with ``-1`` padding, ``host_pages [R, M]`` and ``slot_pages [R, S]``; the page
size is ``values.shape[3]``) and those of ``selection_table`` in hierarchical form (``topk
[B, K] int32`` ascending, ``valid [B]``, ``num_pages [B]``, ``seq_lens [B]``, ``table_rows
[B] int64`` (padding mapped to row 0), ``sink`` / ``recent`` pages, ``sink_table`` /
``ring_table [R, *] int32``, ``device_slots [B, K] int32`` from the diff; ``choice``, a
``sparsehi.row_choice.RowChoice``: rows that do not use ``topk`` / ``valid`` read its ids and
count, as the diff did). Returns the ``SelectionTable``. No host sync (CUDA-graph safe).

Entry points: ``swap_in_fp8_copy_and_table`` (dispatch), ``swap_in_fp8_copy_and_table_triton``,
``swap_in_fp8_copy_and_table_reference``.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import triton
import triton.language as tl

from hicache.triton_support import cdiv, dispatch
from sparsehi.kernels.selection_table import (SelectionTable, _check as _check_table, _selection_table_block,
                                              choice_args, selection_table_reference, table_blocks)
from sparsehi.kernels.swap_in_fp8 import (_check as _check_copy, _swap_in_fp8_block, copy_args,
                                          swap_in_fp8_copy_reference)

DEFAULT_BLOCK_BYTES = 4096
"""Output bytes per copy program (the bf16 copy's run size, ``swap_in_copy``)."""


@triton.jit
def _swap_in_fp8_and_table_kernel(
    v_ptr, s_ptr, d_ptr, ids_ptr, slots_ptr, nload_ptr, rows_ptr, hp_ptr, sp_ptr,
    n_host, n_dev, VPS, R, M, S, layer, D,
    svp, svl, svb, svt, svh, ssp, ssl, ssb, sdp, sdt, sdl, sdb, sdh, s_ids, s_slots, s_hp, s_sp,
    topk_ptr, valid_ptr, npages_ptr, seq_ptr, trows_ptr, sink_ptr, ring_ptr, tphys_ptr,
    lid_out, phys_out, pt_out, nv_out, att_out,
    stride_topk, stride_sink, stride_ring, stride_tphys, stride_out,
    use_ptr, alt_ptr, alt_valid_ptr, stride_alt,
    G,
    H: tl.constexpr, NSEGS: tl.constexpr, PS: tl.constexpr, PARTS: tl.constexpr, BT: tl.constexpr,
    BD: tl.constexpr, K: tl.constexpr, SINK: tl.constexpr, RECENT: tl.constexpr, W: tl.constexpr,
    BLOCK_W: tl.constexpr, WBLOCKS: tl.constexpr, HAS_ALT: tl.constexpr,
):
    # grid (max(G, WBLOCKS), B, NSEGS + 1), x fastest: a row's copy programs of one buffer x
    # head launch together (misses in the diff's order, a page's token blocks adjacent);
    # the last z slice holds the table programs
    x = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    z = tl.program_id(2)
    if z < NSEGS:
        if x < G:
            _swap_in_fp8_block(b, x // PARTS, (z % H).to(tl.int64), z // H, (x % PARTS) * BT,
                               v_ptr, s_ptr, d_ptr, ids_ptr, slots_ptr, nload_ptr, rows_ptr, hp_ptr, sp_ptr,
                               n_host, n_dev, VPS, R, M, S, layer, D,
                               svp, svl, svb, svt, svh, ssp, ssl, ssb, sdp, sdt, sdl, sdb, sdh,
                               s_ids, s_slots, s_hp, s_sp,
                               1, PS, BT, BD)
    else:
        if x < WBLOCKS:
            _selection_table_block(b, x, topk_ptr, valid_ptr, npages_ptr, seq_ptr, trows_ptr, topk_ptr, sink_ptr,
                                   ring_ptr, tphys_ptr, sp_ptr, lid_out, phys_out, pt_out, nv_out, att_out,
                                   stride_topk, 0, stride_sink, stride_ring, stride_tphys, s_sp, stride_out,
                                   1, S, use_ptr, alt_ptr, alt_valid_ptr, stride_alt,
                                   K, SINK, RECENT, PS, W, BLOCK_W, True, True, True, HAS_ALT)


def tokens_per_program(page_size: int, dim: int, out_bytes: int, block_bytes: int) -> int:
    """Tokens one copy program moves (a power of two, ``tl.arange``'s extent): the most whose
    ``dim`` outputs of ``out_bytes`` each fit ``block_bytes``, at least 1, at most the page."""
    fit = max(1, block_bytes // (dim * out_bytes))
    return min(1 << (fit.bit_length() - 1), triton.next_power_of_2(page_size))


def _check(values, scales, dev, layer, load_ids, load_slots, num_loads, rows, host_pages, slot_pages, topk, valid,
           num_pages, seq_lens, table_rows, sink, recent, sink_table, ring_table, device_slots, block_bytes,
           choice) -> None:
    _check_copy(values, scales, dev, layer, load_ids, load_slots, num_loads, rows, host_pages, slot_pages)
    b = topk.shape[0] if isinstance(topk, torch.Tensor) and topk.dim() == 2 else None
    if b is None or topk.dtype != torch.int32:
        raise ValueError("topk must be [B, K] int32 (ascending ids, -1 padded)")
    if not isinstance(device_slots, torch.Tensor) or device_slots.shape != topk.shape \
            or device_slots.dtype != torch.int32:
        raise ValueError(f"device_slots must be [B, K]={tuple(topk.shape)} int32 (the LRU diff's buffer slots)")
    if not isinstance(table_rows, torch.Tensor) or table_rows.shape != (b,):
        raise ValueError(f"table_rows must be [B={b}] (request rows, padding mapped to row 0)")
    if load_ids.shape[0] != b:
        raise ValueError(f"load_ids has {load_ids.shape[0]} rows, topk {b}: one batch")
    _check_table(topk, valid, num_pages, seq_lens, table_rows, None, sink_table, ring_table, device_slots, sink,
                 recent, slot_pages)
    if choice is not None:
        choice.check(topk, valid)
    if not isinstance(block_bytes, int) or isinstance(block_bytes, bool) or block_bytes < 1:
        raise ValueError(f"block_bytes={block_bytes!r} is invalid: an int >= 1")


def swap_in_fp8_copy_and_table_reference(values, scales, dev, layer: int, load_ids, load_slots, num_loads, rows,
                                         host_pages, slot_pages, topk, valid, num_pages, seq_lens, table_rows, *,
                                         sink: int, recent: int, sink_table, ring_table, device_slots,
                                         block_bytes: int = DEFAULT_BLOCK_BYTES, out: Optional[SelectionTable] = None,
                                         choice: Any = None) -> SelectionTable:
    """Torch reference: ``swap_in_fp8_copy_reference`` then ``selection_table_reference``
    (``block_bytes`` shapes the Triton launch only; ``out`` is filled and returned)."""
    _check(values, scales, dev, layer, load_ids, load_slots, num_loads, rows, host_pages, slot_pages, topk, valid,
           num_pages, seq_lens, table_rows, sink, recent, sink_table, ring_table, device_slots, block_bytes, choice)
    swap_in_fp8_copy_reference(values, scales, dev, layer, load_ids, load_slots, num_loads, rows, host_pages,
                               slot_pages)
    table = selection_table_reference(topk, valid, num_pages, seq_lens, table_rows, sink=sink, recent=recent,
                                      page_size=values.shape[3], sink_table=sink_table, ring_table=ring_table,
                                      topk_phys=device_slots, slot_table=slot_pages, choice=choice)
    return table.fill(out)


def swap_in_fp8_copy_and_table_triton(values, scales, dev, layer: int, load_ids, load_slots, num_loads, rows,
                                      host_pages, slot_pages, topk, valid, num_pages, seq_lens, table_rows, *,
                                      sink: int, recent: int, sink_table, ring_table, device_slots,
                                      block_bytes: int = DEFAULT_BLOCK_BYTES, out: Optional[SelectionTable] = None,
                                      choice: Any = None) -> SelectionTable:
    """One launch (see the module docstring); ``out`` reuses table buffers. No host syncs."""
    _check(values, scales, dev, layer, load_ids, load_slots, num_loads, rows, host_pages, slot_pages, topk, valid,
           num_pages, seq_lens, table_rows, sink, recent, sink_table, ring_table, device_slots, block_bytes, choice)
    b, k = topk.shape
    w = sink + k + recent
    if out is None:
        out = SelectionTable.empty(b, w, topk.device)
    if b == 0:
        return out
    _, _, nb, ps, h, d = values.shape
    bt = tokens_per_program(ps, d, dev.element_size(), block_bytes)
    parts = cdiv(ps, bt)
    g = load_ids.shape[1] * parts
    block_w, wblocks = table_blocks(w)
    _swap_in_fp8_and_table_kernel[(max(g, wblocks), b, nb * h + 1)](
        values, scales, dev, load_ids, load_slots, num_loads, rows, host_pages, slot_pages,
        *copy_args(values, scales, dev, layer, load_ids, load_slots, host_pages, slot_pages),
        topk, valid, num_pages, seq_lens, table_rows, sink_table, ring_table, device_slots,
        out.logical, out.physical, out.page_table, out.num_valid, out.attended,
        topk.stride(0), sink_table.stride(0), ring_table.stride(0), device_slots.stride(0), out.logical.stride(0),
        *choice_args(choice, topk, valid),
        g,
        H=h, NSEGS=nb * h, PS=ps, PARTS=parts, BT=bt, BD=triton.next_power_of_2(d), K=k, SINK=sink, RECENT=recent,
        W=w, BLOCK_W=block_w, WBLOCKS=wblocks, HAS_ALT=choice is not None, num_warps=4,
    )
    return out


def swap_in_fp8_copy_and_table(values, scales, dev, layer: int, load_ids, load_slots, num_loads, rows, host_pages,
                               slot_pages, topk, valid, num_pages, seq_lens, table_rows, *, sink: int, recent: int,
                               sink_table, ring_table, device_slots, out: Optional[SelectionTable] = None,
                               choice: Any = None) -> SelectionTable:
    """The dequantising copy of the misses and the selection table (see the module
    docstring): Triton when ``dev`` is on CUDA, the torch references elsewhere."""
    impl = dispatch("swap_in_fp8_copy_and_table", dev, swap_in_fp8_copy_and_table_triton,
                    swap_in_fp8_copy_and_table_reference)
    return impl(values, scales, dev, layer, load_ids, load_slots, num_loads, rows, host_pages, slot_pages, topk, valid,
                num_pages, seq_lens, table_rows, sink=sink, recent=recent, sink_table=sink_table,
                ring_table=ring_table, device_slots=device_slots, out=out, choice=choice)
