"""A decoder's residual add and RMSNorm in one launch: ``h = residual + delta`` (rounded to
the residual's dtype, as the residual stream is) and ``RMSNorm(h) * weight`` (float32
inside).

Entry points: ``add_rms_norm`` (dispatch), ``add_rms_norm_triton``, ``add_rms_norm_reference``.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from hicache.triton_support import cdiv, dispatch, per_program


def add_rms_norm_reference(residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``h = residual + delta`` (in their dtype) and RMSNorm(h) * weight (float32 inside):
    returns ``(h, normed)`` ``[T, hidden]``."""
    h = residual + delta
    hf = h.float()
    normed = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return h, normed.to(h.dtype)


@triton.jit
def _add_rms_norm_kernel(r_ptr, d_ptr, w_ptr, h_out, n_out, T, N, eps, stride_r, stride_d, stride_h, stride_n,
                         BLOCK_T: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)[:, None]
    cols = tl.arange(0, BLOCK)[None, :]
    m = (t < T) & (cols < N)
    r = tl.load(r_ptr + t * stride_r + cols, mask=m, other=0.0)
    d = tl.load(d_ptr + t * stride_d + cols, mask=m, other=0.0)
    h = (r.to(tl.float32) + d.to(tl.float32)).to(h_out.dtype.element_ty)  # rounded as the residual stream is
    tl.store(h_out + t * stride_h + cols, h, mask=m)
    hf = h.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(hf * hf, axis=1) / N + eps)
    w = tl.load(w_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
    tl.store(n_out + t * stride_n + cols, (hf * rstd[:, None] * w).to(n_out.dtype.element_ty), mask=m)


INTERPRETED_TOKENS_PER_PROGRAM = 64
"""Tokens one program takes under the CPU interpreter, whose cost is mostly per program (on a
GPU a program takes one token)."""


def add_rms_norm_triton(residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                        eps: float, tokens_per_program: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton launcher; same result as the reference. ``tokens_per_program``: a power of two
    (None: 1 on a GPU, ``INTERPRETED_TOKENS_PER_PROGRAM`` under the interpreter)."""
    if residual.dim() != 2 or delta.shape != residual.shape or weight.shape != residual.shape[1:]:
        raise ValueError(f"residual and delta must be [T, hidden] and weight [hidden], got {tuple(residual.shape)}, "
                         f"{tuple(delta.shape)}, {tuple(weight.shape)}")
    if residual.stride(1) != 1 or delta.stride(1) != 1:
        raise ValueError("residual and delta must have a contiguous last dim")
    tokens_per_program = per_program("tokens_per_program", tokens_per_program, 1, INTERPRETED_TOKENS_PER_PROGRAM)
    T, N = residual.shape
    h = torch.empty_like(residual)
    out = torch.empty_like(residual)
    if T:
        block_t = min(tokens_per_program, triton.next_power_of_2(T))
        _add_rms_norm_kernel[(cdiv(T, block_t),)](
            residual, delta, weight, h, out, T, N, float(eps), residual.stride(0), delta.stride(0),
            h.stride(0), out.stride(0), BLOCK_T=block_t, BLOCK=triton.next_power_of_2(N),
            num_warps=8 if N >= 4096 else 4)
    return h, out


def add_rms_norm(residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One launch for a decoder's ``h = residual + delta; x = RMSNorm(h)``; returns (h, x)."""
    return dispatch("add_rms_norm", residual, add_rms_norm_triton, add_rms_norm_reference)(residual, delta, weight, eps)
