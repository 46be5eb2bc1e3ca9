"""Split-K flash decoding, the parts the decode attention kernels share (paged / ragged
GQA decode, sparse MLA decode).

A decode program attends to one range of a row's tokens; with ``splits > 1`` ranges per
row, each program writes its fp32 partial output and log-sum-exp (``store_split_result``)
and a second launch merges them (``merge_splits``). Split counts come from static shapes
(no host sync; graph-capturable): ``split_tokens`` cuts the tokens into whole tiles.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from hicache.triton_support import cdiv, interpreter_enabled

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_SPLITS = 64
# SMs a split-K launch fills off CUDA: under the interpreter small batches still split
INTERPRETER_SMS = 4


def fail(name: str, allowed: str, got: object) -> None:
    """Raise the ValueError of a bad decode input: ``name`` must be ``allowed``, got ``got``."""
    raise ValueError(f"{name} must be {allowed}; got {got}")


def dot_in_fp32(t: torch.Tensor) -> bool:
    """Run ``tl.dot`` on fp32 operands? Only under the CPU interpreter, whose bf16 dot
    returns garbage (Triton 3.9); on GPU the dots take the native 16-bit operands."""
    return (not t.is_cuda) and interpreter_enabled()


def split_tokens(tokens: int, splits: int, block_n: int) -> tuple[int, int]:
    """``(splits, tokens per split)`` for ``tokens`` attended per row: ``splits`` clamped to
    ``[1, MAX_SPLITS]``, each split a whole number of ``block_n`` tiles, no empty split."""
    splits = max(1, min(int(splits), MAX_SPLITS))
    tps = cdiv(max(1, tokens), splits)
    tps = cdiv(tps, block_n) * block_n
    return max(1, cdiv(max(1, tokens), tps)), tps


def split_buffers(out: torch.Tensor, splits: int) -> tuple[torch.Tensor, torch.Tensor, tuple[int, ...]]:
    """``(part [B, H, splits, Dv] float32, lse [B, H, splits] float32, their strides)`` for
    ``out [B, H, Dv]``; with one split no buffers (``out`` stands in, never written) and zero
    strides."""
    if splits == 1:
        return out, out, (0, 0, 0, 0, 0)
    B, H, Dv = out.shape
    part = torch.empty((B, H, splits, Dv), dtype=torch.float32, device=out.device)
    lse = torch.empty((B, H, splits), dtype=torch.float32, device=out.device)
    return part, lse, (part.stride(0), part.stride(1), part.stride(2), lse.stride(0), lse.stride(1))


@triton.jit
def store_split_result(acc, l_i, m_log2, Out, OutPartial, LsePartial, b, split, offs_h, offs_d, h_mask, d_mask, lse_mask,
                       stride_ob, stride_oh, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
                       SPLIT: tl.constexpr):
    """Epilogue of a flash-decoding program: ``acc / l`` (``[H, D]``; rows with ``l = 0``
    give zeros) into ``Out``, or with ``SPLIT`` the fp32 partial into ``OutPartial`` and
    its natural-log LSE (from the base-2 running max ``m_log2``; -inf marks an empty
    split) into ``LsePartial`` where ``lse_mask``, for :func:`merge_splits`."""
    has = l_i > 0
    l_safe = tl.where(has, l_i, 1.0)
    out = acc / l_safe[:, None]
    if not SPLIT:
        tl.store(Out + b.to(tl.int64) * stride_ob + offs_h[:, None] * stride_oh + offs_d[None, :],
                 out.to(Out.dtype.element_ty), mask=h_mask[:, None] & d_mask[None, :])
    else:
        lse = tl.where(has, (m_log2 + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
        tl.store(OutPartial + b.to(tl.int64) * stride_pb + offs_h[:, None] * stride_ph
                 + split * stride_ps + offs_d[None, :], out, mask=h_mask[:, None] & d_mask[None, :])
        tl.store(LsePartial + b.to(tl.int64) * stride_lb + offs_h * stride_lh + split, lse, mask=lse_mask)


@triton.jit
def _merge_splits(
    OutPartial, LsePartial, Out,
    stride_pb, stride_ph, stride_ps,
    stride_lb, stride_lh,
    stride_ob, stride_oh,
    num_splits,
    V_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_dv = tl.arange(0, BLOCK_DV)
    s_mask = offs_s < num_splits
    dv_mask = offs_dv < V_DIM
    lse = tl.load(LsePartial + b.to(tl.int64) * stride_lb + h * stride_lh + offs_s,
                  mask=s_mask, other=float("-inf"))
    m = tl.max(lse, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse - m_safe)
    w_sum = tl.sum(w, 0)
    w = w / tl.where(w_sum > 0, w_sum, 1.0)
    # a part with no tokens (log-sum-exp -inf) is not read: its output may never have been written
    part = tl.load(OutPartial + b.to(tl.int64) * stride_pb + h * stride_ph
                   + offs_s[:, None] * stride_ps + offs_dv[None, :],
                   mask=(s_mask & (lse > float("-inf")))[:, None] & dv_mask[None, :], other=0.0)
    out = tl.sum(part * w[:, None], 0)
    tl.store(Out + b.to(tl.int64) * stride_ob + h * stride_oh + offs_dv, out.to(Out.dtype.element_ty), mask=dv_mask)


def merge_splits(part: torch.Tensor, lse: torch.Tensor, out: torch.Tensor, block_dv: int) -> None:
    """Log-sum-exp merge of split-K partials ``part [B, H, splits, Dv] float32`` with their
    ``lse [B, H, splits]`` into ``out [B, H, Dv]`` (one program per (request, head)); parts
    whose log-sum-exp is -inf count for nothing and their ``part`` rows are not read."""
    B, H, splits, Dv = part.shape
    _merge_splits[(B, H)](
        part, lse, out,
        part.stride(0), part.stride(1), part.stride(2),
        lse.stride(0), lse.stride(1),
        out.stride(0), out.stride(1),
        splits,
        V_DIM=Dv, BLOCK_S=max(2, triton.next_power_of_2(splits)), BLOCK_DV=block_dv,
        num_warps=4,
    )
