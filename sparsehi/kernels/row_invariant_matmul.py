"""Batched matrix product whose every output row is bitwise the same however many rows
are computed with it: ``y[b, m, :] = x[b, m, :] @ w[b].T (+ bias)``.

cuBLAS picks its tiles and split-K from the problem's shape, so one token's projection
differs in the last bits between a 21-token and a 31,445-token prefill. Here every launch
uses one tile configuration, exact products (IEEE fp32 dots for fp32 inputs), the reduction over ``K`` runs in one fixed order (block by
block, no split-K) and nothing depends on ``M``: a row's result depends only on its own
inputs. The runtime uses it where a token's KV must not depend on what was prefilled
beside it (``RuntimeConfig.batch_invariant``).

Entry points: ``row_invariant_matmul`` (dispatch), ``row_invariant_matmul_triton``,
``row_invariant_matmul_reference``.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from hicache.triton_support import cdiv, dispatch, exact_dot_precision

BLOCK_M = 32
BLOCK_N = 64
BLOCK_K = 32


def _check(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor]) -> None:
    if x.dim() != 3 or w.dim() != 3 or x.shape[0] != w.shape[0] or x.shape[2] != w.shape[2]:
        raise ValueError(f"x must be [B, M, K] and w [B, N, K] (same B and K), got x={tuple(x.shape)}, "
                         f"w={tuple(w.shape)}")
    if bias is not None and tuple(bias.shape) != (w.shape[1],):
        raise ValueError(f"bias must be [N]={w.shape[1]}, got {tuple(bias.shape)}")
    if x.device != w.device or (bias is not None and bias.device != x.device):
        raise ValueError(f"x, w and bias must share a device, got {x.device}, {w.device}, "
                         f"{None if bias is None else bias.device}")


def row_invariant_matmul_reference(x: torch.Tensor, w: torch.Tensor,
                                   bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x [B, M, K] @ w [B, N, K].T (+ bias [N]) -> [B, M, N]`` in x's dtype (float32
    accumulation). The torch form: equal to the kernel up to rounding, not row-invariant."""
    _check(x, w, bias)
    y = torch.bmm(x.float(), w.float().transpose(1, 2))
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


@triton.jit
def _row_invariant_matmul_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K,
                                 sxb, sxm, sxk, swb, swn, swk, syb, sym, syn,
                                 HAS_BIAS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                                 PRECISION: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    rm = pid_m.to(tl.int64) * BM + tl.arange(0, BM)
    rn = pid_n.to(tl.int64) * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 + rk
        xm = (rm[:, None] < M) & (kk[None, :] < K)
        wm = (rn[None, :] < N) & (kk[:, None] < K)
        a = tl.load(x_ptr + b * sxb + rm[:, None] * sxm + kk[None, :] * sxk, mask=xm, other=0.0)
        wt = tl.load(w_ptr + b * swb + rn[None, :] * swn + kk[:, None] * swk, mask=wm, other=0.0)
        acc += tl.dot(a.to(tl.float32), wt.to(tl.float32), input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    ym = (rm[:, None] < M) & (rn[None, :] < N)
    tl.store(y_ptr + b * syb + rm[:, None] * sym + rn[None, :] * syn, acc.to(y_ptr.dtype.element_ty), mask=ym)


def row_invariant_matmul_triton(x: torch.Tensor, w: torch.Tensor,
                                bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Triton launcher; one tile configuration for every shape (see the module docstring)."""
    _check(x, w, bias)
    B, M, K = x.shape
    N = w.shape[1]
    y = torch.empty((B, M, N), dtype=x.dtype, device=x.device)
    if B and M and N:
        grid = (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N), B)
        _row_invariant_matmul_kernel[grid](
            x, w, bias if bias is not None else x, y, M, N, K, *x.stride(), *w.stride(), *y.stride(),
            HAS_BIAS=bias is not None, BM=BLOCK_M, BN=BLOCK_N, BK=BLOCK_K, PRECISION=exact_dot_precision(x.dtype),
            num_warps=4)
    return y


def row_invariant_matmul(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x [B, M, K] @ w [B, N, K].T (+ bias [N]) -> [B, M, N]``; row-invariant on the
    Triton path (CUDA, or the interpreter when forced)."""
    return dispatch("row_invariant_matmul", x, row_invariant_matmul_triton, row_invariant_matmul_reference)(x, w, bias)


def row_invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``F.linear`` with row-invariant results: ``x [..., K]``, ``weight [N, K]`` -> ``[..., N]``."""
    lead = x.shape[:-1]
    y = row_invariant_matmul(x.reshape(1, -1, x.shape[-1]), weight[None], bias)
    return y.reshape(*lead, weight.shape[0])
