"""Quest page scores: the upper bound of q·k over a page from its element-wise key
min/max (Tang et al., ICML 2024).

For one query head ``h`` of GQA group ``g`` and page ``p``:
``U[h, p] = Σ_d max(q_hd · min[p, g, d], q_hd · max[p, g, d]) >= max_{t in p} q_h · k_{t, g}``.
Heads are reduced with ``sum`` (the bound of the summed exact score, since
``Σ_h max_t ≥ max_t Σ_h``) or ``max`` (the bound of the max-over-heads score); both keep
the upper-bound property.

Pages per row come from the row's length (tokens, ``page_size``) inside the kernel, and
rows whose request slot is negative (padding) or past the pool score ``-inf``: the decode
path scores a layer in one launch, with no per-step derivations around it.

Entry points: ``quest_score`` (dispatch), ``quest_score_triton``, ``quest_score_reference``.
The bounds are kept up to date by ``quest_update_bounds``.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from hicache.triton_support import cdiv, dispatch, interpreter_enabled

HEAD_REDUCE = ("max", "sum")
_INT_DTYPES = (torch.int32, torch.int64)


def _check(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, req_pool_indices: torch.Tensor,
           lengths: torch.Tensor, head_reduce: str, page_size: int) -> None:
    if q.dim() != 3:
        raise ValueError(f"q must be [B, Hq, D], got {tuple(q.shape)}")
    if kmin.dim() != 4 or kmin.shape != kmax.shape:
        raise ValueError(f"kmin/kmax must both be [R, P, Hkv, D], got {tuple(kmin.shape)} and {tuple(kmax.shape)}")
    b, hq, d = q.shape
    if kmin.shape[3] != d or hq % kmin.shape[2]:
        raise ValueError(f"q {tuple(q.shape)} does not fit kmin {tuple(kmin.shape)}: need equal D and Hq % Hkv == 0")
    if req_pool_indices.shape != (b,) or lengths.shape != (b,):
        raise ValueError(f"req_pool_indices and lengths must be [B={b}], got {tuple(req_pool_indices.shape)}, {tuple(lengths.shape)}")
    if req_pool_indices.dtype not in _INT_DTYPES or lengths.dtype not in _INT_DTYPES:
        raise ValueError(f"req_pool_indices and lengths must be int32/int64, got {req_pool_indices.dtype}, {lengths.dtype}")
    if head_reduce not in HEAD_REDUCE:
        raise ValueError(f"head_reduce={head_reduce!r} is invalid: one of {HEAD_REDUCE}")
    if not isinstance(page_size, int) or isinstance(page_size, bool) or page_size < 1:
        raise ValueError(f"page_size={page_size!r} is invalid: an integer >= 1")


def quest_score_reference(
    q: torch.Tensor,
    kmin: torch.Tensor,
    kmax: torch.Tensor,
    req_pool_indices: torch.Tensor,
    lengths: torch.Tensor,
    head_reduce: str = "sum",
    *,
    page_size: int = 1,
) -> torch.Tensor:
    """Torch reference.

    q:                ``[B, Hq, D]`` float (any float dtype; computed in fp32).
    kmin, kmax:       ``[R, P, Hkv, D]`` per-page element-wise key min / max.
    req_pool_indices: ``[B]`` int32/int64, row of kmin/kmax per batch row (negative or
                      ``>= R``: no request, the row scores ``-inf``).
    lengths:          ``[B]`` int32/int64, tokens written per row: pages
                      ``>= ceil(lengths / page_size)`` score ``-inf`` (with the default
                      ``page_size=1``, lengths count pages).
    Returns ``[B, P] float32``.
    """
    _check(q, kmin, kmax, req_pool_indices, lengths, head_reduce, page_size)
    b, hq, d = q.shape
    r, p, hkv, _ = kmin.shape
    req = req_pool_indices.to(q.device).long()
    live_row = (req >= 0) & (req < r)
    req = torch.where(live_row, req, torch.zeros_like(req))
    mn = kmin[req].float()
    mx = kmax[req].float()
    # max(q·a, q·b) element-wise == q·(a+b)/2 + |q|·(b-a)/2: two contractions instead of a
    # [B, P, Hq, D] temporary.
    qg = q.float().view(b, hkv, hq // hkv, d)
    bound = torch.einsum("bgrd,bpgd->bgrp", qg, (mn + mx) * 0.5) + torch.einsum("bgrd,bpgd->bgrp", qg.abs(), (mx - mn) * 0.5)
    bound = bound.reshape(b, hq, p)
    s = bound.amax(dim=1) if head_reduce == "max" else bound.sum(dim=1)
    pages = torch.arange(p, device=q.device)[None, :]
    num_pages = (lengths.to(q.device).long() + page_size - 1) // page_size
    live = (pages < num_pages[:, None]) & live_row[:, None]
    return torch.where(live, s, torch.full_like(s, float("-inf")))


@triton.jit
def _pair_sum(x, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr, LOG_D: tl.constexpr):
    """Row sums of ``x [BLOCK_P, BLOCK_D]`` (``BLOCK_D = 2**LOG_D``) as one fixed pairwise
    tree: level ``i`` adds neighbours ``(2j, 2j+1)``. Each addition has two operands, and
    IEEE addition is commutative, so the float result does not depend on how the compiler
    spreads a row over registers, lanes and warps (a plain ``tl.sum`` folds in an order set
    by the layout, which follows the tile shape and warp count). Every kernel that scores
    pages with this gets the same bits per page, whatever its tiling."""
    for i in tl.static_range(LOG_D):
        x = tl.sum(tl.reshape(x, [BLOCK_P, BLOCK_D >> (i + 1), 2]), axis=2)
    return tl.sum(x, axis=1)  # [BLOCK_P, 1]: one term per row, exact


@triton.jit
def _group_score(acc, q_row, kmin_ptr, kmax_ptr, base, tile_mask, offs_d, d_mask, g, stride_qh,
                 GROUP: tl.constexpr, SUM_HEADS: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr,
                 LOG_D: tl.constexpr):
    """Fold one KV group's query heads into ``acc`` (heads in order: the reference's sum)."""
    mn = tl.load(kmin_ptr + base, mask=tile_mask, other=0.0).to(tl.float32)
    mx = tl.load(kmax_ptr + base, mask=tile_mask, other=0.0).to(tl.float32)
    for r in tl.static_range(GROUP):
        h = g * GROUP + r
        qv = tl.load(q_row + h * stride_qh + offs_d, mask=d_mask, other=0.0).to(tl.float32)
        s = _pair_sum(tl.maximum(qv[None, :] * mn, qv[None, :] * mx), BLOCK_P, BLOCK_D, LOG_D)
        if SUM_HEADS:
            acc = acc + s
        else:
            acc = tl.maximum(acc, s)
    return acc


@triton.jit
def _score_pages(q_row, kmin_ptr, kmax_ptr, req, offs_p, n, D, stride_qh, stride_kr, stride_kp, stride_kg,
                 HKV: tl.constexpr, GROUP: tl.constexpr, SUM_HEADS: tl.constexpr, BLOCK_P: tl.constexpr,
                 BLOCK_D: tl.constexpr, LOG_D: tl.constexpr, UNROLL: tl.constexpr):
    """Quest bound ``[BLOCK_P] float32`` of pages ``offs_p`` of request slot ``req`` (already
    clamped to a real slot), ``-inf`` for pages ``>= n`` (the row's live pages; 0 for a
    padding row). Shared by every kernel that scores pages: a page's value is the same bits
    wherever it is computed (heads in order, ``_pair_sum`` over D)."""
    offs_d = tl.arange(0, BLOCK_D)
    live_p = offs_p < n
    # Pages past the row's last one are masked out of every load, so a fixed grid
    # (CUDA-graph friendly) moves only the live pages' representation bytes.
    d_mask = offs_d < D
    tile_mask = live_p[:, None] & d_mask[None, :]
    if SUM_HEADS:
        acc = tl.zeros([BLOCK_P], dtype=tl.float32)
    else:
        acc = tl.full([BLOCK_P], float("-inf"), tl.float32)
    k_off = req * stride_kr + offs_p[:, None].to(tl.int64) * stride_kp + offs_d[None, :]
    if UNROLL:  # every group's loads issued up front: one memory latency per tile
        for g in tl.static_range(HKV):
            acc = _group_score(acc, q_row, kmin_ptr, kmax_ptr, k_off + g * stride_kg, tile_mask, offs_d, d_mask,
                               g, stride_qh, GROUP, SUM_HEADS, BLOCK_P, BLOCK_D, LOG_D)
    else:
        for g in range(HKV):
            acc = _group_score(acc, q_row, kmin_ptr, kmax_ptr, k_off + g * stride_kg, tile_mask, offs_d, d_mask,
                               g, stride_qh, GROUP, SUM_HEADS, BLOCK_P, BLOCK_D, LOG_D)
    return tl.where(live_p, acc, float("-inf"))


@triton.jit
def _row_pages(req_ptr, len_ptr, b, R, PAGE_SIZE):
    """``(slot, live pages)`` of batch row ``b``: the slot clamped to a real one, 0 pages for
    a padding (negative) or out-of-range slot."""
    req = tl.load(req_ptr + b).to(tl.int64)
    n = (tl.load(len_ptr + b).to(tl.int64) + PAGE_SIZE - 1) // PAGE_SIZE
    n = tl.where((req >= 0) & (req < R), n, 0)
    return tl.maximum(req, 0), n


@triton.jit
def _quest_score_kernel(
    q_ptr, kmin_ptr, kmax_ptr, req_ptr, len_ptr, out_ptr,
    R, P, D, PAGE_SIZE,
    stride_qb, stride_qh,
    stride_kr, stride_kp, stride_kg,
    stride_ob,
    HKV: tl.constexpr, GROUP: tl.constexpr, SUM_HEADS: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr, LOG_D: tl.constexpr, UNROLL: tl.constexpr,
):
    b = tl.program_id(0)
    pblk = tl.program_id(1)
    offs_p = pblk * BLOCK_P + tl.arange(0, BLOCK_P)
    req, n = _row_pages(req_ptr, len_ptr, b, R, PAGE_SIZE)
    acc = _score_pages(q_ptr + b * stride_qb, kmin_ptr, kmax_ptr, req, offs_p, n, D, stride_qh,
                       stride_kr, stride_kp, stride_kg, HKV, GROUP, SUM_HEADS, BLOCK_P, BLOCK_D, LOG_D, UNROLL)
    tl.store(out_ptr + b * stride_ob + offs_p, acc, mask=offs_p < P)


MAX_GRID_Y = 65535
"""CUDA's bound on a launch grid's second (and third) dimension."""


INTERPRETED_BLOCK_PAGES = 64
"""The score kernel's pages per program under the CPU interpreter (``block_p`` None)."""


