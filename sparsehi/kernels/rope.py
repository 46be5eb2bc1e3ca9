"""Rotary position embedding of q or k in place, in one launch (rotate-half convention).

The plain-PyTorch form takes seven kernels per call (casts, a concatenation, products);
the kernel computes in float32 and rounds once to the input's dtype, as its reference does.

Entry points: ``rope_inplace`` (dispatch), ``rope_inplace_triton``,
``rope_inplace_reference`` (``rope_reference`` returns the rotated copy).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from hicache.triton_support import cdiv, dispatch, per_program


def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [T, H, dim]`` by position (rotate-half convention); cos/sin ``[T, dim]``
    float32 with equal halves. Returns a new tensor in x's dtype."""
    xf = x.float()
    half = xf.shape[-1] // 2
    rot = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
    return (xf * cos[:, None, :] + rot * sin[:, None, :]).to(x.dtype)


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, n_rows, n_heads, stride_xt, stride_xh, stride_ct,
                 HALF: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    # rows are (token, head) pairs, token-major: a program rotates BLOCK_R of them
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    t = rows // n_heads
    heads = rows - t * n_heads
    d = tl.arange(0, BLOCK_D)
    m = (rows < n_rows)[:, None] & (d < HALF)[None, :]
    base = x_ptr + t[:, None] * stride_xt + heads[:, None] * stride_xh + d[None, :]
    x1 = tl.load(base, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF, mask=m, other=0.0).to(tl.float32)
    cs = t[:, None] * stride_ct + d[None, :]
    c = tl.load(cos_ptr + cs, mask=m, other=0.0)
    s = tl.load(sin_ptr + cs, mask=m, other=0.0)
    tl.store(base, (x1 * c - x2 * s).to(x_ptr.dtype.element_ty), mask=m)
    tl.store(base + HALF, (x2 * c + x1 * s).to(x_ptr.dtype.element_ty), mask=m)


ROWS_PER_PROGRAM = 16
"""(token, head) rows one program rotates on a GPU: a decode step's 16 heads of a token, as
when a program took one token's block of heads."""
INTERPRETED_ROWS_PER_PROGRAM = 1024
"""The same under the CPU interpreter, whose cost is mostly per program."""


def _check_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    if x.dim() != 3 or x.shape[-1] % 2:
        raise ValueError(f"x must be [T, H, dim] with an even dim, got {tuple(x.shape)}")
    want = (x.shape[0], x.shape[2])
    if tuple(cos.shape) != want or tuple(sin.shape) != want:
        raise ValueError(f"cos/sin must be [T, dim]={want}, got {tuple(cos.shape)} and {tuple(sin.shape)}")
    if cos.dtype != torch.float32 or sin.dtype != torch.float32:
        raise ValueError(f"cos/sin must be float32, got {cos.dtype} and {sin.dtype}")


def rope_inplace_triton(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                        rows_per_program: Optional[int] = None) -> torch.Tensor:
    """Triton: rotate ``x`` in place (its last dim contiguous; any head / token strides).
    ``rows_per_program``: (token, head) rows a program rotates, a power of two (None:
    ``ROWS_PER_PROGRAM``, or ``INTERPRETED_ROWS_PER_PROGRAM`` under the interpreter)."""
    _check_rope(x, cos, sin)
    if x.stride(2) != 1 or cos.stride(1) != 1 or sin.stride() != cos.stride():
        raise ValueError("x's last dim and cos/sin rows must be contiguous (sin laid out like cos)")
    rows_per_program = per_program("rows_per_program", rows_per_program, ROWS_PER_PROGRAM,
                                   INTERPRETED_ROWS_PER_PROGRAM)
    T, H, dim = x.shape
    if T == 0 or H == 0:
        return x
    half = dim // 2
    block_r = min(rows_per_program, triton.next_power_of_2(T * H))
    _rope_kernel[(cdiv(T * H, block_r),)](
        x, cos, sin, T * H, H, x.stride(0), x.stride(1), cos.stride(0),
        HALF=half, BLOCK_R=block_r, BLOCK_D=triton.next_power_of_2(half), num_warps=4,
    )
    return x


def rope_inplace_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Torch reference of :func:`rope_inplace_triton`: ``x`` rotated in place, returned."""
    _check_rope(x, cos, sin)
    return x.copy_(rope_reference(x, cos, sin))


def rope_inplace(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [T, H, dim]`` in place by cos/sin ``[T, dim]`` float32; returns ``x``."""
    return dispatch("rope", x, rope_inplace_triton, rope_inplace_reference)(x, cos, sin)
