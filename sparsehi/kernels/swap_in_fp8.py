"""The host->device copy of one sparse layer's misses out of an FP8 host pool, dequantised,
straight from the LRU diff's output (the FP8 form of ``swap_in_copy``).

For every batch row ``b`` and ``k < num_loads[b]``, the miss with logical id ``lid =
load_ids[b, k]`` goes to LRU slot ``slot = load_slots[b, k]`` of request row ``r = rows[b]``:
host page ``hp = host_pages[r, lid]``, device page ``dp = slot_pages[r, slot]``, and for
every buffer (k and v, or MLA's latent) and head

    dev[slot s] = values[hp, layer, buf, t, head, :] * scales[hp, layer, buf, head],  s = dp * page_size + t

for the page's ``page_size`` tokens ``t``, token slot ``s`` of the device view being ``(s //
view_page_size, s % view_page_size)`` (the device pool may page its slots differently). The scales are powers of two, so every value is
exact in the device pool's dtype (bfloat16, float32). Entries that are ``-1`` (no load,
padding rows) or out of range on either side are skipped.

``values [pages, layers, buffers, page_size, heads, dim]`` uint8 (E4M3 bits) and ``scales
[pages, layers, buffers, heads]`` float32 are ``HostKVPool.fp8_values`` / ``fp8_scales``
(pinned; read in place from the GPU); ``dev`` is the device pool's 6-D view ``[pages,
view_page_size, layers, buffers, heads, dim]``. One program per miss
and head block: no index list is built between the diff and the copy, no host sync
(CUDA-graph safe). ``programs_per_row`` instead gives each row and head that many programs,
each copying the row's misses ``g, g + G, ...``: few programs in flight, for a copy that
runs beside other work (loading ahead) and should hold few SM slots while it waits on
host memory.

Entry points: ``swap_in_fp8_copy`` (dispatch), ``swap_in_fp8_copy_triton``,
``swap_in_fp8_copy_reference``.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from hicache.triton_support import dispatch


def _check(values, scales, dev, layer, load_ids, load_slots, num_loads, rows, host_pages, slot_pages) -> None:
    if not isinstance(values, torch.Tensor) or values.dim() != 6 or values.dtype != torch.uint8:
        raise ValueError("values must be uint8 [pages, layers, buffers, page_size, heads, dim] (E4M3 bits)")
    P, L, B, ps, H, D = values.shape
    if not isinstance(scales, torch.Tensor) or tuple(scales.shape) != (P, L, B, H) or scales.dtype != torch.float32:
        raise ValueError(f"scales must be float32 [pages, layers, buffers, heads]={(P, L, B, H)}")
    if not isinstance(dev, torch.Tensor) or dev.dim() != 6 or tuple(dev.shape[2:]) != (L, B, H, D):
        raise ValueError(f"dev must be a 6-D view [pages, view_page_size, layers, buffers, heads, dim] matching "
                         f"values, got {tuple(dev.shape) if isinstance(dev, torch.Tensor) else type(dev).__name__}")
    if dev.dtype not in (torch.float32, torch.bfloat16, torch.float16) or dev.stride(-1) != 1 \
            or values.stride(-1) != 1:
        raise ValueError("dev must be float32/bfloat16/float16; dev and values need a contiguous last dim")
    if not isinstance(layer, int) or isinstance(layer, bool) or not 0 <= layer < L:
        raise ValueError(f"layer must be an int in [0, {L}), got {layer!r}")
    n, k = load_ids.shape
    if load_slots.shape != (n, k) or num_loads.shape != (n,) or rows.shape != (n,):
        raise ValueError(f"load_slots [B, K], num_loads [B] and rows [B] must match load_ids {tuple(load_ids.shape)}")
    for name, t in (("host_pages", host_pages), ("slot_pages", slot_pages)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be a 2-D int32/int64 table [R, *] over the request rows")
    if host_pages.shape[0] != slot_pages.shape[0]:
        raise ValueError(f"host_pages and slot_pages must cover the same request rows, got {host_pages.shape[0]} "
                         f"and {slot_pages.shape[0]}")


def swap_in_fp8_copy_reference(values, scales, dev, layer: int, load_ids, load_slots, num_loads, rows, host_pages,
                               slot_pages, programs_per_row: Optional[int] = None) -> None:
    """Plain-torch ``swap_in_fp8_copy`` (same arguments and result; reads indices on the
    host; ``programs_per_row`` only shapes the kernel's grid)."""
    _check(values, scales, dev, layer, load_ids, load_slots, num_loads, rows, host_pages, slot_pages)
    n, k = load_ids.shape
    ids, slots = load_ids.cpu().long(), load_slots.cpu().long()
    live = (torch.arange(k)[None, :] < num_loads.cpu().long()[:, None]) & (rows.cpu()[:, None] >= 0)
    hp_tab, sp_tab = host_pages.cpu().long(), slot_pages.cpu().long()
    for b, j in live.nonzero().tolist():
        r, lid, slot = int(rows[b]), int(ids[b, j]), int(slots[b, j])
        if not (0 <= lid < hp_tab.shape[1] and 0 <= slot < sp_tab.shape[1] and 0 <= r < hp_tab.shape[0]):
            continue
        hp, dp = int(hp_tab[r, lid]), int(sp_tab[r, slot])
        ps, vps = values.shape[3], dev.shape[1]
        if not (0 <= hp < values.shape[0] and 0 <= dp and (dp + 1) * ps <= dev.shape[0] * vps):
            continue
        q = values[hp, layer].view(torch.float8_e4m3fn).float()  # [buffers, page_size, heads, dim]
        page = (q * scales[hp, layer][:, None, :, None]).permute(1, 0, 2, 3)  # [page_size, buffers, heads, dim]
        s = torch.arange(dp * ps, (dp + 1) * ps)
        dev[s // vps, s % vps, layer] = page.to(device=dev.device, dtype=dev.dtype)


@triton.jit
def _swap_in_fp8_block(b, j, head, buf0, t0,
                       v_ptr, s_ptr, d_ptr, ids_ptr, slots_ptr, nload_ptr, rows_ptr, hp_ptr, sp_ptr,
                       n_host, n_dev, VPS, R, M, S, layer, D,
                       svp, svl, svb, svt, svh, ssp, ssl, ssb, sdp, sdt, sdl, sdb, sdh, s_ids, s_slots, s_hp, s_sp,
                       NBUF: tl.constexpr, PS: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr):
    """Miss ``j`` (``j < K``) of batch row ``b`` (int64), head ``head``: page tokens ``[t0,
    t0 + BT)`` (those below ``PS``) of buffers ``buf0 .. buf0 + NBUF``, dequantised into the
    device view. Nothing is written for a miss past ``num_loads[b]``, a padding row or an
    index out of range on either side."""
    row = tl.load(rows_ptr + b).to(tl.int64)
    n = tl.load(nload_ptr + b)
    lid = tl.load(ids_ptr + b * s_ids + j, mask=j < n, other=-1).to(tl.int64)
    slot = tl.load(slots_ptr + b * s_slots + j, mask=j < n, other=-1).to(tl.int64)
    ok = (j < n) & (row >= 0) & (row < R) & (lid >= 0) & (lid < M) & (slot >= 0) & (slot < S)
    hp = tl.load(hp_ptr + row * s_hp + lid, mask=ok, other=-1).to(tl.int64)
    dp = tl.load(sp_ptr + row * s_sp + slot, mask=ok, other=-1).to(tl.int64)
    if ok & (hp >= 0) & (hp < n_host) & (dp >= 0) & ((dp + 1) * PS <= n_dev):
        t = t0 + tl.arange(0, BT)
        d = tl.arange(0, BD)
        m = (t[:, None] < PS) & (d[None, :] < D)
        ds = dp * PS + t  # device token slots of the page
        rows_d = (ds // VPS) * sdp + (ds % VPS) * sdt
        lay = tl.full((), layer, tl.int64)
        for i in tl.static_range(NBUF):
            buf = buf0 + i
            raw = tl.load(v_ptr + hp * svp + lay * svl + buf * svb + t[:, None] * svt + head * svh + d[None, :],
                          mask=m, other=0)
            scale = tl.load(s_ptr + hp * ssp + lay * ssl + buf * ssb + head)
            y = raw.to(tl.float8e4nv, bitcast=True).to(tl.float32) * scale
            tl.store(d_ptr + rows_d[:, None] + lay * sdl + buf * sdb + head * sdh + d[None, :],
                     y.to(d_ptr.dtype.element_ty), mask=m)


@triton.jit
def _swap_in_fp8_kernel(v_ptr, s_ptr, d_ptr, ids_ptr, slots_ptr, nload_ptr, rows_ptr, hp_ptr, sp_ptr,
                        K, G, n_host, n_dev, VPS, R, M, S, layer, D,
                        svp, svl, svb, svt, svh, ssp, ssl, ssb, sdp, sdt, sdl, sdb, sdh, s_ids, s_slots, s_hp, s_sp,
                        NB: tl.constexpr, PS: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
                        LOOP: tl.constexpr):
    # grid (row x miss, head): a program moves a whole page of one head, every buffer; with
    # LOOP, (row x G, head): program g of a row moves its misses g, g + G, ...
    x = tl.program_id(0)
    head = tl.program_id(1).to(tl.int64)
    if LOOP:
        b = x // G
        for j in range(x % G, tl.minimum(tl.load(nload_ptr + b), K), G):
            _swap_in_fp8_block(b, j, head, 0, 0,
                               v_ptr, s_ptr, d_ptr, ids_ptr, slots_ptr, nload_ptr, rows_ptr, hp_ptr, sp_ptr,
                               n_host, n_dev, VPS, R, M, S, layer, D,
                               svp, svl, svb, svt, svh, ssp, ssl, ssb, sdp, sdt, sdl, sdb, sdh, s_ids, s_slots,
                               s_hp, s_sp, NB, PS, BT, BD)
    else:
        _swap_in_fp8_block(x // K, x % K, head, 0, 0,
                           v_ptr, s_ptr, d_ptr, ids_ptr, slots_ptr, nload_ptr, rows_ptr, hp_ptr, sp_ptr,
                           n_host, n_dev, VPS, R, M, S, layer, D,
                           svp, svl, svb, svt, svh, ssp, ssl, ssb, sdp, sdt, sdl, sdb, sdh, s_ids, s_slots, s_hp, s_sp,
                           NB, PS, BT, BD)


def copy_args(values, scales, dev, layer: int, load_ids, load_slots, host_pages, slot_pages) -> tuple:
    """The copy's runtime kernel arguments after the pointers' ``(values, scales, dev,
    load_ids, load_slots, num_loads, rows, host_pages, slot_pages)``: sizes, layer, dim and
    strides, in ``_swap_in_fp8_block``'s order (shared with the fused copy + table launch)."""
    return (values.shape[0], dev.shape[0] * dev.shape[1], dev.shape[1],
            host_pages.shape[0], host_pages.shape[1], slot_pages.shape[1], layer, values.shape[5],
            *values.stride()[:5], *scales.stride()[:3], *dev.stride()[:5], load_ids.stride(0), load_slots.stride(0),
            host_pages.stride(0), slot_pages.stride(0))


def swap_in_fp8_copy_triton(values, scales, dev, layer: int, load_ids, load_slots, num_loads, rows, host_pages,
                            slot_pages, programs_per_row: Optional[int] = None) -> None:
    """Triton launcher: one program per (row, miss) and head, every buffer of the page; or
    ``programs_per_row`` programs per row and head (module docstring)."""
    _check(values, scales, dev, layer, load_ids, load_slots, num_loads, rows, host_pages, slot_pages)
    if programs_per_row is not None and (not isinstance(programs_per_row, int) or programs_per_row < 1):
        raise ValueError(f"programs_per_row={programs_per_row!r} is invalid: None or an int >= 1")
    n, k = load_ids.shape
    _, _, B, ps, H, D = values.shape
    if n == 0 or k == 0:
        return
    g = k if programs_per_row is None else min(k, programs_per_row)
    _swap_in_fp8_kernel[(n * g, H)](
        values, scales, dev, load_ids, load_slots, num_loads, rows, host_pages, slot_pages, k, g,
        *copy_args(values, scales, dev, layer, load_ids, load_slots, host_pages, slot_pages),
        NB=B, PS=ps, BT=triton.next_power_of_2(ps), BD=triton.next_power_of_2(D), LOOP=programs_per_row is not None,
        num_warps=4)


def swap_in_fp8_copy(values, scales, dev, layer: int, load_ids, load_slots, num_loads, rows, host_pages,
                     slot_pages, programs_per_row: Optional[int] = None) -> None:
    """See the module docstring."""
    dispatch("swap_in_fp8_copy", dev, swap_in_fp8_copy_triton, swap_in_fp8_copy_reference)(
        values, scales, dev, layer, load_ids, load_slots, num_loads, rows, host_pages, slot_pages, programs_per_row)
