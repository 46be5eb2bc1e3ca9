"""Host -> device copy of KV rows out of an FP8 host pool, dequantised on the way:

    dev[d // ps_dev, d % ps_dev, layer, buf] = values[h // ps, layer, buf, h % ps] * scales[h // ps, layer, buf]

for every pair ``(h, d) = (host_slots[i], dev_slots[i])`` and every layer of
``[layer_start, layer_start + layer_count)`` and buffer (k and v, or MLA's latent). The
scales are powers of two, so each value is exact in the device pool's dtype (bfloat16,
float32) whatever computes it.

``values [pages, layers, buffers, page_size, heads, dim]`` uint8 (E4M3 bits) and ``scales
[pages, layers, buffers, heads]`` float32 are ``HostKVPool.fp8_values`` / ``fp8_scales``
(pinned; the GPU reads them in place). ``dev`` is the 6-D device view ``[pages, page_size,
layers, buffers, heads, dim]`` (``DeviceKVPool.paged_view``). Pairs with a ``-1`` or
out-of-range slot on either side are skipped. No host sync: CUDA-graph safe.

Entry points: ``fp8_token_load`` (dispatch), ``fp8_token_load_triton``,
``fp8_token_load_reference``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from hicache.triton_support import dispatch


def _check(values, scales, dev, host_slots, dev_slots, layer_start: int, layer_count: int) -> None:
    if not isinstance(values, torch.Tensor) or values.dim() != 6 or values.dtype != torch.uint8:
        raise ValueError("values must be uint8 [pages, layers, buffers, page_size, heads, dim] (E4M3 bits)")
    P, L, B, _, H, D = values.shape
    if not isinstance(scales, torch.Tensor) or tuple(scales.shape) != (P, L, B, H) or scales.dtype != torch.float32:
        raise ValueError(f"scales must be float32 [pages, layers, buffers, heads]={(P, L, B, H)}, got "
                         f"{(tuple(scales.shape), scales.dtype) if isinstance(scales, torch.Tensor) else scales}")
    if not isinstance(dev, torch.Tensor) or dev.dim() != 6 or tuple(dev.shape[2:]) != (L, B, H, D):
        raise ValueError(f"dev must be a 6-D view [pages, page_size, layers, buffers, heads, dim] with "
                         f"[layers, buffers, heads, dim]={(L, B, H, D)}, got "
                         f"{tuple(dev.shape) if isinstance(dev, torch.Tensor) else type(dev).__name__}")
    if dev.dtype not in (torch.float32, torch.bfloat16, torch.float16) or dev.stride(-1) != 1 \
            or values.stride(-1) != 1:
        raise ValueError(f"dev must be float32/bfloat16/float16 with a contiguous last dim (values too), got "
                         f"{dev.dtype}, strides {dev.stride()} and {values.stride()}")
    for name, t in (("host_slots", host_slots), ("dev_slots", dev_slots)):
        if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be a 1-D int32/int64 tensor")
    if host_slots.numel() != dev_slots.numel():
        raise ValueError(f"host_slots and dev_slots must pair up, got {host_slots.numel()} and {dev_slots.numel()}")
    if not (isinstance(layer_start, int) and isinstance(layer_count, int) and layer_count >= 0
            and 0 <= layer_start and layer_start + layer_count <= L):
        raise ValueError(f"layers [{layer_start}, {layer_start} + {layer_count}) must lie in [0, {L})")


def fp8_token_load_reference(values: torch.Tensor, scales: torch.Tensor, dev: torch.Tensor, host_slots: torch.Tensor,
                             dev_slots: torch.Tensor, layer_start: int, layer_count: int) -> None:
    """Plain-torch ``fp8_token_load`` (same arguments and result; reads the slots on the host)."""
    _check(values, scales, dev, host_slots, dev_slots, layer_start, layer_count)
    ps, ps_dev = values.shape[3], dev.shape[1]
    h = host_slots.to(device=values.device, dtype=torch.int64)
    d = dev_slots.to(device=dev.device, dtype=torch.int64)
    keep = (h >= 0) & (h < values.shape[0] * ps) & (d.to(h.device) >= 0) & (d.to(h.device) < dev.shape[0] * ps_dev)
    h, d = h[keep], d[keep.to(d.device)]
    layers = slice(layer_start, layer_start + layer_count)
    q = values[h // ps, layers, :, h % ps]  # [N, layers, buffers, heads, dim]
    s = scales[h // ps, layers]  # [N, layers, buffers, heads]
    rows = q.view(torch.float8_e4m3fn).float() * s[..., None]
    dev[d // ps_dev, d % ps_dev, layers] = rows.to(device=dev.device, dtype=dev.dtype)


@triton.jit
def _fp8_token_load_kernel(v_ptr, s_ptr, d_ptr, hs_ptr, ds_ptr, host_slots_total, dev_slots_total, ps, ps_dev,
                           layer_start, svp, svl, svb, svt, svh, ssp, ssl, ssb, sdp, sdt, sdl, sdb, sdh,
                           H, D, NB: tl.constexpr, BH: tl.constexpr, BD: tl.constexpr):
    i = tl.program_id(0)
    layer = (layer_start + tl.program_id(1)).to(tl.int64)
    h = tl.load(hs_ptr + i).to(tl.int64)
    d = tl.load(ds_ptr + i).to(tl.int64)
    if (h >= 0) & (h < host_slots_total) & (d >= 0) & (d < dev_slots_total):
        hp = h // ps
        ht = h % ps
        dp = d // ps_dev
        dt = d % ps_dev
        hh = tl.arange(0, BH)
        dd = tl.arange(0, BD)
        m = (hh[:, None] < H) & (dd[None, :] < D)
        for b in tl.static_range(NB):
            raw = tl.load(v_ptr + hp * svp + layer * svl + b * svb + ht * svt + hh[:, None] * svh + dd[None, :],
                          mask=m, other=0)
            scale = tl.load(s_ptr + hp * ssp + layer * ssl + b * ssb + hh, mask=hh < H, other=1.0)
            x = raw.to(tl.float8e4nv, bitcast=True).to(tl.float32) * scale[:, None]
            tl.store(d_ptr + dp * sdp + dt * sdt + layer * sdl + b * sdb + hh[:, None] * sdh + dd[None, :],
                     x.to(d_ptr.dtype.element_ty), mask=m)


def fp8_token_load_triton(values: torch.Tensor, scales: torch.Tensor, dev: torch.Tensor, host_slots: torch.Tensor,
                          dev_slots: torch.Tensor, layer_start: int, layer_count: int) -> None:
    """Triton launcher: one program per pair and layer (all buffers and heads of the row)."""
    _check(values, scales, dev, host_slots, dev_slots, layer_start, layer_count)
    n = host_slots.numel()
    if n == 0 or layer_count == 0:
        return
    _, _, B, ps, H, D = values.shape
    _fp8_token_load_kernel[(n, layer_count)](
        values, scales, dev, host_slots, dev_slots, values.shape[0] * ps, dev.shape[0] * dev.shape[1], ps,
        dev.shape[1], layer_start, *values.stride()[:5], *scales.stride()[:3], *dev.stride()[:5], H, D, NB=B,
        BH=triton.next_power_of_2(H), BD=triton.next_power_of_2(D), num_warps=4)


def fp8_token_load(values: torch.Tensor, scales: torch.Tensor, dev: torch.Tensor, host_slots: torch.Tensor,
                   dev_slots: torch.Tensor, layer_start: int, layer_count: int) -> None:
    """See the module docstring."""
    dispatch("fp8_token_load", dev, fp8_token_load_triton, fp8_token_load_reference)(
        values, scales, dev, host_slots, dev_slots, layer_start, layer_count)
