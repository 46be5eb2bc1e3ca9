"""Sparse MLA decode attention over token indices (DeepSeek DSA style).

MLA with the absorbed query: every head attends to the same latent KV rows
``kv[slot] = [c_kv (kv_lora_rank) | k_rope (rope_dim)]`` (one "kv head"); the score is
``q · kv`` over all ``kv_lora_rank + rope_dim`` dims and the value is the latent part
``kv[:, :kv_lora_rank]``. Each row attends to the slots ``indices[b]`` (``-1`` padding,
anywhere in the row; out-of-pool slots are masked too, never read).

Kernel shape (Triton): one program per (head block, request, split); the head block is
the fastest grid axis so the programs reading the same KV rows run side by side and the
repeat reads hit L2. Scores are two ``tl.dot`` (latent and rope parts), the value product
reuses the latent tile already in registers (``tl.trans``), so each KV row is loaded once
per head block. Split-K over the index list with a log-sum-exp merge (the merge kernel of
``paged_decode``). At 128 heads the arithmetic intensity (~240 flop/byte) is near the
H100/H200 ridge point, so this kernel may be compute-bound: the benchmark reports TFLOP/s.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from hicache.triton_support import announce_path, use_triton
from sparsehi.kernels.paged_decode import _FLOAT_DTYPES, _MAX_SPLITS, _fail, _merge_splits, dot_in_fp32, sm_count


@dataclass(frozen=True)
class MlaLaunchConfig:
    """Block sizes of the sparse MLA kernel; ``num_splits`` None = heuristic."""

    block_h: int = 64
    block_n: int = 32
    num_warps: int = 8
    num_stages: int = 2
    num_splits: Optional[int] = None
    row_load: bool = False
    """Load KV tiles as ``[N, D]`` rows (score dot on the transposed view) instead of
    ``[D, N]`` columns (value dot on the transposed view)."""


def default_mla_config(device: torch.device, num_heads: int, batch: int = 1) -> MlaLaunchConfig:
    """Block sizes from the H200 sweeps in benchmarks/results/attention.json (``sweep_history``).

    Many rows (``batch * heads / 64 >= 8``): 64-head blocks, 64-token tiles, 8 warps —
    the KV tile is read once per 64 heads and the dots are large. Few rows: 16-head
    blocks (4x the programs) with row-layout loads, which won at B=1.
    """
    if device.type != "cuda":
        return MlaLaunchConfig(block_h=16, block_n=16, num_warps=4, num_stages=1)
    if batch * -(-num_heads // 64) >= 8:
        return MlaLaunchConfig(block_h=64, block_n=64, num_warps=8, num_stages=2)
    return MlaLaunchConfig(block_h=16, block_n=64, num_warps=4, num_stages=2, row_load=True)


def mla_num_splits(work_items: int, num_idx: int, block_n: int, num_sms: int) -> int:
    """Split-K count for the MLA kernel: one program per SM is already a full wave (each
    program holds a large tile in shared memory), so split only while the grid is smaller
    than the SM count, and keep splits >= 128 indices."""
    want = max(1, num_sms // max(1, work_items))
    cap = max(1, -(-num_idx // max(block_n, 128)))
    return int(max(1, min(want, cap, _MAX_SPLITS)))


@triton.jit
def _mla_stage1(
    Q, KV, Idx, Out, OutPartial, LsePartial,
    qk_scale_log2,
    stride_qb, stride_qh, stride_kvn, stride_ib,
    stride_ob, stride_oh,
    stride_pb, stride_ph, stride_ps,
    stride_lb, stride_lh,
    num_heads, num_idx, tokens_per_split, num_slots,
    D_LAT: tl.constexpr, D_ROPE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_DL: tl.constexpr, BLOCK_DR: tl.constexpr,
    SPLIT: tl.constexpr, DOT_F32: tl.constexpr, ROW_LOAD: tl.constexpr,
):
    hb = tl.program_id(0)
    b = tl.program_id(1)
    split = tl.program_id(2)
    start = split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, num_idx)

    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_dl = tl.arange(0, BLOCK_DL)
    offs_dr = tl.arange(0, BLOCK_DR)
    h_mask = offs_h < num_heads
    dl_mask = offs_dl < D_LAT
    dr_mask = offs_dr < D_ROPE
    q_base = Q + b.to(tl.int64) * stride_qb + offs_h[:, None] * stride_qh
    q_lat = tl.load(q_base + offs_dl[None, :], mask=h_mask[:, None] & dl_mask[None, :], other=0.0)
    q_pe = tl.load(q_base + D_LAT + offs_dr[None, :], mask=h_mask[:, None] & dr_mask[None, :], other=0.0)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DL], dtype=tl.float32)

    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        in_row = offs_n < end
        idx = tl.load(Idx + b.to(tl.int64) * stride_ib + offs_n, mask=in_row, other=-1).to(tl.int64)
        valid = in_row & (idx >= 0) & (idx < num_slots)
        base = tl.where(valid, idx, 0) * stride_kvn
        if ROW_LOAD:
            # rows as loaded [N, D]; the score dot takes the transposed view
            kv_lat = tl.load(KV + base[:, None] + offs_dl[None, :], mask=valid[:, None] & dl_mask[None, :], other=0.0)
            kv_pe = tl.load(KV + base[:, None] + D_LAT + offs_dr[None, :], mask=valid[:, None] & dr_mask[None, :], other=0.0)
            k_lat = tl.trans(kv_lat)
            k_pe = tl.trans(kv_pe)
        else:
            k_lat = tl.load(KV + base[None, :] + offs_dl[:, None], mask=valid[None, :] & dl_mask[:, None], other=0.0)
            k_pe = tl.load(KV + base[None, :] + D_LAT + offs_dr[:, None], mask=valid[None, :] & dr_mask[:, None], other=0.0)
            kv_lat = tl.trans(k_lat)
        if DOT_F32:
            s = tl.dot(q_lat.to(tl.float32), k_lat.to(tl.float32))
            s += tl.dot(q_pe.to(tl.float32), k_pe.to(tl.float32))
        else:
            s = tl.dot(q_lat, k_lat)
            s += tl.dot(q_pe, k_pe)
        s = s * qk_scale_log2
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # a block of only padding leaves m at -inf; shift by 0 then (p = 0)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if DOT_F32:
            pv = tl.dot(p, kv_lat.to(tl.float32))
        else:
            pv = tl.dot(p.to(kv_lat.dtype), kv_lat)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    has = l_i > 0
    l_safe = tl.where(has, l_i, 1.0)
    out = acc / l_safe[:, None]
    if not SPLIT:
        tl.store(Out + b.to(tl.int64) * stride_ob + offs_h[:, None] * stride_oh + offs_dl[None, :],
                 out.to(Out.dtype.element_ty), mask=h_mask[:, None] & dl_mask[None, :])
    else:
        lse = tl.where(has, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
        tl.store(OutPartial + b.to(tl.int64) * stride_pb + offs_h[:, None] * stride_ph
                 + split * stride_ps + offs_dl[None, :], out, mask=h_mask[:, None] & dl_mask[None, :])
        tl.store(LsePartial + b.to(tl.int64) * stride_lb + offs_h * stride_lh + split, lse, mask=h_mask)


def _check_mla(q: torch.Tensor, kv_buffer: torch.Tensor, indices: torch.Tensor, kv_lora_rank: int) -> torch.Tensor:
    """Validate; returns kv as a 2-D ``[num_slots, Dl + Dr]`` view."""
    if not isinstance(q, torch.Tensor) or q.dim() != 3:
        _fail("q", "a [B, H, kv_lora_rank + rope_dim] tensor", getattr(q, "shape", type(q)))
    if q.dtype not in _FLOAT_DTYPES:
        _fail("q", f"of dtype in {_FLOAT_DTYPES}", q.dtype)
    if not isinstance(kv_buffer, torch.Tensor) or kv_buffer.dim() not in (2, 3) or (
            kv_buffer.dim() == 3 and kv_buffer.shape[1] != 1):
        _fail("kv_buffer", "a [num_slots, 1, kv_lora_rank + rope_dim] tensor", getattr(kv_buffer, "shape", type(kv_buffer)))
    kv = kv_buffer.reshape(kv_buffer.shape[0], kv_buffer.shape[-1]) if kv_buffer.dim() == 3 else kv_buffer
    if kv.dtype != q.dtype:
        _fail("kv_buffer", f"of q's dtype {q.dtype}", kv.dtype)
    if kv.device != q.device:
        _fail("kv_buffer", f"on q's device {q.device}", kv.device)
    if kv.shape[1] != q.shape[2]:
        _fail("kv_buffer", f"with last dim {q.shape[2]} (q's)", kv.shape[1])
    if not isinstance(kv_lora_rank, int) or not (0 < kv_lora_rank < q.shape[2]):
        _fail("kv_lora_rank", f"an int in (0, {q.shape[2]})", kv_lora_rank)
    if kv.stride(1) != 1 or q.stride(2) != 1:
        _fail("kv_buffer/q", "contiguous in the last dim", (kv.stride(), q.stride()))
    if not isinstance(indices, torch.Tensor) or indices.dim() != 2 or indices.shape[0] != q.shape[0]:
        _fail("indices", f"a [B={q.shape[0]}, K] tensor", getattr(indices, "shape", type(indices)))
    if indices.dtype not in (torch.int32, torch.int64):
        _fail("indices", "int32 or int64", indices.dtype)
    if indices.device != q.device:
        _fail("indices", f"on q's device {q.device}", indices.device)
    return kv


def sparse_mla_decode_triton(q: torch.Tensor, kv_buffer: torch.Tensor, indices: torch.Tensor, *,
                             kv_lora_rank: int, sm_scale: float,
                             config: Optional[MlaLaunchConfig] = None) -> torch.Tensor:
    """Triton sparse MLA decode.

    q:          ``[B, H, kv_lora_rank + rope_dim]`` fp16/bf16 absorbed query.
    kv_buffer:  ``[num_slots, 1, kv_lora_rank + rope_dim]`` (or ``[num_slots, Dl+Dr]``).
    indices:    ``[B, K]`` int32 slots, ``-1`` padding (masked wherever it is).
    Returns ``[B, H, kv_lora_rank]`` in q's dtype; rows without a valid index are zeros.
    """
    kv = _check_mla(q, kv_buffer, indices, kv_lora_rank)
    B, H, Dq = q.shape
    Dl, Dr = kv_lora_rank, Dq - kv_lora_rank
    K = indices.shape[1]
    out = torch.empty((B, H, Dl), dtype=q.dtype, device=q.device)
    if B == 0:
        return out
    if indices.stride(1) != 1:
        indices = indices.contiguous()
    cfg = config or default_mla_config(q.device, H, B)
    block_h = max(16, min(cfg.block_h, triton.next_power_of_2(H)))
    head_blocks = -(-H // block_h)
    splits = cfg.num_splits or mla_num_splits(B * head_blocks, K, cfg.block_n, sm_count(q.device))
    splits = max(1, min(int(splits), _MAX_SPLITS))
    tps = -(-max(1, K) // splits)
    tps = -(-tps // cfg.block_n) * cfg.block_n
    splits = max(1, -(-max(1, K) // tps))
    block_dl = max(16, triton.next_power_of_2(Dl))
    block_dr = max(16, triton.next_power_of_2(Dr))
    if splits > 1:
        part = torch.empty((B, H, splits, Dl), dtype=torch.float32, device=q.device)
        lse = torch.empty((B, H, splits), dtype=torch.float32, device=q.device)
        pstr = (part.stride(0), part.stride(1), part.stride(2), lse.stride(0), lse.stride(1))
    else:
        part, lse, pstr = out, out, (0, 0, 0, 0, 0)
    _mla_stage1[(head_blocks, B, splits)](
        q, kv, indices, out, part, lse,
        float(sm_scale) * 1.4426950408889634,
        q.stride(0), q.stride(1), kv.stride(0), indices.stride(0),
        out.stride(0), out.stride(1),
        *pstr,
        H, K, tps, kv.shape[0],
        D_LAT=Dl, D_ROPE=Dr, BLOCK_H=block_h, BLOCK_N=cfg.block_n,
        BLOCK_DL=block_dl, BLOCK_DR=block_dr,
        SPLIT=splits > 1, DOT_F32=dot_in_fp32(q), ROW_LOAD=cfg.row_load,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if splits > 1:
        _merge_splits[(B, H)](
            part, lse, out,
            part.stride(0), part.stride(1), part.stride(2),
            lse.stride(0), lse.stride(1),
            out.stride(0), out.stride(1),
            splits,
            V_DIM=Dl, BLOCK_S=max(2, triton.next_power_of_2(splits)), BLOCK_DV=block_dl,
            num_warps=4,
        )
    return out


def sparse_mla_decode_reference(q: torch.Tensor, kv_buffer: torch.Tensor, indices: torch.Tensor, *,
                                kv_lora_rank: int, sm_scale: float,
                                config: Optional[MlaLaunchConfig] = None) -> torch.Tensor:
    """Torch reference of :func:`sparse_mla_decode_triton` (same arguments and result)."""
    kv = _check_mla(q, kv_buffer, indices, kv_lora_rank)
    idx = indices.long()
    valid = (idx >= 0) & (idx < kv.shape[0])
    rows = kv[torch.where(valid, idx, torch.zeros_like(idx))].float()      # [B, K, Dl+Dr]
    s = torch.einsum("bhd,bkd->bhk", q.float(), rows) * sm_scale
    s = s.masked_fill(~valid[:, None, :], float("-inf"))
    p = torch.nan_to_num(torch.softmax(s, dim=-1), nan=0.0)
    return torch.einsum("bhk,bkd->bhd", p, rows[..., :kv_lora_rank]).to(q.dtype)


def sparse_mla_decode(q: torch.Tensor, kv_buffer: torch.Tensor, indices: torch.Tensor, *,
                      kv_lora_rank: int, sm_scale: float,
                      config: Optional[MlaLaunchConfig] = None) -> torch.Tensor:
    """Sparse MLA decode; Triton on CUDA, torch reference on CPU."""
    if use_triton(q):
        announce_path("sparse_mla_decode", "triton")
        return sparse_mla_decode_triton(q, kv_buffer, indices, kv_lora_rank=kv_lora_rank,
                                        sm_scale=sm_scale, config=config)
    announce_path("sparse_mla_decode", "reference")
    return sparse_mla_decode_reference(q, kv_buffer, indices, kv_lora_rank=kv_lora_rank, sm_scale=sm_scale)