def score_block_pages(pages: int, block_p: int) -> int:
    """Pages per program of the score kernel: ``block_p``, doubled until the grid's page
    blocks (its second dimension) stay within ``MAX_GRID_Y`` (past ``4 * 65535`` pages, a
    4M-token context at page size 16, the small-batch tiles would not launch)."""
    while -(-pages // block_p) > MAX_GRID_Y:
        block_p *= 2
    return block_p


def quest_score_triton(
    q: torch.Tensor,
    kmin: torch.Tensor,
    kmax: torch.Tensor,
    req_pool_indices: torch.Tensor,
    lengths: torch.Tensor,
    head_reduce: str = "sum",
    *,
    page_size: int = 1,
    block_p: Optional[int] = None,
    num_warps: Optional[int] = None,
    unroll: Optional[bool] = None,
) -> torch.Tensor:
    """Triton launcher (one launch); same arguments and result as
    :func:`quest_score_reference`. Index tensors are read in their dtype and q through its
    strides: no conversion launches. ``block_p`` pages per program (None: by batch, below;
    16 x 128-dim tiles fit in registers at 4 warps)."""
    _check(q, kmin, kmax, req_pool_indices, lengths, head_reduce, page_size)
    b, hq, d = q.shape
    # below a few dozen rows the grid is short and each program's latency counts: small
    # tiles with every group's loads issued up front (measured: docs/kernels.md)
    small = b < 32
    if block_p is None:  # under the interpreter, whose cost is mostly per program: few programs
        block_p = INTERPRETED_BLOCK_PAGES if interpreter_enabled() else (4 if small else 16)
    block_p = score_block_pages(kmin.shape[1], block_p)
    num_warps = num_warps if num_warps is not None else (2 if small else 4)
    unroll = unroll if unroll is not None else small
    r, p, hkv, _ = kmin.shape
    if kmin.stride(3) != 1 or kmax.stride() != kmin.stride():
        raise ValueError("kmin/kmax must share a layout with a contiguous last dim")
    if q.stride(2) != 1:
        q = q.contiguous()
    req = req_pool_indices.to(q.device)
    lens = lengths.to(q.device)
    out = torch.empty(b, p, dtype=torch.float32, device=q.device)
    if b == 0 or p == 0:
        return out
    grid = (b, cdiv(p, block_p))
    block_d = triton.next_power_of_2(d)
    _quest_score_kernel[grid](
        q, kmin, kmax, req, lens, out,
        r, p, d, page_size,
        q.stride(0), q.stride(1),
        kmin.stride(0), kmin.stride(1), kmin.stride(2),
        out.stride(0),
        HKV=hkv, GROUP=hq // hkv, SUM_HEADS=(head_reduce == "sum"),
        BLOCK_P=block_p, BLOCK_D=block_d, LOG_D=block_d.bit_length() - 1, UNROLL=bool(unroll), num_warps=num_warps,
    )
    return out


def quest_score(
    q: torch.Tensor,
    kmin: torch.Tensor,
    kmax: torch.Tensor,
    req_pool_indices: torch.Tensor,
    lengths: torch.Tensor,
    head_reduce: str = "sum",
    *,
    page_size: int = 1,
) -> torch.Tensor:
    """Quest page upper bounds ``[B, P] float32`` (Triton on CUDA, reference on CPU);
    arguments as :func:`quest_score_reference`."""
    impl = dispatch("quest_score", q, quest_score_triton, quest_score_reference)
    return impl(q, kmin, kmax, req_pool_indices, lengths, head_reduce, page_size=page_size)
