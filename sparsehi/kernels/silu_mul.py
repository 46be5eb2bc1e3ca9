"""The SwiGLU gate ``silu(gate) * up`` in one launch (the plain-PyTorch form takes two),
computed in float32 and rounded once to the input's dtype, as its reference does.

Entry points: ``silu_mul`` (dispatch), ``silu_mul_triton``, ``silu_mul_reference``.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from hicache.triton_support import cdiv, dispatch, per_program


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """``gate_up [T, 2I]`` (gate then up) -> ``silu(gate) * up`` ``[T, I]`` in its dtype."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"gate_up must be [T, 2I], got {tuple(gate_up.shape)}")
    g, u = gate_up.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(g) * u).to(gate_up.dtype)


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, T, inter, stride_xt, stride_ot, BLOCK_T: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)[:, None]
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)[None, :]
    m = (t < T) & (cols < inter)
    g = tl.load(x_ptr + t * stride_xt + cols, mask=m, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + t * stride_xt + inter + cols, mask=m, other=0.0).to(tl.float32)
    y = g / (1.0 + tl.exp(-g)) * u
    tl.store(out_ptr + t * stride_ot + cols, y.to(out_ptr.dtype.element_ty), mask=m)


INTERPRETED_TOKENS_PER_PROGRAM = 64
"""Tokens one program takes under the CPU interpreter, whose cost is mostly per program (on a
GPU a program takes one token's 1024 columns)."""


def silu_mul_triton(gate_up: torch.Tensor, tokens_per_program: Optional[int] = None) -> torch.Tensor:
    """Triton launcher (a program per ``tokens_per_program`` tokens and 1024 columns; None: 1
    on a GPU, ``INTERPRETED_TOKENS_PER_PROGRAM`` under the interpreter, a power of two); same
    result as the reference."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 or gate_up.stride(1) != 1:
        raise ValueError(f"gate_up must be [T, 2I] with a contiguous last dim, got {tuple(gate_up.shape)}")
    tokens_per_program = per_program("tokens_per_program", tokens_per_program, 1, INTERPRETED_TOKENS_PER_PROGRAM)
    T, two_i = gate_up.shape
    inter = two_i // 2
    out = torch.empty(T, inter, dtype=gate_up.dtype, device=gate_up.device)
    if T == 0:
        return out
    block = 1024
    block_t = min(tokens_per_program, triton.next_power_of_2(T))
    _silu_mul_kernel[(cdiv(T, block_t), cdiv(inter, block))](gate_up, out, T, inter, gate_up.stride(0), out.stride(0),
                                                             BLOCK_T=block_t, BLOCK=block, num_warps=4)
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``gate_up [T, 2I]`` (the gate and up projections side by side)."""
    return dispatch("silu_mul", gate_up, silu_mul_triton, silu_mul_reference)(gate_up)
