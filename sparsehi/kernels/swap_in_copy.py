"""The host->device copy of one sparse layer's misses, straight from the LRU diff's output.

The diff lists, per batch row, the missed logical ids (``load_ids``) and the buffer slots
they go to (``load_slots``), ``num_loads`` of them. This kernel looks up each miss's host
page (``host_pages[row, id]``) and device page (``slot_pages[row, slot]``) itself and
copies the page's rows of one layer (every buffer: k and v, or the MLA latent) over the
pinned host memory (zero copy), so no index list is built, expanded or sorted between the
diff and the copy. The grid spreads one row's misses over many programs: at batch 1 a
single request's copy still runs on many SMs.

Both sides are the 6-D pool views ``[pages, page_size, layers, buffers, heads, dim]``
(``HostKVPool.paged_view`` / ``DeviceKVPool.paged_view``, every host layout; each view has
its own page size, token slot ``s`` is ``(s // view_page_size, s % view_page_size)``).
Entries that are ``-1`` (no load, padding) or out of range are skipped.

Token ``t`` (``0 <= t < page_size``) of a miss with logical id ``lid`` in request row ``row``
goes to device token slot ``slot_pages[row, slot] * page_size + t``. Its host slot ``h`` is

- ``host_pages[row, lid] * page_size + t`` (by default), or
- with ``host_tokens`` (``[R, T]`` int32/int64, a token table over the same request rows;
  ``host_pages`` is then not read and may be None): ``host_tokens[row, lid * page_size + t]``.
  An entry < 0 or a column ``lid * page_size + t >= T`` skips the token.

A host slot outside ``src`` skips the token (nothing written). With ``resident = (v2p,
v2p_page_size)`` (``v2p [N]`` int32/int64, a page table over host slots in pages of
``v2p_page_size`` tokens, a power of two), a token whose ``0 <= h // v2p_page_size < N`` and
``v2p[h // v2p_page_size] > 0`` is still in GPU memory and is read from ``dst`` at token slot
``v2p[h // v2p_page_size] * v2p_page_size + h % v2p_page_size`` (skipped if that is outside
``dst``) instead of from ``src``; entries <= 0 read the host. Those device slots must not be
among the slots the same call writes (the kernel's programs run in no fixed order; the
reference reads them before it writes).

Entry points: ``swap_in_copy`` (dispatch), ``swap_in_copy_triton``, ``swap_in_copy_reference``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from hicache.kernels.kv_copy import kv_copy_reference, word_rows
from hicache.triton_support import cdiv, dispatch

# Launch shape (measurements: docs/kernels.md): 4 KiB of rows per program, a row's programs
# adjacent in launch order, one program per run.
DEFAULT_BLOCK_BYTES = 4096
DEFAULT_ROW_MAJOR = True


def _check(src, dst, layer, load_ids, load_slots, num_loads, rows, host_pages, slot_pages, page_size,
           host_tokens=None, resident=None) -> None:
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
    if not isinstance(slot_pages, torch.Tensor) or slot_pages.dim() != 2:
        raise ValueError("slot_pages must be a 2-D table [R, S] over the request rows")
    if host_tokens is None:
        if (not isinstance(host_pages, torch.Tensor) or host_pages.dim() != 2
                or host_pages.shape[0] != slot_pages.shape[0]):
            raise ValueError("host_pages [R, M] and slot_pages [R, S] must be 2-D tables over the same request rows "
                             "(host_pages may be None only with host_tokens)")
    else:
        _check_table("host_tokens", host_tokens, 2, slot_pages)
        if host_tokens.shape[0] != slot_pages.shape[0]:
            raise ValueError(f"host_tokens must be [R, T] over the same request rows as slot_pages (R="
                             f"{slot_pages.shape[0]}), got {tuple(host_tokens.shape)}")
    if resident is not None:
        if not isinstance(resident, tuple) or len(resident) != 2:
            raise ValueError(f"resident must be a tuple (v2p, v2p_page_size) or None, got {type(resident).__name__}")
        v2p, vps = resident
        _check_table("resident[0] (v2p)", v2p, 1, slot_pages)
        if not isinstance(vps, int) or isinstance(vps, bool) or vps < 1 or vps & (vps - 1):
            raise ValueError(f"resident[1] (v2p_page_size)={vps!r} is invalid: a power of two int >= 1")


def _check_table(name: str, t, dim: int, like: torch.Tensor) -> None:
    """``t``: a ``dim``-D int32 / int64 tensor on ``like``'s device."""
    if not isinstance(t, torch.Tensor) or t.dim() != dim:
        shape = "[R, T]" if dim == 2 else "[N]"
        got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name} must be a {dim}-D tensor {shape}, got {got}")
    if t.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} must have dtype int32 or int64, got {t.dtype}")
    if t.device != like.device:
        raise ValueError(f"{name} must be on the device of the index tables ({like.device}), got {t.device}")


