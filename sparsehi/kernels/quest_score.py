"""Quest page scores: the upper bound of q·k over a page from its element-wise key
min/max (Tang et al., ICML 2024).

For one query head ``h`` of GQA group ``g`` and page ``p``:
``U[h, p] = Σ_d max(q_hd · min[p, g, d], q_hd · max[p, g, d]) >= max_{t in p} q_h · k_{t, g}``.
Heads are reduced with ``sum`` (the bound of the summed exact score, since
``Σ_h max_t ≥ max_t Σ_h``) or ``max`` (the bound of the max-over-heads score); both keep
the upper-bound property.

Entry points: ``quest_score`` (dispatch), ``quest_score_triton``, ``quest_score_reference``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from hicache.triton_support import announce_path, use_triton

HEAD_REDUCE = ("max", "sum")


def _check(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, req_pool_indices: torch.Tensor,
           num_pages: torch.Tensor, head_reduce: str) -> None:
    if q.dim() != 3:
        raise ValueError(f"q must be [B, Hq, D], got {tuple(q.shape)}")
    if kmin.dim() != 4 or kmin.shape != kmax.shape:
        raise ValueError(f"kmin/kmax must both be [R, P, Hkv, D], got {tuple(kmin.shape)} and {tuple(kmax.shape)}")
    b, hq, d = q.shape
    if kmin.shape[3] != d or hq % kmin.shape[2]:
        raise ValueError(f"q {tuple(q.shape)} does not fit kmin {tuple(kmin.shape)}: need equal D and Hq % Hkv == 0")
    if req_pool_indices.shape != (b,) or num_pages.shape != (b,):
        raise ValueError(f"req_pool_indices and num_pages must be [B={b}], got {tuple(req_pool_indices.shape)}, {tuple(num_pages.shape)}")
    if head_reduce not in HEAD_REDUCE:
        raise ValueError(f"head_reduce={head_reduce!r} is invalid: one of {HEAD_REDUCE}")


def quest_score_reference(
    q: torch.Tensor,
    kmin: torch.Tensor,
    kmax: torch.Tensor,
    req_pool_indices: torch.Tensor,
    num_pages: torch.Tensor,
    head_reduce: str = "sum",
) -> torch.Tensor:
    """Torch reference.

    q:                ``[B, Hq, D]`` float (any float dtype; computed in fp32).
    kmin, kmax:       ``[R, P, Hkv, D]`` per-page element-wise key min / max.
    req_pool_indices: ``[B]`` int, row of kmin/kmax per batch row (``-1``: no request).
    num_pages:        ``[B]`` int, pages written per row; pages ``>= num_pages`` score ``-inf``.
    Returns ``[B, P] float32``.
    """
    _check(q, kmin, kmax, req_pool_indices, num_pages, head_reduce)
    b, hq, d = q.shape
    _, p, hkv, _ = kmin.shape
    req = req_pool_indices.long().clamp(min=0)
    mn = kmin[req].float()
    mx = kmax[req].float()
    # max(q·a, q·b) element-wise == q·(a+b)/2 + |q|·(b-a)/2: two contractions instead of a
    # [B, P, Hq, D] temporary.
    qg = q.float().view(b, hkv, hq // hkv, d)
    bound = torch.einsum("bgrd,bpgd->bgrp", qg, (mn + mx) * 0.5) + torch.einsum("bgrd,bpgd->bgrp", qg.abs(), (mx - mn) * 0.5)
    bound = bound.reshape(b, hq, p)
    s = bound.amax(dim=1) if head_reduce == "max" else bound.sum(dim=1)
    pages = torch.arange(p, device=q.device)[None, :]
    live = (pages < num_pages.to(q.device).long()[:, None]) & (req_pool_indices.to(q.device)[:, None] >= 0)
    return torch.where(live, s, torch.full_like(s, float("-inf")))


@triton.jit
def _quest_score_kernel(
    q_ptr, kmin_ptr, kmax_ptr, req_ptr, npages_ptr, out_ptr,
    P, D,
    stride_qb, stride_qh,
    stride_kr, stride_kp, stride_kg,
    stride_ob,
    HKV: tl.constexpr, GROUP: tl.constexpr, SUM_HEADS: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0)
    pblk = tl.program_id(1)
    offs_p = pblk * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_d = tl.arange(0, BLOCK_D)
    req = tl.load(req_ptr + b).to(tl.int64)
    n = tl.load(npages_ptr + b)
    n = tl.where(req >= 0, n, 0)
    live_p = offs_p < n
    out_mask = offs_p < P
    # Pages past the row's last one are masked out of every load, so a fixed [B, P] grid
    # (CUDA-graph friendly) moves only the live pages' representation bytes.
    req = tl.maximum(req, 0)
    d_mask = offs_d < D
    tile_mask = live_p[:, None] & d_mask[None, :]
    if SUM_HEADS:
        acc = tl.zeros([BLOCK_P], dtype=tl.float32)
    else:
        acc = tl.full([BLOCK_P], float("-inf"), tl.float32)
    for g in range(HKV):
        base = req * stride_kr + offs_p[:, None].to(tl.int64) * stride_kp + g * stride_kg + offs_d[None, :]
        mn = tl.load(kmin_ptr + base, mask=tile_mask, other=0.0).to(tl.float32)
        mx = tl.load(kmax_ptr + base, mask=tile_mask, other=0.0).to(tl.float32)
        for r in tl.static_range(GROUP):
            h = g * GROUP + r
            qv = tl.load(q_ptr + b * stride_qb + h * stride_qh + offs_d, mask=d_mask, other=0.0).to(tl.float32)
            s = tl.sum(tl.maximum(qv[None, :] * mn, qv[None, :] * mx), axis=1)
            if SUM_HEADS:
                acc = acc + s
            else:
                acc = tl.maximum(acc, s)
    acc = tl.where(live_p, acc, float("-inf"))
    tl.store(out_ptr + b * stride_ob + offs_p, acc, mask=out_mask)


def quest_score_triton(
    q: torch.Tensor,
    kmin: torch.Tensor,
    kmax: torch.Tensor,
    req_pool_indices: torch.Tensor,
    num_pages: torch.Tensor,
    head_reduce: str = "sum",
    block_p: int = 32,
) -> torch.Tensor:
    """Triton launcher; same arguments and result as :func:`quest_score_reference`."""
    _check(q, kmin, kmax, req_pool_indices, num_pages, head_reduce)
    b, hq, d = q.shape
    _, p, hkv, _ = kmin.shape
    if kmin.stride(3) != 1 or kmax.stride() != kmin.stride():
        raise ValueError("kmin/kmax must share a layout with a contiguous last dim")
    q = q.contiguous()
    req = req_pool_indices.to(device=q.device, dtype=torch.int64).contiguous()
    npg = num_pages.to(device=q.device, dtype=torch.int32).contiguous()
    out = torch.empty(b, p, dtype=torch.float32, device=q.device)
    if b == 0 or p == 0:
        return out
    grid = (b, triton.cdiv(p, block_p))
    _quest_score_kernel[grid](
        q, kmin, kmax, req, npg, out,
        p, d,
        q.stride(0), q.stride(1),
        kmin.stride(0), kmin.stride(1), kmin.stride(2),
        out.stride(0),
        HKV=hkv, GROUP=hq // hkv, SUM_HEADS=(head_reduce == "sum"),
        BLOCK_P=block_p, BLOCK_D=triton.next_power_of_2(d),
    )
    return out


def quest_score(
    q: torch.Tensor,
    kmin: torch.Tensor,
    kmax: torch.Tensor,
    req_pool_indices: torch.Tensor,
    num_pages: torch.Tensor,
    head_reduce: str = "sum",
) -> torch.Tensor:
    """Quest page upper bounds ``[B, P] float32`` (Triton on CUDA, reference on CPU)."""
    if use_triton(q):
        announce_path("quest_score", "triton")
        return quest_score_triton(q, kmin, kmax, req_pool_indices, num_pages, head_reduce)
    announce_path("quest_score", "reference")
    return quest_score_reference(q, kmin, kmax, req_pool_indices, num_pages, head_reduce)
