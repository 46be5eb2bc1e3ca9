"""Rotary position embedding of q or k in place, in one launch (rotate-half convention).

The plain-PyTorch form takes seven kernels per call (casts, a concatenation, products);
the kernel computes in float32 and rounds once to the input's dtype, as its reference does.

Entry points: ``rope_inplace`` (dispatch), ``rope_inplace_triton``,
``rope_inplace_reference`` (``rope_reference`` returns the rotated copy).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from hicache.triton_support import cdiv, dispatch


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