def _gather(table: torch.Tensor, r: torch.Tensor, cols: torch.Tensor, ok: torch.Tensor) -> torch.Tensor:
    """``table[r, cols]`` (int64) where ``ok`` (cols in range), -1 elsewhere."""
    if table.shape[1] == 0:
        return torch.full(cols.shape, -1, dtype=torch.long, device=cols.device)
    return torch.where(ok, table.long()[r, cols.clamp(0, table.shape[1] - 1)], -1)


def swap_in_slots(src, load_ids, load_slots, num_loads, rows, host_pages, slot_pages, page_size,
                  host_tokens=None, resident=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The slot lists of ``swap_in_copy_reference``, ``int64 [B * K * page_size]`` each, one
    entry per token of the misses: ``(h, d, rs)``, the host slot read (in ``src``), the device
    slot written, the device slot read when the token is resident; -1 where there is none
    (``h`` is -1 where ``rs`` is not). Host slots outside ``src`` are -1 already; ``d`` and
    ``rs`` are not checked against ``dst`` (``kv_copy_reference`` skips those)."""
    ps = page_size
    b, k = load_ids.shape
    dev = load_ids.device
    cols = torch.arange(k, device=dev)[None, :]
    r = rows.long().clamp(min=0)[:, None]
    ids = load_ids.long()
    # ids and slots past their tables are skipped, as the kernel does (not clamped)
    ok = (cols < num_loads.long()[:, None]) & (ids >= 0) & (load_slots >= 0) & (rows[:, None] >= 0)
    off = torch.arange(ps, device=dev)
    if host_tokens is None:
        hp = _gather(host_pages, r, ids, ok & (ids < host_pages.shape[1]))
        h = torch.where(hp[..., None] >= 0, hp[..., None] * ps + off, -1)
    else:
        tcol = ids[..., None] * ps + off
        h = _gather(host_tokens, r[..., None], tcol, ok[..., None] & (tcol < host_tokens.shape[1]))
    h = torch.where((h >= 0) & (h < src.shape[0] * src.shape[1]), h, -1)
    dp = _gather(slot_pages, r, load_slots.long(), ok & (load_slots < slot_pages.shape[1]))
    d = torch.where(dp[..., None] >= 0, dp[..., None] * ps + off, -1)
    rs = torch.full_like(h, -1)
    if resident is not None:
        v2p, vps = resident
        vp = torch.div(h, vps, rounding_mode="floor")
        pp = _gather(v2p[None, :], torch.zeros_like(vp), vp, (h >= 0) & (vp < v2p.shape[0]))
        rs = torch.where(pp > 0, pp * vps + h % vps, -1)
        h = torch.where(pp > 0, -1, h)
    return h.reshape(-1), d.reshape(-1), rs.reshape(-1)


def swap_in_copy_reference(src, dst, layer, load_ids, load_slots, num_loads, rows, host_pages, slot_pages,
                           page_size, block_bytes: int = DEFAULT_BLOCK_BYTES, row_major: bool = DEFAULT_ROW_MAJOR,
                           programs_per_row: Optional[int] = None, *, host_tokens: Optional[torch.Tensor] = None,
                           resident: Optional[tuple[torch.Tensor, int]] = None) -> None:
    """Torch reference: the same copy through per-token slot lists (``swap_in_slots``) and
    ``kv_copy_reference``; resident tokens are read (from ``dst``) before anything is written.
    ``block_bytes``, ``row_major`` and ``programs_per_row`` shape the Triton launch only."""
    _check(src, dst, layer, load_ids, load_slots, num_loads, rows, host_pages, slot_pages, page_size, host_tokens,
           resident)
    h, d, rs = swap_in_slots(src, load_ids, load_slots, num_loads, rows, host_pages, slot_pages, page_size,
                             host_tokens, resident)
    if resident is not None:
        kv_copy_reference(dst, dst, rs, torch.where(rs >= 0, d, -1), layer, 1)
    kv_copy_reference(src, dst, h, d, layer, 1)


@triton.jit
def _swap_in_copy_block(
    b, g, G, seg,
    src_ptr, dst_ptr, ids_ptr, slots_ptr, nload_ptr, rows_ptr, hp_ptr, sp_ptr,
    layer, K, src_slots, dst_slots, hp_cols, sp_cols,
    stride_ids, stride_hp, stride_sp,
    s_sp, s_st, s_sl, s_sb, s_sh, d_sp, d_st, d_sl, d_sb, d_sh,
    ht_ptr, v2p_ptr, ht_cols, v2p_n, stride_ht, stride_htc, stride_v2p,
    PS: tl.constexpr, SRC_PS: tl.constexpr, DST_PS: tl.constexpr, NUM_SEG: tl.constexpr,
    PARTS: tl.constexpr, SEG: tl.constexpr, TOKS: tl.constexpr, TILE: tl.constexpr,
    HAS_TOKENS: tl.constexpr, RESIDENT: tl.constexpr, VPS: tl.constexpr,
):
    """Program ``g`` of ``G`` of batch row ``b`` (int64), buffer x head segment ``seg``:
    the runs g, g + G, ... of the row's misses (see the kernel's comments). ``HAS_TOKENS``:
    host slots from the token table ``ht`` (``[R, ht_cols]``); ``RESIDENT``: tokens whose
    host page of ``VPS`` slots has a ``v2p`` entry > 0 are read from ``dst``. With both
    False the branches taken are the page-table copy's alone."""
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
        if HAS_TOKENS:
            # the token's own host slot: host_tokens[row, lid * PS + tok] (< 0: none)
            tcol = lid.to(tl.int64) * PS + tok
            live = live & (lid >= 0) & (tcol < ht_cols) & (slot >= 0) & (slot < sp_cols)
            hs = tl.load(ht_ptr + row * stride_ht + tcol * stride_htc, mask=live, other=-1).to(tl.int64)
            dp = tl.load(sp_ptr + row * stride_sp + slot, mask=live, other=-1).to(tl.int64)
            ds = dp * PS + tok
            live = live & (hs >= 0) & (hs < src_slots) & (dp >= 0) & (ds < dst_slots)
        else:
            live = live & (lid >= 0) & (lid < hp_cols) & (slot >= 0) & (slot < sp_cols)
            hp = tl.load(hp_ptr + row * stride_hp + lid, mask=live, other=-1).to(tl.int64)
            dp = tl.load(sp_ptr + row * stride_sp + slot, mask=live, other=-1).to(tl.int64)
            hs = hp * PS + tok  # token slots; each view has its own page size
            ds = dp * PS + tok
            live = live & (hp >= 0) & (hs < src_slots) & (dp >= 0) & (ds < dst_slots)
        s_off = (hs // SRC_PS) * s_sp + (hs % SRC_PS) * s_st + lay * s_sl + buf * s_sb + head * s_sh + part * SEG
        d_off = (ds // DST_PS) * d_sp + (ds % DST_PS) * d_st + lay * d_sl + buf * d_sb + head * d_sh + part * SEG
        if RESIDENT:
            # a host page still mapped to device memory (v2p > 0) is read there (HBM, not PCIe)
            vp = hs // VPS
            pp = tl.load(v2p_ptr + vp * stride_v2p, mask=live & (vp < v2p_n), other=0).to(tl.int64)
            rs = pp * VPS + hs % VPS
            on_dev = live & (pp > 0) & (rs < dst_slots)
            on_host = live & (pp <= 0)
            r_off = (rs // DST_PS) * d_sp + (rs % DST_PS) * d_st + lay * d_sl + buf * d_sb + head * d_sh + part * SEG
            mh = on_host[:, None] & (w < SEG)
            md = on_dev[:, None] & (w < SEG)
            xh = tl.load(src_ptr + s_off[:, None] + w, mask=mh)
            xd = tl.load(dst_ptr + r_off[:, None] + w, mask=md)
            tl.store(dst_ptr + d_off[:, None] + w, tl.where(md, xd, xh), mask=mh | md)
        else:
            m = live[:, None] & (w < SEG)
            x = tl.load(src_ptr + s_off[:, None] + w, mask=m)
            tl.store(dst_ptr + d_off[:, None] + w, x, mask=m)


@triton.jit
def _swap_in_copy_kernel(
    src_ptr, dst_ptr, ids_ptr, slots_ptr, nload_ptr, rows_ptr, hp_ptr, sp_ptr,
    layer, K, src_slots, dst_slots, hp_cols, sp_cols,
    stride_ids, stride_hp, stride_sp,
    s_sp, s_st, s_sl, s_sb, s_sh, d_sp, d_st, d_sl, d_sb, d_sh,
    ht_ptr, v2p_ptr, ht_cols, v2p_n, stride_ht, stride_htc, stride_v2p,
    PS: tl.constexpr, SRC_PS: tl.constexpr, DST_PS: tl.constexpr, NUM_SEG: tl.constexpr,
    PARTS: tl.constexpr, SEG: tl.constexpr, TOKS: tl.constexpr, TILE: tl.constexpr, ROW_MAJOR: tl.constexpr,
    HAS_TOKENS: tl.constexpr, RESIDENT: tl.constexpr, VPS: tl.constexpr,
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
                        ht_ptr, v2p_ptr, ht_cols, v2p_n, stride_ht, stride_htc, stride_v2p,
                        PS, SRC_PS, DST_PS, NUM_SEG, PARTS, SEG, TOKS, TILE, HAS_TOKENS, RESIDENT, VPS)


def _piece_words(chunk: int, cap: int = 64) -> int:
    """Largest power of two dividing ``chunk`` (words of a row), at most ``cap``."""
    seg = 1
    while seg * 2 <= cap and chunk % (seg * 2) == 0:
        seg *= 2
    return seg


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


def source_args(host_pages, slot_pages, host_tokens, resident) -> tuple[tuple, tuple, dict]:
    """Kernel arguments of the host-slot source (shared with the fused launch): ``(hp_ptr,
    hp_cols, stride_hp)``, ``(ht_ptr, v2p_ptr, ht_cols, v2p_n, stride_ht, stride_htc,
    stride_v2p)`` and the constexprs ``HAS_TOKENS``, ``RESIDENT``, ``VPS``. Tables not in use
    are replaced by ``slot_pages`` (never read) with zero sizes and strides."""
    dummy = slot_pages
    if host_tokens is None:
        hp = (host_pages, host_pages.shape[1], host_pages.stride(0))
        ht = (dummy, 0, 0, 0)
    else:
        hp = (dummy, 0, 0)
        ht = (host_tokens, host_tokens.shape[1], host_tokens.stride(0), host_tokens.stride(1))
    if resident is None:
        v2p, vps = dummy, 1
        vt = (dummy, 0, 0)
    else:
        v2p, vps = resident
        vt = (v2p, v2p.shape[0], v2p.stride(0))
    extra = (ht[0], vt[0], ht[1], vt[1], ht[2], ht[3], vt[2])
    return hp, extra, dict(HAS_TOKENS=host_tokens is not None, RESIDENT=resident is not None, VPS=vps)


def swap_in_copy_triton(src, dst, layer, load_ids, load_slots, num_loads, rows, host_pages, slot_pages,
                        page_size, block_bytes: int = DEFAULT_BLOCK_BYTES, row_major: bool = DEFAULT_ROW_MAJOR,
                        programs_per_row: Optional[int] = None, *, host_tokens: Optional[torch.Tensor] = None,
                        resident: Optional[tuple[torch.Tensor, int]] = None) -> None:
    """Triton launcher (see the module docstring); about ``block_bytes`` of one buffer x
    head segment's rows per program (small blocks spread one request's misses, or one
    large page, over many SMs). No host syncs (graph-capturable)."""
    _check(src, dst, layer, load_ids, load_slots, num_loads, rows, host_pages, slot_pages, page_size, host_tokens,
           resident)
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
    runs = cdiv(k * ps, toks)  # the most a row can need
    gpr = runs if programs_per_row is None else max(1, min(runs, programs_per_row))
    (hp, hp_cols, stride_hp), extra, flags = source_args(host_pages, slot_pages, host_tokens, resident)
    _swap_in_copy_kernel[(gpr, b, nbuf * nseg) if row_major else (b, gpr, nbuf * nseg)](
        ws, wd, li, ls, num_loads, rows, hp, slot_pages,
        layer, k, src.shape[0] * src.shape[1], dst.shape[0] * dst.shape[1], hp_cols, slot_pages.shape[1],
        li.stride(0), stride_hp, slot_pages.stride(0),
        ws.stride(0), ws.stride(1), ws.stride(2), ws.stride(3), ws.stride(4),
        wd.stride(0), wd.stride(1), wd.stride(2), wd.stride(3), wd.stride(4),
        *extra,
        PS=ps, SRC_PS=src.shape[1], DST_PS=dst.shape[1], NUM_SEG=nseg, PARTS=parts, SEG=seg, TOKS=toks,
        TILE=tile, ROW_MAJOR=bool(row_major), **flags, num_warps=4,
    )


def swap_in_copy(src, dst, layer, load_ids, load_slots, num_loads, rows, host_pages, slot_pages, page_size,
                 block_bytes: int = DEFAULT_BLOCK_BYTES, row_major: bool = DEFAULT_ROW_MAJOR,
                 programs_per_row: Optional[int] = None, *, host_tokens: Optional[torch.Tensor] = None,
                 resident: Optional[tuple[torch.Tensor, int]] = None) -> None:
    """Copy one layer's missed pages host -> device (see the module docstring).

    src / dst: host / device 6-D pool views; load_ids, load_slots ``[B, K] int32`` and
    num_loads ``[B] int32`` from the LRU diff; rows ``[B] int64`` request rows (-1
    padding); host_pages ``[R, M] int64`` host page of each logical id (None allowed with
    host_tokens); slot_pages ``[R, S] int32`` device page of each buffer slot; page_size
    tokens per page (page ``p`` is token slots ``[p * page_size, (p + 1) * page_size)`` on
    both sides, unless host_tokens gives the host slots); host_tokens ``[R, T]``: the host
    slot of each token (``host_tokens[row, lid * page_size + t]``, < 0: skip); resident
    ``(v2p [N], v2p_page_size)``: host pages still in GPU memory, read from ``dst``;
    block_bytes: bytes of rows per run, row_major: launch order (a row's programs
    adjacent), programs_per_row: programs looping over a row's runs (None: one per run);
    Triton path."""
    impl = dispatch("swap_in_copy", dst if dst.is_cuda else src, swap_in_copy_triton, swap_in_copy_reference)
    impl(src, dst, layer, load_ids, load_slots, num_loads, rows, host_pages, slot_pages, page_size, block_bytes,
         row_major, programs_per_row, host_tokens=host_tokens, resident=resident)
