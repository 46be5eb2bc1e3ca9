"""The host->device copy of one sparse layer's misses, straight from the LRU diff's output.

The diff lists, per batch row, the missed logical ids (``load_ids``) and the buffer slots
they go to (``load_slots``), ``num_loads`` of them. This kernel looks up each miss's host
page (``host_pages[row, id]``) and device page (``slot_pages[row, slot]``) itself and
copies the page's rows of one layer (every buffer: k and v, or the MLA latent) over the
pinned host memory (zero copy), so no index list is built, expanded or sorted between the
diff and the copy. The grid spreads one row's misses over many programs: at batch 1 a
single request's copy still runs on many SMs.

Both sides are the 6-D pool views ``[pages, page_size, layers, buffers, heads, dim]``
(``HostKVPool.paged_view`` / ``DeviceKVPool.paged_view``, every host layout). Entries that
are ``-1`` (no load, padding) or out of range are skipped.

Entry points: ``swap_in_copy`` (dispatch), ``swap_in_copy_triton``, ``swap_in_copy_reference``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from hicache.kernels.kv_copy import kv_copy_reference, word_rows
from hicache.triton_support import announce_path, use_triton


def _check(src, dst, layer, load_ids, load_slots, num_loads, rows, host_pages, slot_pages, page_size) -> None:
    if not isinstance(page_size, int) or page_size < 1:
        raise ValueError(f"page_size={page_size!r} is invalid: an int >= 1")
    for name, t in (("src", src), ("dst", dst)):
        if not isinstance(t, torch.Tensor) or t.dim() != 6 or t.stride(-1) != 1:
            raise ValueError(f"{name} must be a 6-D pool view [pages, page_size, layers, buffers, heads, dim]")
    if src.shape[2:] != dst.shape[2:] or src.dtype != dst.dtype:
        raise ValueError(f"src and dst must agree on [layers, buffers, heads, dim] and dtype, got "
                         f"{tuple(src.shape)} {src.dtype} and {tuple(dst.shape)} {dst.dtype}")
    if not 0 <= layer < src.shape[2]:
        raise ValueError(f"layer={layer} is invalid: in [0, {src.shape[2]})")
    b, k = load_ids.shape
    if load_slots.shape != (b, k) or num_loads.shape != (b,) or rows.shape != (b,):
        raise ValueError(f"load_slots [B, K], num_loads [B] and rows [B] must match load_ids {tuple(load_ids.shape)}")
    if host_pages.dim() != 2 or slot_pages.dim() != 2 or host_pages.shape[0] != slot_pages.shape[0]:
        raise ValueError("host_pages [R, M] and slot_pages [R, S] must be 2-D tables over the same request rows")


def swap_in_copy_reference(src, dst, layer, load_ids, load_slots, num_loads, rows, host_pages, slot_pages,
                           page_size) -> None:
    """Torch reference: the same copy through per-token slot lists and ``kv_copy_reference``."""
    _check(src, dst, layer, load_ids, load_slots, num_loads, rows, host_pages, slot_pages, page_size)
    ps = page_size
    b, k = load_ids.shape
    dev = load_ids.device
    cols = torch.arange(k, device=dev)[None, :]
    r = rows.long().clamp(min=0)[:, None]
    # ids and slots past their tables are skipped, as the kernel does (not clamped)
    ok = ((cols < num_loads.long()[:, None]) & (load_ids >= 0) & (load_ids < host_pages.shape[1])
          & (load_slots >= 0) & (load_slots < slot_pages.shape[1]) & (rows[:, None] >= 0))
    ids = load_ids.long().clamp(0, host_pages.shape[1] - 1)
    slots = load_slots.long().clamp(0, slot_pages.shape[1] - 1)
    hp = torch.where(ok, host_pages.long()[r, ids], -1)
    dp = torch.where(ok, slot_pages.long()[r, slots], -1)
    off = torch.arange(ps, device=dev)
    s = torch.where(hp[..., None] >= 0, hp[..., None] * ps + off, -1).reshape(-1)
    d = torch.where(dp[..., None] >= 0, dp[..., None] * ps + off, -1).reshape(-1)
    kv_copy_reference(src, dst, s, d, layer, 1)


@triton.jit
def _swap_in_copy_block(
    b, g, G, seg,
    src_ptr, dst_ptr, ids_ptr, slots_ptr, nload_ptr, rows_ptr, hp_ptr, sp_ptr,
    layer, K, src_slots, dst_slots, hp_cols, sp_cols,
    stride_ids, stride_hp, stride_sp,
    s_sp, s_st, s_sl, s_sb, s_sh, d_sp, d_st, d_sl, d_sb, d_sh,
    PS: tl.constexpr, SRC_PS: tl.constexpr, DST_PS: tl.constexpr, NUM_SEG: tl.constexpr,
    PARTS: tl.constexpr, SEG: tl.constexpr, TOKS: tl.constexpr, TILE: tl.constexpr,
):
    """Program ``g`` of ``G`` of batch row ``b`` (int64), buffer x head segment ``seg``:
    the runs g, g + G, ... of the row's misses (see the kernel's comments)."""
    n = tl.load(nload_ptr + b)
    row = tl.load(rows_ptr + b).to(tl.int64)
    # int64 layer (b is): layer x layer stride passes 2**31 elements in a pool over 4 GiB
    # per buffer, e.g. an SGLang KV pool the plugin adopts whole
    lay = b * 0 + layer
    end = tl.where(row >= 0, tl.minimum(n, K) * PS, 0)
    head = (seg % NUM_SEG).to(tl.int64)
    buf = (seg // NUM_SEG).to(tl.int64)
    piece = tl.arange(0, TILE)
    part = (piece % PARTS).to(tl.int64)
    tok_row = piece // PARTS
    w = tl.arange(0, SEG)[None, :]
    for t0 in range(g * TOKS, end, G * TOKS):
        t = t0 + tok_row
        miss = t // PS
        tok = (t % PS).to(tl.int64)
        live = (tok_row < TOKS) & (t < end)
        lid = tl.load(ids_ptr + b * stride_ids + miss, mask=live, other=-1)
        slot = tl.load(slots_ptr + b * stride_ids + miss, mask=live, other=-1)
        live = live & (lid >= 0) & (lid < hp_cols) & (slot >= 0) & (slot < sp_cols)
        hp = tl.load(hp_ptr + row * stride_hp + lid, mask=live, other=-1).to(tl.int64)
        dp = tl.load(sp_ptr + row * stride_sp + slot, mask=live, other=-1).to(tl.int64)
        hs = hp * PS + tok  # token slots; each view has its own page size
        ds = dp * PS + tok
        live = live & (hp >= 0) & (hs < src_slots) & (dp >= 0) & (ds < dst_slots)
        s_off = (hs // SRC_PS) * s_sp + (hs % SRC_PS) * s_st + lay * s_sl + buf * s_sb + head * s_sh + part * SEG
        d_off = (ds // DST_PS) * d_sp + (ds % DST_PS) * d_st + lay * d_sl + buf * d_sb + head * d_sh + part * SEG
        m = live[:, None] & (w < SEG)
        x = tl.load(src_ptr + s_off[:, None] + w, mask=m)
        tl.store(dst_ptr + d_off[:, None] + w, x, mask=m)


@triton.jit
def _swap_in_copy_kernel(
    src_ptr, dst_ptr, ids_ptr, slots_ptr, nload_ptr, rows_ptr, hp_ptr, sp_ptr,
    layer, K, src_slots, dst_slots, hp_cols, sp_cols,
    stride_ids, stride_hp, stride_sp,
    s_sp, s_st, s_sl, s_sb, s_sh, d_sp, d_st, d_sl, d_sb, d_sh,
    PS: tl.constexpr, SRC_PS: tl.constexpr, DST_PS: tl.constexpr, NUM_SEG: tl.constexpr,
    PARTS: tl.constexpr, SEG: tl.constexpr, TOKS: tl.constexpr, TILE: tl.constexpr, ROW_MAJOR: tl.constexpr,
):
    # grid: (batch row, G programs per row, buffer x head segment), or with ROW_MAJOR the
    # first two swapped: programs launch x-fastest, so a row's programs are then in flight
    # together and read its (ascending) host pages in order, while batch-fastest spreads
    # the reads of the moment over every row's host region. Program g of a row copies the
    # runs g, g + G, g + 2G, ... of TOKS token rows until the row's misses end (G: one
    # program per run by default, so each copies at most one; a caller may bound G).
    # Token rows are numbered miss * PS + token, so a run may hold several small pages or a
    # piece of a large one: the block size alone sets how many token rows a run moves.
    # A tile row is one SEG-word piece of a token's row (PARTS pieces per row): the inner
    # dimension is contiguous, so loads and stores are wide, and no lane idles on odd rows.
    if ROW_MAJOR:
        b = tl.program_id(1).to(tl.int64)
        g = tl.program_id(0)
        G = tl.num_programs(0)
    else:
        b = tl.program_id(0).to(tl.int64)
        g = tl.program_id(1)
        G = tl.num_programs(1)
    _swap_in_copy_block(b, g, G, tl.program_id(2), src_ptr, dst_ptr, ids_ptr, slots_ptr, nload_ptr, rows_ptr, hp_ptr,
                        sp_ptr, layer, K, src_slots, dst_slots, hp_cols, sp_cols, stride_ids, stride_hp, stride_sp,
                        s_sp, s_st, s_sl, s_sb, s_sh, d_sp, d_st, d_sl, d_sb, d_sh,
                        PS, SRC_PS, DST_PS, NUM_SEG, PARTS, SEG, TOKS, TILE)


def _piece_words(chunk: int, cap: int = 64) -> int:
    """Largest power of two dividing ``chunk`` (words of a row), at most ``cap``."""
    seg = 1
    while seg * 2 <= cap and chunk % (seg * 2) == 0:
        seg *= 2
    return seg


# Measured on one H100 (benchmarks/results/swapin.json, copy_variant_us, 2026-11-25): a row's
# programs adjacent in launch order read its ascending host pages together and take 7-18 %
# off the MLA copy at B = 64..128 (fewer host-page translations in flight), the same at
# small batch; 4 KiB blocks are as fast as or faster than 2, 8 and 16 KiB there. One program
# per run (the full grid): bounding it to 4-64 programs per SM, each looping over its row's
# runs, was never faster and up to 20 % slower at B = 128 (fewer reads in flight).
DEFAULT_BLOCK_BYTES = 4096
DEFAULT_ROW_MAJOR = True


@dataclass
class CopyGeometry:
    """How the copy kernel walks one layer's rows: word views, segments per row (``nseg``),
    pieces of ``seg`` words per segment (``parts``), token rows per run (``toks``), the
    tile (``tile`` pieces), and the load lists with matching strides."""

    src: torch.Tensor
    dst: torch.Tensor
    nseg: int
    seg: int
    parts: int
    toks: int
    tile: int
    load_ids: torch.Tensor
    load_slots: torch.Tensor


def copy_geometry(src, dst, load_ids, load_slots, block_bytes: int) -> CopyGeometry:
    """The ``CopyGeometry`` of a copy of ``block_bytes`` of rows per run (shared by this
    kernel and the fused copy + table launch)."""
    wr = word_rows(src, dst)
    seg = _piece_words(wr.chunk)
    parts = wr.chunk // seg
    toks = max(1, block_bytes // (wr.chunk * wr.width))
    ls = load_slots if load_slots.stride() == load_ids.stride() else load_slots.contiguous()
    li = load_ids if load_ids.stride() == ls.stride() else load_ids.contiguous()
    return CopyGeometry(wr.src, wr.dst, wr.nseg, seg, parts, toks, triton.next_power_of_2(toks * parts), li, ls)


def swap_in_copy_triton(src, dst, layer, load_ids, load_slots, num_loads, rows, host_pages, slot_pages,
                        page_size, block_bytes: int = DEFAULT_BLOCK_BYTES, row_major: bool = DEFAULT_ROW_MAJOR,
                        programs_per_row: Optional[int] = None) -> None:
    """Triton launcher (see the module docstring); about ``block_bytes`` of one buffer x
    head segment's rows per program (small blocks spread one request's misses, or one
    large page, over many SMs)."""
    _check(src, dst, layer, load_ids, load_slots, num_loads, rows, host_pages, slot_pages, page_size)
    if not isinstance(block_bytes, int) or block_bytes < 1:
        raise ValueError(f"block_bytes={block_bytes!r} is invalid: an int >= 1")
    b, k = load_ids.shape
    if b == 0 or k == 0:
        return
    ps = page_size
    nbuf = src.shape[3]
    g = copy_geometry(src, dst, load_ids, load_slots, block_bytes)
    ws, wd, nseg, li, ls = g.src, g.dst, g.nseg, g.load_ids, g.load_slots
    seg, parts, toks, tile = g.seg, g.parts, g.toks, g.tile
    runs = triton.cdiv(k * ps, toks)  # the most a row can need
    gpr = runs if programs_per_row is None else max(1, min(runs, programs_per_row))
    _swap_in_copy_kernel[(gpr, b, nbuf * nseg) if row_major else (b, gpr, nbuf * nseg)](
        ws, wd, li, ls, num_loads, rows, host_pages, slot_pages,
        layer, k, src.shape[0] * src.shape[1], dst.shape[0] * dst.shape[1], host_pages.shape[1], slot_pages.shape[1],
        li.stride(0), host_pages.stride(0), slot_pages.stride(0),
        ws.stride(0), ws.stride(1), ws.stride(2), ws.stride(3), ws.stride(4),
        wd.stride(0), wd.stride(1), wd.stride(2), wd.stride(3), wd.stride(4),
        PS=ps, SRC_PS=src.shape[1], DST_PS=dst.shape[1], NUM_SEG=nseg, PARTS=parts, SEG=seg, TOKS=toks,
        TILE=tile, ROW_MAJOR=bool(row_major), num_warps=4,
    )


def swap_in_copy(src, dst, layer, load_ids, load_slots, num_loads, rows, host_pages, slot_pages, page_size,
                 block_bytes: int = DEFAULT_BLOCK_BYTES, row_major: bool = DEFAULT_ROW_MAJOR,
                 programs_per_row: Optional[int] = None) -> None:
    """Copy one layer's missed pages host -> device (see the module docstring).

    src / dst: host / device 6-D pool views; load_ids, load_slots ``[B, K] int32`` and
    num_loads ``[B] int32`` from the LRU diff; rows ``[B] int64`` request rows (-1
    padding); host_pages ``[R, M] int64`` host page of each logical id; slot_pages ``[R, S]
    int32`` device page of each buffer slot; page_size tokens per page (page ``p`` is
    token slots ``[p * page_size, (p + 1) * page_size)`` on both sides); block_bytes: bytes
    of rows per run, row_major: launch order (a row's programs adjacent), programs_per_row:
    programs looping over a row's runs (None: one per run); Triton path."""
    probe = dst if dst.is_cuda else src
    args = (src, dst, layer, load_ids, load_slots, num_loads, rows, host_pages, slot_pages, page_size)
    if use_triton(probe):
        announce_path("swap_in_copy", "triton")
        swap_in_copy_triton(*args, block_bytes=block_bytes, row_major=row_major, programs_per_row=programs_per_row)
    else:
        announce_path("swap_in_copy", "reference")
        swap_in_copy_reference(*args)
