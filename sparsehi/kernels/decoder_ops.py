"""Two element-wise steps of a decoder layer fused into one launch each: rotary position
embedding of q and k (in place), and the SwiGLU gate ``silu(gate) * up``.

At batch 1 a decode step is a few hundred small launches; the plain-PyTorch forms of these
two take seven and two kernels (casts, a concatenation, products) per call. Both compute
in float32 and round once to the input's dtype, as their torch references do.

Entry points: ``rope_inplace`` / ``silu_mul`` (dispatch), ``*_triton``, ``*_reference``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from hicache.triton_support import cdiv, dispatch


# ----------------------------------------------------------------------------- RoPE
def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [T, H, dim]`` by position (rotate-half convention); cos/sin ``[T, dim]``
    float32 with equal halves. Returns a new tensor in x's dtype."""
    xf = x.float()
    half = xf.shape[-1] // 2
    rot = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
    return (xf * cos[:, None, :] + rot * sin[:, None, :]).to(x.dtype)


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, n_heads, stride_xt, stride_xh, stride_ct,
                 HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    m = (heads < n_heads)[:, None] & (d < HALF)[None, :]
    base = x_ptr + t * stride_xt + heads[:, None].to(tl.int64) * stride_xh + d[None, :]
    x1 = tl.load(base, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF, mask=m, other=0.0).to(tl.float32)
    dm = d < HALF
    c = tl.load(cos_ptr + t * stride_ct + d, mask=dm, other=0.0)[None, :]
    s = tl.load(sin_ptr + t * stride_ct + d, mask=dm, other=0.0)[None, :]
    tl.store(base, (x1 * c - x2 * s).to(x_ptr.dtype.element_ty), mask=m)
    tl.store(base + HALF, (x2 * c + x1 * s).to(x_ptr.dtype.element_ty), mask=m)


def _check_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    if x.dim() != 3 or x.shape[-1] % 2:
        raise ValueError(f"x must be [T, H, dim] with an even dim, got {tuple(x.shape)}")
    want = (x.shape[0], x.shape[2])
    if tuple(cos.shape) != want or tuple(sin.shape) != want:
        raise ValueError(f"cos/sin must be [T, dim]={want}, got {tuple(cos.shape)} and {tuple(sin.shape)}")
    if cos.dtype != torch.float32 or sin.dtype != torch.float32:
        raise ValueError(f"cos/sin must be float32, got {cos.dtype} and {sin.dtype}")


