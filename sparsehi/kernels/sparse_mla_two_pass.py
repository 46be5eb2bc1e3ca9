"""Sparse MLA decode in two passes (opt-in with :class:`MlaTwoPassConfig`; the rows and
indices as ``sparse_mla_decode``).

Pass 1 (``_mla_scores``) is a score GEMM per request: fp32 scores ``[B, H, K]`` (scaled,
``-inf`` at invalid indices) and per-block row maxima into a scratch buffer. Pass 2
(``_mla_pv``) is ``softmax(S) @ kv[idx, :Dl]`` with the row max known up front, so no
rescaling in its loop, split-K merged as the fused kernel. Same results as the fused
kernel, at ``B * H * K * 4`` bytes of scratch (its measured speed: docs/kernels.md).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from hicache.triton_support import cdiv, sm_count
from sparsehi.kernels.flash_decoding import (INTERPRETER_SMS, dot_in_fp32, merge_splits, split_buffers, split_tokens,
                                             store_split_result)
from sparsehi.kernels.sparse_mla_common import index_tile, load_rows, mla_num_splits


@dataclass(frozen=True)
class MlaTwoPassConfig:
    """Block sizes of the two-pass path: pass 1 is a score GEMM ``q [H, D] x kv[idx]^T``
    per request (``score_*``, written to an fp32 scratch ``[B, H, K]`` with per-block row
    maxima), pass 2 the value product over the stored scores (``pv_*``, split-K merged
    like the fused kernel). ``num_splits`` None = heuristic."""

    score_block_h: int = 128
    score_block_n: int = 128
    score_block_k: int = 64
    score_warps: int = 8
    score_stages: int = 3
    pv_block_h: int = 64
    pv_block_n: int = 64
    pv_block_dv: int = 512
    pv_warps: int = 8
    pv_stages: int = 2
    num_splits: Optional[int] = None


@triton.jit
def _mla_scores(
    Q, KV, Idx, S, Mblk,
    qk_scale_log2,
    stride_qb, stride_qh, stride_kvn, stride_ib,
    stride_sb, stride_sh, stride_mb, stride_mh,
    num_heads, num_idx, num_slots,
    D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    """Pass 1: ``S[b, h, n] = q[b, h] . kv[idx[b, n]] * scale * log2(e)`` (``-inf`` where the
    index is invalid) for one [BLOCK_H, BLOCK_N] block, and that block's row maxima.
    A plain GEMM loop over D: the gather addresses are fixed for the whole loop, so the
    cp.async pipeline runs ahead with no index load on its critical path."""
    nb = tl.program_id(0)
    b = tl.program_id(1)
    hb = tl.program_id(2)
    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    h_mask = offs_h < num_heads
    idx, valid = index_tile(Idx, b, stride_ib, nb * BLOCK_N, num_idx, num_slots, BLOCK_N)
    in_row = offs_n < num_idx
    kv_base = tl.where(valid, idx, 0).to(tl.int64) * stride_kvn
    q_ptrs = Q + b.to(tl.int64) * stride_qb + offs_h[:, None] * stride_qh + offs_k[None, :]
    k_ptrs = KV + kv_base[None, :] + offs_k[:, None]
    acc = tl.zeros([BLOCK_H, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, D, BLOCK_K):
        k_mask = (k0 + offs_k) < D
        a = tl.load(q_ptrs + k0, mask=h_mask[:, None] & k_mask[None, :], other=0.0)
        kt = tl.load(k_ptrs + k0, mask=k_mask[:, None] & valid[None, :], other=0.0)
        if DOT_F32:
            a = a.to(tl.float32)
            kt = kt.to(tl.float32)
        acc = tl.dot(a, kt, acc)
    s = tl.where(valid[None, :], acc * qk_scale_log2, float("-inf"))
    tl.store(S + b.to(tl.int64) * stride_sb + offs_h[:, None] * stride_sh + offs_n[None, :], s,
             mask=h_mask[:, None] & in_row[None, :])
    tl.store(Mblk + b.to(tl.int64) * stride_mb + offs_h * stride_mh + nb, tl.max(s, 1), mask=h_mask)


@triton.jit
def _mla_pv(
    S, Mblk, KV, Idx, Out, OutPartial, LsePartial,
    stride_sb, stride_sh, stride_mb, stride_mh,
    stride_kvn, stride_ib,
    stride_ob, stride_oh,
    stride_pb, stride_ph, stride_ps,
    stride_lb, stride_lh,
    num_heads, num_idx, tokens_per_split, num_slots, num_blocks,
    D_LAT: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_NB: tl.constexpr, NUM_DVB: tl.constexpr, SPLIT: tl.constexpr, DOT_F32: tl.constexpr,
):
    """Pass 2: ``out = softmax(S) @ kv[idx, :D_LAT]`` for one [BLOCK_H, BLOCK_DV] output block
    and one token split. The row max is the max of pass 1's block maxima, so there is no
    rescaling inside the loop and the only dot is the value product."""
    pid0 = tl.program_id(0)
    hb = pid0 // NUM_DVB
    dvb = pid0 % NUM_DVB
    b = tl.program_id(1)
    split = tl.program_id(2)
    start = split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, num_idx)
    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_dv = dvb * BLOCK_DV + tl.arange(0, BLOCK_DV)
    offs_nb = tl.arange(0, BLOCK_NB)
    h_mask = offs_h < num_heads
    dv_mask = offs_dv < D_LAT
    mb = tl.load(Mblk + b.to(tl.int64) * stride_mb + offs_h[:, None] * stride_mh + offs_nb[None, :],
                 mask=h_mask[:, None] & (offs_nb < num_blocks)[None, :], other=float("-inf"))
    m = tl.max(mb, 1)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    s_base = S + b.to(tl.int64) * stride_sb + offs_h[:, None] * stride_sh
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        idx, valid = index_tile(Idx, b, stride_ib, n0, end, num_slots, BLOCK_N)
        offs_n = n0 + tl.arange(0, BLOCK_N)
        s = tl.load(s_base + offs_n[None, :], mask=h_mask[:, None] & (offs_n < end)[None, :], other=float("-inf"))
        p = tl.exp2(s - m_safe[:, None])
        l_i += tl.sum(p, 1)
        v = load_rows(KV, idx, valid, stride_kvn, offs_dv, dv_mask, 0)
        if DOT_F32:
            v = v.to(tl.float32)
        acc = tl.dot(p.to(v.dtype), v, acc)
    # every value block of a head computes the same lse; block 0 writes it
    store_split_result(acc, l_i, m_safe, Out, OutPartial, LsePartial, b, split, offs_h, offs_dv, h_mask, dv_mask,
                       h_mask & ((offs_h * 0 + dvb) == 0),
                       stride_ob, stride_oh, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, SPLIT)


def sparse_mla_two_pass(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, out: torch.Tensor,
                        Dl: int, sm_scale: float, cfg: MlaTwoPassConfig) -> torch.Tensor:
    """Two launches (module docstring) into ``out [B, H, Dl]``: ``q [B, H, Dq]``, ``kv
    [num_slots, Dq]`` (checked by ``check_mla``), ``indices [B, K]`` contiguous rows."""
    B, H, Dq = q.shape
    K = indices.shape[1]
    if K == 0:
        return out.zero_()
    dot_f32 = dot_in_fp32(q)
    bh1 = max(16, min(cfg.score_block_h, triton.next_power_of_2(H)))
    nblk = cdiv(K, cfg.score_block_n)
    scores = torch.empty((B, H, K), dtype=torch.float32, device=q.device)
    mblk = torch.empty((B, H, nblk), dtype=torch.float32, device=q.device)
    _mla_scores[(nblk, B, cdiv(H, bh1))](
        q, kv, indices, scores, mblk,
        float(sm_scale) * 1.4426950408889634,
        q.stride(0), q.stride(1), kv.stride(0), indices.stride(0),
        scores.stride(0), scores.stride(1), mblk.stride(0), mblk.stride(1),
        H, K, kv.shape[0],
        D=Dq, BLOCK_H=bh1, BLOCK_N=cfg.score_block_n, BLOCK_K=cfg.score_block_k, DOT_F32=dot_f32,
        num_warps=cfg.score_warps, num_stages=cfg.score_stages,
    )
    bh2 = max(16, min(cfg.pv_block_h, triton.next_power_of_2(H)))
    block_dl = max(16, triton.next_power_of_2(Dl))
    bdv = max(16, min(triton.next_power_of_2(cfg.pv_block_dv), block_dl))
    num_dvb = block_dl // bdv
    work = cdiv(H, bh2) * num_dvb
    sms = sm_count(q.device, off_cuda=INTERPRETER_SMS)
    splits, tps = split_tokens(K, cfg.num_splits or mla_num_splits(B * work, K, cfg.pv_block_n, sms), cfg.pv_block_n)
    part, lse, pstr = split_buffers(out, splits)
    _mla_pv[(work, B, splits)](
        scores, mblk, kv, indices, out, part, lse,
        scores.stride(0), scores.stride(1), mblk.stride(0), mblk.stride(1),
        kv.stride(0), indices.stride(0),
        out.stride(0), out.stride(1),
        *pstr,
        H, K, tps, kv.shape[0], nblk,
        D_LAT=Dl, BLOCK_H=bh2, BLOCK_N=cfg.pv_block_n, BLOCK_DV=bdv,
        BLOCK_NB=max(2, triton.next_power_of_2(nblk)), NUM_DVB=num_dvb, SPLIT=splits > 1, DOT_F32=dot_f32,
        num_warps=cfg.pv_warps, num_stages=cfg.pv_stages,
    )
    if splits > 1:
        merge_splits(part, lse, out, block_dl)
    return out
