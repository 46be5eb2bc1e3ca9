"""Device -> host backup of whole KV pages into an FP8 host pool, quantised on the way, and
(optionally) the device rows rounded in place to what the host now holds.

For each page ``i`` with ``host_pages[i] >= 0`` (in range) and a device page ``dev_pages[i] >=
0`` whose token slots ``dev_pages[i] * page_size + t`` all lie in ``dev``: for every layer of
``[layer_start, layer_start + layer_count)``, buffer and head, the page's ``page_size x dim``
block is read from those device rows, quantised with ``fp8_page_quantize``'s rule (one power-of-two scale)
and written to ``values[host_pages[i], layer, buf]`` / ``scales[host_pages[i], layer, buf,
head]``. With ``round_device`` the device rows then hold ``q * scale`` (exact in bfloat16 and
float32): every later read of the page, from either tier, sees the same values.

``round_device`` with ``host_pages`` of ``-2`` rounds the device rows and writes nothing to
the host (a run that keeps its KV on the GPU, rounded as FP8 host pages would make it).

``dev`` is the 6-D device view ``[pages, view_page_size, layers, buffers, heads, dim]`` (token
slot ``s`` is ``(s // view_page_size, s % view_page_size)``: the pool may page its slots
otherwise), ``dev_pages [P]`` and ``host_pages [P]`` int64/int32 page ids of ``page_size``
tokens, ``values``/``scales``
``HostKVPool.fp8_values`` / ``fp8_scales`` (pinned; written in place on CUDA). No host sync:
CUDA-graph safe (which pages are stored is data, not shape).

Entry points: ``fp8_page_store`` (dispatch), ``fp8_page_store_triton``,
``fp8_page_store_reference``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from hicache.kernels.fp8_page_quantize import (e4m3_bits, page_scale, power_of_two_exponent_reference,
                                               power_of_two_reference)
from hicache.triton_support import dispatch

ROUND_ONLY = -2
"""A ``host_pages`` entry that rounds the page's device rows without a host copy."""


def _check(dev, dev_pages, values, scales, host_pages, layer_start: int, layer_count: int) -> None:
    if not isinstance(dev, torch.Tensor) or dev.dim() != 6 or dev.stride(-1) != 1 \
            or dev.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError("dev must be a 6-D float32/bfloat16/float16 view [pages, page_size, layers, buffers, heads, "
                         "dim] with a contiguous last dim")
    if not isinstance(values, torch.Tensor) or values.dim() != 6 or values.dtype != torch.uint8 \
            or values.stride(-1) != 1:
        raise ValueError("values must be uint8 [pages, layers, buffers, page_size, heads, dim] (E4M3 bits)")
    P, L, B, ps, H, D = values.shape
    if tuple(dev.shape[2:]) != (L, B, H, D):
        raise ValueError(f"dev's [layers, buffers, heads, dim] must be {(L, B, H, D)}, got {tuple(dev.shape[2:])}")
    if not isinstance(scales, torch.Tensor) or tuple(scales.shape) != (P, L, B, H) or scales.dtype != torch.float32:
        raise ValueError(f"scales must be float32 [pages, layers, buffers, heads]={(P, L, B, H)}")
    if not isinstance(host_pages, torch.Tensor) or host_pages.dim() != 1 \
            or host_pages.dtype not in (torch.int32, torch.int64):
        raise ValueError("host_pages must be a 1-D int32/int64 tensor")
    if not isinstance(dev_pages, torch.Tensor) or tuple(dev_pages.shape) != (host_pages.numel(),) \
            or dev_pages.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"dev_pages must be int32/int64 [len(host_pages)]={(host_pages.numel(),)}, got "
                         f"{tuple(dev_pages.shape) if isinstance(dev_pages, torch.Tensor) else dev_pages}")
    if not (isinstance(layer_start, int) and isinstance(layer_count, int) and layer_count >= 0
            and 0 <= layer_start and layer_start + layer_count <= L):
        raise ValueError(f"layers [{layer_start}, {layer_start} + {layer_count}) must lie in [0, {L})")


