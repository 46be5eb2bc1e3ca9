"""The new token of each row into the KV cache(s), one launch for k and v (or the MLA
latent); negative slots are skipped.

Entry points: ``store_kv`` (dispatch), ``store_kv_triton``, ``store_kv_reference``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from hicache.triton_support import dispatch


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
    """Triton launcher (one program per token); same effect as the reference."""
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
