"""Row gather/scatter of KV between any two layouts (device pool, host pool layouts).

Both sides are described by the same 6-D view ``[pages, page_size, layers, buffers, heads,
dim]`` (``DeviceKVPool.paged_view`` / ``HostKVPool.paged_view``); slot ``s`` is
``(s // page_size, s % page_size)``. One launch copies, for every layer of a contiguous
layer range, every buffer and head, the rows ``dst[dst_slots[i]] = src[src_slots[i]]``.
Entries that are ``-1`` or out of range on either side are skipped, so padded index lists
never reach memory they do not own.

On CUDA the Triton kernel reads/writes pinned host memory directly (zero-copy over UVA):
one launch over the whole index list instead of one memcpy per row.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from hicache.triton_support import cdiv, dispatch


@triton.jit
def _kv_copy_kernel(
    src_ptr, dst_ptr, src_idx_ptr, dst_idx_ptr, n_rows, layer_start,
    src_slots, src_ps, src_sp, src_st, src_sl, src_sb, src_sh,
    dst_slots, dst_ps, dst_sp, dst_st, dst_sl, dst_sb, dst_sh,
    NUM_BUF: tl.constexpr, NUM_SEG: tl.constexpr, CHUNK: tl.constexpr,
    BLOCK_C: tl.constexpr, ROWS: tl.constexpr, FLAT: tl.constexpr,
):
    # axis 1 walks (layer, buffer, head segment); axis 0 walks blocks of the index list.
    pid = tl.program_id(0).to(tl.int64)
    seg = tl.program_id(1)
    head = (seg % NUM_SEG).to(tl.int64)
    buf = ((seg // NUM_SEG) % NUM_BUF).to(tl.int64)
    layer = (layer_start + seg // (NUM_SEG * NUM_BUF)).to(tl.int64)
    src_base = layer * src_sl + buf * src_sb + head * src_sh
    dst_base = layer * dst_sl + buf * dst_sb + head * dst_sh
    if FLAT:
        # One flat range of ROWS*BLOCK_C words over rows*CHUNK: no lanes idle when CHUNK
        # is not a power of two (1152 B MLA rows); each word re-reads its row's index (L1 hit).
        e = pid * (ROWS * BLOCK_C) + tl.arange(0, ROWS * BLOCK_C)
        row = e // CHUNK
        col = e % CHUNK
        rmask = row < n_rows
        s = tl.load(src_idx_ptr + row, mask=rmask, other=-1).to(tl.int64)
        d = tl.load(dst_idx_ptr + row, mask=rmask, other=-1).to(tl.int64)
        # Masked lanes compute offsets from -1/garbage but never touch memory.
        ok = rmask & (s >= 0) & (s < src_slots) & (d >= 0) & (d < dst_slots)
        s_off = (s // src_ps) * src_sp + (s % src_ps) * src_st + src_base + col
        d_off = (d // dst_ps) * dst_sp + (d % dst_ps) * dst_st + dst_base + col
        x = tl.load(src_ptr + s_off, mask=ok)
        tl.store(dst_ptr + d_off, x, mask=ok)
    else:
        rows = pid * ROWS + tl.arange(0, ROWS)
        rmask = rows < n_rows
        s = tl.load(src_idx_ptr + rows, mask=rmask, other=-1).to(tl.int64)
        d = tl.load(dst_idx_ptr + rows, mask=rmask, other=-1).to(tl.int64)
        ok = rmask & (s >= 0) & (s < src_slots) & (d >= 0) & (d < dst_slots)
        s_off = (s // src_ps) * src_sp + (s % src_ps) * src_st + src_base
        d_off = (d // dst_ps) * dst_sp + (d % dst_ps) * dst_st + dst_base
        cols = tl.arange(0, BLOCK_C)
        m = ok[:, None] & (cols < CHUNK)[None, :]
        x = tl.load(src_ptr + s_off[:, None] + cols[None, :], mask=m)
        tl.store(dst_ptr + d_off[:, None] + cols[None, :], x, mask=m)


@dataclass(frozen=True)
class KVCopyConfig:
    """Launch shape of the copy kernel. ``None`` fields are picked from the row size."""

    rows: int | None = None        # index entries per program (2-D tile) / tile height (flat)
    block_c: int | None = None     # words per tile row; power of two
    num_warps: int | None = None
    flat: bool | None = None       # flat tiling (no idle lanes for non-power-of-two rows)


_WORDS = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))


def _check_views(src: torch.Tensor, dst: torch.Tensor) -> None:
    for name, t in (("src", src), ("dst", dst)):
        if not isinstance(t, torch.Tensor) or t.dim() != 6:
            raise ValueError(f"{name} must be a 6-D view [pages, page_size, layers, buffers, heads, dim]")
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last (dim) axis, got strides {t.stride()}")
    if src.shape[2:] != dst.shape[2:]:
        raise ValueError(f"src and dst must agree on [layers, buffers, heads, dim], got {tuple(src.shape[2:])} "
                         f"and {tuple(dst.shape[2:])}")
    if src.dtype != dst.dtype:
        raise ValueError(f"src and dst must have the same dtype, got {src.dtype} and {dst.dtype}")


def _check_layers(src: torch.Tensor, layer_start: int, num_layers: int | None) -> int:
    total = src.shape[2]
    if num_layers is None:
        num_layers = total - layer_start
    if not (isinstance(layer_start, int) and isinstance(num_layers, int)
            and 0 <= layer_start and num_layers >= 1 and layer_start + num_layers <= total):
        raise ValueError(f"layer_start/num_layers must select a non-empty range inside [0, {total}), "
                         f"got start={layer_start!r} count={num_layers!r}")
    return num_layers


def _word_view(t: torch.Tensor, width: int, dtype: torch.dtype) -> torch.Tensor:
    return t if t.element_size() == width and t.dtype == dtype else t.view(dtype)


def _pick_word(src: torch.Tensor, dst: torch.Tensor, chunk_bytes: int) -> tuple[int, torch.dtype]:
    """Widest integer word that divides the row chunk and every pointer/stride."""
    es = src.element_size()
    for width, dtype in _WORDS:
        if chunk_bytes % width:
            continue
        if all((t.data_ptr() % width == 0) and all((st * es) % width == 0 for st in t.stride()[:-1]) for t in (src, dst)):
            if (src.shape[-1] * es) % width == 0:
                return width, dtype
    return 1, torch.uint8


@dataclass(frozen=True)
class WordRows:
    """Both views as integer words and the row geometry a copy kernel walks: ``nseg`` head
    segments per (layer, buffer), ``chunk`` words per row, ``width`` bytes per word."""

    src: torch.Tensor
    dst: torch.Tensor
    nseg: int
    chunk: int
    width: int


def word_rows(src: torch.Tensor, dst: torch.Tensor) -> WordRows:
    """The widest word views of ``src`` / ``dst`` and their row geometry (heads move as one
    row when both sides keep them adjacent; ``page_head`` splits them)."""
    nseg, row_len = row_segments(src, dst)
    chunk_bytes = row_len * src.element_size()
    width, wdtype = _pick_word(src, dst, chunk_bytes)
    return WordRows(_word_view(src, width, wdtype), _word_view(dst, width, wdtype), nseg, chunk_bytes // width, width)


def _default_config(chunk_words: int, word_bytes: int) -> KVCopyConfig:
    block_c = triton.next_power_of_2(chunk_words)
    # ~32 KiB per program keeps enough PCIe reads in flight per SM.
    rows = max(1, min(128, (32768 // word_bytes) // block_c))
    flat = block_c != chunk_words and block_c * 3 >= chunk_words * 4  # >25 % idle lanes
    return KVCopyConfig(rows=rows, block_c=block_c, num_warps=8 if rows * block_c * word_bytes >= 16384 else 4, flat=flat)


def kv_copy_triton(src: torch.Tensor, dst: torch.Tensor, src_slots: torch.Tensor, dst_slots: torch.Tensor,
                   layer_start: int = 0, num_layers: int | None = None,
                   config: KVCopyConfig | None = None) -> None:
    """``dst[dst_slots[i], layers] = src[src_slots[i], layers]`` for all buffers/heads.

    src, dst: 6-D views ``[pages, page_size, layers, buffers, heads, dim]`` (same dtype and
    trailing dims; one may be pinned host memory when the other is on CUDA, or both CPU under
    ``TRITON_INTERPRET=1``). src_slots, dst_slots: ``int64|int32 [N]`` on the launch device;
    ``-1``/out-of-range entries are skipped. Layers ``[layer_start, layer_start+num_layers)``.
    """
    _check_views(src, dst)
    num_layers = _check_layers(src, layer_start, num_layers)
    if src_slots.shape != dst_slots.shape or src_slots.dim() != 1:
        raise ValueError(f"src_slots and dst_slots must be 1-D of equal length, got {tuple(src_slots.shape)} "
                         f"and {tuple(dst_slots.shape)}")
    on_cuda = src.is_cuda or dst.is_cuda
    for name, t in (("src_slots", src_slots), ("dst_slots", dst_slots)):
        if t.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"{name} must have dtype int64 or int32, got {t.dtype}")
        if t.is_cuda != on_cuda:
            raise ValueError(f"{name} must be on the launch device ({'cuda' if on_cuda else 'cpu'}), got {t.device}")
    n = src_slots.numel()
    if n == 0:
        return
    nbuf = src.shape[3]
    wr = word_rows(src, dst)
    ws, wd, nseg, chunk, width = wr.src, wr.dst, wr.nseg, wr.chunk, wr.width
    cfg = _default_config(chunk, width)
    if config is not None:
        cfg = KVCopyConfig(*(getattr(config, f) if getattr(config, f) is not None else getattr(cfg, f)
                             for f in ("rows", "block_c", "num_warps", "flat")))
    if cfg.flat:
        grid0 = cdiv(n * chunk, cfg.rows * cfg.block_c)
    else:
        if cfg.block_c < chunk:
            raise ValueError(f"config.block_c must be >= the row chunk ({chunk} words) for 2-D tiling")
        grid0 = cdiv(n, cfg.rows)
    grid = (grid0, num_layers * nbuf * nseg)

    def geo(t: torch.Tensor, pages_slots: int) -> tuple[int, ...]:
        return (pages_slots, t.shape[1], t.stride(0), t.stride(1), t.stride(2), t.stride(3), t.stride(4))

    _kv_copy_kernel[grid](
        ws, wd, src_slots, dst_slots, n, layer_start,
        *geo(ws, src.shape[0] * src.shape[1]), *geo(wd, dst.shape[0] * dst.shape[1]),
        NUM_BUF=nbuf, NUM_SEG=nseg, CHUNK=chunk, BLOCK_C=cfg.block_c, ROWS=cfg.rows, FLAT=bool(cfg.flat),
        num_warps=cfg.num_warps,
    )


def row_segments(src: torch.Tensor, dst: torch.Tensor) -> tuple[int, int]:
    """(head segments, row length in elements): heads move as one row when both sides keep
    them adjacent, else one row per head (``page_head``)."""
    heads, dim = src.shape[4], src.shape[5]
    nseg, row_len = (1, heads * dim) if heads == 1 or all(t.stride(4) == dim for t in (src, dst)) else (heads, dim)
    for name, t in (("src", src), ("dst", dst)):
        strides = t.stride()[:4] + ((t.stride(4),) if nseg > 1 else ())
        if any(st % row_len for st in strides):
            raise ValueError(f"{name} strides {t.stride()} must be multiples of the row length {row_len}")
    return nseg, row_len


def row_matrix(view: torch.Tensor, row_len: int) -> torch.Tensor:
    """The storage under a 6-D pool view as ``[rows, row_len]`` (a view, no copy)."""
    es = view.element_size()
    total = (view.untyped_storage().nbytes() // es - view.storage_offset()) // row_len
    return view.as_strided((total, row_len), (row_len, 1), view.storage_offset())


def row_ids(view: torch.Tensor, slots: torch.Tensor, layer: int, buf: int, head: int, row_len: int) -> torch.Tensor:
    """``int64 [N]`` row numbers in ``row_matrix(view, row_len)`` of ``slots`` (int64, in range)."""
    ps = view.shape[1]
    base = layer * view.stride(2) + buf * view.stride(3) + head * view.stride(4)
    off = torch.div(slots, ps, rounding_mode="floor") * view.stride(0) + (slots % ps) * view.stride(1) + base
    return torch.div(off, row_len, rounding_mode="floor")


def kv_copy_reference(src: torch.Tensor, dst: torch.Tensor, src_slots: torch.Tensor, dst_slots: torch.Tensor,
                      layer_start: int = 0, num_layers: int | None = None) -> None:
    """Plain-torch :func:`kv_copy_triton` (same arguments, same result): per (layer, buffer,
    head segment) one ``index_select`` / ``index_copy_`` over the pool storage seen as rows.
    Index lists may be on either side's device; rows cross devices with one ``.to``."""
    _check_views(src, dst)
    num_layers = _check_layers(src, layer_start, num_layers)
    if src_slots.shape != dst_slots.shape or src_slots.dim() != 1:
        raise ValueError("src_slots and dst_slots must be 1-D of equal length")
    s = src_slots.to(device=src.device, dtype=torch.int64)
    d = dst_slots.to(device=src.device, dtype=torch.int64)
    src_n, dst_n = src.shape[0] * src.shape[1], dst.shape[0] * dst.shape[1]
    ok = (s >= 0) & (s < src_n) & (d >= 0) & (d < dst_n)
    if not bool(ok.all()):
        s, d = s[ok], d[ok]
    if s.numel() == 0:
        return
    d = d.to(dst.device)
    nseg, row_len = row_segments(src, dst)
    src_rows, dst_rows = row_matrix(src, row_len), row_matrix(dst, row_len)
    for layer in range(layer_start, layer_start + num_layers):
        for b in range(src.shape[3]):
            for h in range(nseg):
                rows = src_rows.index_select(0, row_ids(src, s, layer, b, h, row_len))
                dst_rows.index_copy_(0, row_ids(dst, d, layer, b, h, row_len), rows.to(dst.device))


def kv_copy(src: torch.Tensor, dst: torch.Tensor, src_slots: torch.Tensor, dst_slots: torch.Tensor,
            layer_start: int = 0, num_layers: int | None = None) -> None:
    """The row copy (see the module docstring): Triton when the GPU side is CUDA, the torch
    reference elsewhere."""
    impl = dispatch("kv_copy", dst if dst.is_cuda else src, kv_copy_triton, kv_copy_reference)
    impl(src, dst, src_slots, dst_slots, layer_start, num_layers)