def fp8_page_store_reference(dev: torch.Tensor, dev_pages: torch.Tensor, values: torch.Tensor, scales: torch.Tensor,
                             host_pages: torch.Tensor, layer_start: int, layer_count: int,
                             round_device: bool = False) -> None:
    """Plain-torch ``fp8_page_store`` (same arguments and result; reads indices on the host)."""
    _check(dev, dev_pages, values, scales, host_pages, layer_start, layer_count)
    n_host, ps = values.shape[0], values.shape[3]
    n_dev = dev.shape[0] * dev.shape[1]
    hp = host_pages.cpu().long()
    dp = dev_pages.cpu().long()
    store = ((hp >= 0) & (hp < n_host)) | ((hp == ROUND_ONLY) & round_device)
    store &= (dp >= 0) & ((dp + 1) * ps <= n_dev)
    if not bool(store.any()):
        return
    hp = hp[store]
    ds = (dp[store][:, None] * ps + torch.arange(ps)[None, :]).to(dev.device)  # [P, page_size] token slots
    layers = slice(layer_start, layer_start + layer_count)
    rows = dev[ds // dev.shape[1], ds % dev.shape[1], layers].float()  # [P, T, layers, buffers, H, D]
    k = power_of_two_exponent_reference(rows.abs().amax(dim=(1, 5)))  # [P, layers, buffers, H]
    scale, inverse = power_of_two_reference(k), power_of_two_reference(-k)
    q = (rows * inverse[:, None, ..., None]).to(torch.float8_e4m3fn)
    to_host = hp >= 0
    if bool(to_host.any()):
        h = hp[to_host]
        dv = values.device
        values[h.to(dv), layers] = q[to_host.to(q.device)].view(torch.uint8).permute(0, 2, 3, 1, 4, 5).to(dv)
        scales[h.to(dv), layers] = scale[to_host.to(scale.device)].to(dv)
    if round_device:
        dev[ds // dev.shape[1], ds % dev.shape[1], layers] = (q.float() * scale[:, None, ..., None]).to(dev.dtype)


@triton.jit
def _fp8_page_store_kernel(d_ptr, dp_ptr, v_ptr, s_ptr, hp_ptr, n_host, n_dev, ps, ps_dev, layer_start, NB,
                           sdp, sdt, sdl, sdb, sdh, svp, svl, svb, svt, svh, ssp, ssl, ssb, D,
                           ROUND: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    lb = tl.program_id(1)
    head = tl.program_id(2).to(tl.int64)
    layer = (layer_start + lb // NB).to(tl.int64)
    b = (lb % NB).to(tl.int64)
    hp = tl.load(hp_ptr + i).to(tl.int64)
    t = tl.arange(0, BT)
    dd = tl.arange(0, BD)
    t_ok = t < ps
    page = tl.load(dp_ptr + i).to(tl.int64)
    slots = page * ps + t  # the page's token slots
    go = ((hp >= 0) & (hp < n_host)) | ((hp == -2) & ROUND)
    if go & (page >= 0) & ((page + 1) * ps <= n_dev):
        m = t_ok[:, None] & (dd[None, :] < D)
        addr = (d_ptr + (slots // ps_dev)[:, None] * sdp + (slots % ps_dev)[:, None] * sdt + layer * sdl + b * sdb
                + head * sdh + dd[None, :])
        x = tl.load(addr, mask=m, other=0.0).to(tl.float32)
        scale, inverse = page_scale(tl.max(tl.max(tl.abs(x), axis=1), axis=0))
        q = e4m3_bits(x * inverse)
        if hp >= 0:
            tl.store(v_ptr + hp * svp + layer * svl + b * svb + t[:, None] * svt + head * svh + dd[None, :],
                     q.to(tl.uint8), mask=m)
            tl.store(s_ptr + hp * ssp + layer * ssl + b * ssb + head, scale)
        if ROUND:
            y = q.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32) * scale
            tl.store(addr, y.to(d_ptr.dtype.element_ty), mask=m)


def fp8_page_store_triton(dev: torch.Tensor, dev_pages: torch.Tensor, values: torch.Tensor, scales: torch.Tensor,
                          host_pages: torch.Tensor, layer_start: int, layer_count: int,
                          round_device: bool = False) -> None:
    """Triton launcher: one program per page, layer and buffer, and head."""
    _check(dev, dev_pages, values, scales, host_pages, layer_start, layer_count)
    n = host_pages.numel()
    _, _, B, ps, H, D = values.shape
    if n == 0 or layer_count == 0:
        return
    _fp8_page_store_kernel[(n, layer_count * B, H)](
        dev, dev_pages, values, scales, host_pages, values.shape[0], dev.shape[0] * dev.shape[1], ps, dev.shape[1],
        layer_start, B, *dev.stride()[:5], *values.stride()[:5], *scales.stride()[:3], D,
        ROUND=bool(round_device), BT=triton.next_power_of_2(ps), BD=triton.next_power_of_2(D), num_warps=4)


def fp8_page_store(dev: torch.Tensor, dev_pages: torch.Tensor, values: torch.Tensor, scales: torch.Tensor,
                   host_pages: torch.Tensor, layer_start: int, layer_count: int, round_device: bool = False) -> None:
    """See the module docstring."""
    dispatch("fp8_page_store", dev, fp8_page_store_triton, fp8_page_store_reference)(
        dev, dev_pages, values, scales, host_pages, layer_start, layer_count, round_device)