def rope_inplace_triton(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Triton: rotate ``x`` in place (its last dim contiguous; any head / token strides)."""
    _check_rope(x, cos, sin)
    if x.stride(2) != 1 or cos.stride(1) != 1 or sin.stride() != cos.stride():
        raise ValueError("x's last dim and cos/sin rows must be contiguous (sin laid out like cos)")
    T, H, dim = x.shape
    if T == 0 or H == 0:
        return x
    half = dim // 2
    block_h = min(16, triton.next_power_of_2(H))
    _rope_kernel[(T, cdiv(H, block_h))](
        x, cos, sin, H, x.stride(0), x.stride(1), cos.stride(0),
        HALF=half, BLOCK_H=block_h, BLOCK_D=triton.next_power_of_2(half), num_warps=4,
    )
    return x


def rope_inplace_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Torch reference of :func:`rope_inplace_triton`: ``x`` rotated in place, returned."""
    _check_rope(x, cos, sin)
    return x.copy_(rope_reference(x, cos, sin))


def rope_inplace(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [T, H, dim]`` in place by cos/sin ``[T, dim]`` float32; returns ``x``."""
    return dispatch("rope", x, rope_inplace_triton, rope_inplace_reference)(x, cos, sin)


# ----------------------------------------------------------------------------- SwiGLU
def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """``gate_up [T, 2I]`` (gate then up) -> ``silu(gate) * up`` ``[T, I]`` in its dtype."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"gate_up must be [T, 2I], got {tuple(gate_up.shape)}")
    g, u = gate_up.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(g) * u).to(gate_up.dtype)


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, inter, stride_xt, stride_ot, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < inter
    g = tl.load(x_ptr + t * stride_xt + cols, mask=m, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + t * stride_xt + inter + cols, mask=m, other=0.0).to(tl.float32)
    y = g / (1.0 + tl.exp(-g)) * u
    tl.store(out_ptr + t * stride_ot + cols, y.to(out_ptr.dtype.element_ty), mask=m)


def silu_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 or gate_up.stride(1) != 1:
        raise ValueError(f"gate_up must be [T, 2I] with a contiguous last dim, got {tuple(gate_up.shape)}")
    T, two_i = gate_up.shape
    inter = two_i // 2
    out = torch.empty(T, inter, dtype=gate_up.dtype, device=gate_up.device)
    if T == 0:
        return out
    block = 1024
    _silu_mul_kernel[(T, cdiv(inter, block))](gate_up, out, inter, gate_up.stride(0), out.stride(0),
                                                      BLOCK=block, num_warps=4)
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``gate_up [T, 2I]`` (the gate and up projections side by side)."""
    return dispatch("silu_mul", gate_up, silu_mul_triton, silu_mul_reference)(gate_up)


# ----------------------------------------------------------------------------- residual + RMSNorm
def add_rms_norm_reference(residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``h = residual + delta`` (in their dtype) and RMSNorm(h) * weight (float32 inside):
    returns ``(h, normed)`` ``[T, hidden]``."""
    h = residual + delta
    hf = h.float()
    normed = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return h, normed.to(h.dtype)


@triton.jit
def _add_rms_norm_kernel(r_ptr, d_ptr, w_ptr, h_out, n_out, N, eps, stride_r, stride_d, stride_h, stride_n,
                         BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    m = cols < N
    r = tl.load(r_ptr + t * stride_r + cols, mask=m, other=0.0)
    d = tl.load(d_ptr + t * stride_d + cols, mask=m, other=0.0)
    h = (r.to(tl.float32) + d.to(tl.float32)).to(h_out.dtype.element_ty)  # rounded as the residual stream is
    tl.store(h_out + t * stride_h + cols, h, mask=m)
    hf = h.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(hf * hf, axis=0) / N + eps)
    w = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
    tl.store(n_out + t * stride_n + cols, (hf * rstd * w).to(n_out.dtype.element_ty), mask=m)


def add_rms_norm_triton(residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                        eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    if residual.dim() != 2 or delta.shape != residual.shape or weight.shape != residual.shape[1:]:
        raise ValueError(f"residual and delta must be [T, hidden] and weight [hidden], got {tuple(residual.shape)}, "
                         f"{tuple(delta.shape)}, {tuple(weight.shape)}")
    if residual.stride(1) != 1 or delta.stride(1) != 1:
        raise ValueError("residual and delta must have a contiguous last dim")
    T, N = residual.shape
    h = torch.empty_like(residual)
    out = torch.empty_like(residual)
    if T:
        _add_rms_norm_kernel[(T,)](residual, delta, weight, h, out, N, float(eps), residual.stride(0), delta.stride(0),
                                   h.stride(0), out.stride(0), BLOCK=triton.next_power_of_2(N),
                                   num_warps=8 if N >= 4096 else 4)
    return h, out


def add_rms_norm(residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One launch for a decoder's ``h = residual + delta; x = RMSNorm(h)``; returns (h, x)."""
    return dispatch("add_rms_norm", residual, add_rms_norm_triton, add_rms_norm_reference)(residual, delta, weight, eps)


# ----------------------------------------------------------------------------- KV store
def store_kv_reference(caches: tuple[torch.Tensor, ...], loc: torch.Tensor, values: tuple[torch.Tensor, ...]) -> None:
    """``caches[i][loc[t]] = values[i][t]`` (each ``[slots, H, D]`` / ``[T, H, D]``), cast to
    the cache dtype; entries of ``loc`` that are negative are skipped."""
    keep = loc >= 0
    for cache, val in zip(caches, values):
        if bool(keep.all()):
            cache.index_copy_(0, loc, val.to(cache.dtype))
        else:
            cache.index_copy_(0, loc[keep], val[keep].to(cache.dtype))


@triton.jit
def _store_kv_kernel(c0, c1, v0, v1, loc_ptr, n_slots, stride_c0, stride_c1, stride_v0t, stride_v0h, stride_v1t,
                     stride_v1h, H: tl.constexpr, D0: tl.constexpr, D1: tl.constexpr, BLOCK_H: tl.constexpr,
                     BLOCK_D: tl.constexpr, TWO: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(loc_ptr + t).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    sb = tl.zeros([BLOCK_H, BLOCK_D], tl.int64) + slot  # the scalar broadcast to the tile (masks must be tiles)
    ok = (sb >= 0) & (sb < n_slots)
    m0 = ((h < H)[:, None] & (d < D0)[None, :]) & ok
    x = tl.load(v0 + t * stride_v0t + h[:, None] * stride_v0h + d[None, :], mask=m0)
    tl.store(c0 + slot * stride_c0 + h[:, None] * D0 + d[None, :], x.to(c0.dtype.element_ty), mask=m0)
    if TWO:
        m1 = ((h < H)[:, None] & (d < D1)[None, :]) & ok
        y = tl.load(v1 + t * stride_v1t + h[:, None] * stride_v1h + d[None, :], mask=m1)
        tl.store(c1 + slot * stride_c1 + h[:, None] * D1 + d[None, :], y.to(c1.dtype.element_ty), mask=m1)


def store_kv_triton(caches: tuple[torch.Tensor, ...], loc: torch.Tensor, values: tuple[torch.Tensor, ...]) -> None:
    if len(caches) not in (1, 2) or len(values) != len(caches):
        raise ValueError(f"store_kv takes one or two caches with as many values, got {len(caches)} and {len(values)}")
    T = loc.shape[0]
    for c, v in zip(caches, values):
        if c.dim() != 3 or v.shape != (T, *c.shape[1:]) or c.stride(2) != 1 or c.stride(1) != c.shape[2]:
            raise ValueError(f"cache [slots, H, D] (rows contiguous) and values [T={T}, H, D] must match, got "
                             f"{tuple(c.shape)} and {tuple(v.shape)}")
        if v.stride(2) != 1:
            raise ValueError("values must have a contiguous last dim")
    if T == 0:
        return
    two = len(caches) == 2
    c0, v0 = caches[0], values[0]
    c1, v1 = (caches[1], values[1]) if two else (c0, v0)
    H = c0.shape[1]
    _store_kv_kernel[(T,)](c0, c1, v0, v1, loc, c0.shape[0], c0.stride(0), c1.stride(0), v0.stride(0), v0.stride(1),
                           v1.stride(0), v1.stride(1), H=H, D0=c0.shape[2], D1=c1.shape[2],
                           BLOCK_H=triton.next_power_of_2(H), BLOCK_D=triton.next_power_of_2(max(c0.shape[2], c1.shape[2])),
                           TWO=two, num_warps=4)


def store_kv(caches: tuple[torch.Tensor, ...], loc: torch.Tensor, values: tuple[torch.Tensor, ...]) -> None:
    """Write one new token per row into the KV cache(s) in one launch: ``caches`` (k, v) or
    (kv,) ``[slots, H, D]``, ``loc [T] int64`` slots (negative: skipped), ``values`` ``[T, H, D]``."""
    dispatch("store_kv", loc, store_kv_triton, store_kv_reference)(caches, loc, values)
