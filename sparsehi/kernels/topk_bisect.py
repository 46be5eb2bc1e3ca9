"""Top-k of a row held in registers, its threshold found bit by bit (``topk_select_bisect``).

One program per row loads the row's candidate range into registers as ``uint32`` keys
(``radix_select._order_keys``) and finds the threshold key by bisection on its bits:
starting below the bits every candidate shares, bit ``b`` is kept when at least ``k`` keys
are ``>=`` the prefix with it set, where ``k = min(top_k, selectable)``. A step is one
compare and one block-wide sum per key, with no histogram. The search stops early once
exactly ``k`` keys lie at or above the prefix (they are then the selection, without
ties); otherwise the prefix ends as the ``k``-th largest key. ``radix_select._emit`` then
writes the ids above the threshold and its first ties in id order (``_write_row``), as
every launcher of ``topk_select`` does, so results equal ``topk_select_reference``'s.

Registers bound the row: ``BLOCK = next_pow2(N)`` ids, 32 a thread, at most ``MAX_BLOCK``.
``topk.bisect_plan`` says where the dispatch takes this kernel.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from sparsehi.kernels.radix_select import _order_keys, _shared_bits, _write_row
from sparsehi.kernels.topk_split import _chunk_bounds, select_outputs

MAX_BLOCK = 32768
"""Ids a program holds in registers (32 keys a thread at 32 warps)."""


@triton.jit
def _count_at_least(keys, cand):
    return tl.sum((keys >= cand).to(tl.int32), 0)


@triton.jit
def _topk_bisect_kernel(
    s_ptr, cs_ptr, ce_ptr, mask_ptr, ids_ptr, valid_ptr,
    N, TOP_K, stride_sb, stride_ib,
    HAS_ROW_MASK: tl.constexpr, BLOCK: tl.constexpr, OUT_BLOCK: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    lo, hi = _chunk_bounds(cs_ptr, ce_ptr, mask_ptr, b, N, HAS_ROW_MASK)
    lo = lo.to(tl.int32)
    hi = hi.to(tl.int32)
    row = s_ptr + b * stride_sb
    # the range [lo, hi) lies in [0, N) and N <= BLOCK: one block from lo holds it
    offs = lo + tl.arange(0, BLOCK)
    inr = offs < hi
    keys = _order_keys(tl.load(row + offs, mask=inr, other=float("-inf")), inr)
    ok = keys != 0
    count = tl.sum(ok.to(tl.int32), 0)
    k = tl.minimum(count, TOP_K)
    # every candidate lies in [kmin, kmax], so the threshold shares their common high bits
    prefix, known_lo = _shared_bits(tl.min(tl.where(ok, keys, 0xFFFFFFFF), 0), tl.max(keys, 0))
    # thr / need for _emit: every key > thr, plus the first `need` keys == thr
    take_all = count <= TOP_K
    thr = tl.where(take_all, 0, 0xFFFFFFFF).to(tl.uint32)
    need = tl.full([], 0, tl.int32)
    bit = tl.where(take_all, -1, known_lo - 1)
    while bit >= 0:
        cand = prefix | (tl.full([], 1, tl.uint32) << bit.to(tl.uint32))
        c = _count_at_least(keys, cand)
        prefix = tl.where(c >= k, cand, prefix)
        # exactly k keys at or above cand: they are the selection, without ties
        thr = tl.where(c == k, cand - 1, thr)
        bit = tl.where(c == k, -1, bit - 1)
    if thr == 0xFFFFFFFF:
        # prefix is the k-th largest key: take it and as many of its ties as fall short
        thr = prefix
        need = k - _count_at_least(keys, prefix + 1)
    _write_row(ids_ptr + b * stride_ib, valid_ptr, b, keys, offs, thr, need, TOP_K, OUT_BLOCK)


def bisect_num_warps(block: int) -> int:
    """Warps of a ``block``-id program: 32 keys a thread, 4 to 32 warps."""
    return max(4, min(32, block // 1024))


def topk_select_bisect(
    scores: torch.Tensor,
    top_k: int,
    candidate_start: torch.Tensor,
    candidate_end: torch.Tensor,
    row_mask: Optional[torch.Tensor] = None,
    *,
    num_warps: Optional[int] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`sparsehi.kernels.topk.topk_select` by one program per row holding the row's
    ``N <= MAX_BLOCK`` ids in registers (module docstring): one launch, same arguments and
    results (checked by ``topk_select_triton``, which dispatches here). ``num_warps``: 4, 8,
    16 or 32, by default ``bisect_num_warps(next_pow2(N))``."""
    bsz, n = scores.shape
    if n > MAX_BLOCK:
        raise ValueError(f"scores of N={n} ids: topk_select_bisect holds rows of at most {MAX_BLOCK} ids")
    block = max(1024, triton.next_power_of_2(max(n, 1)))
    if num_warps is None:
        num_warps = bisect_num_warps(block)
    if num_warps not in (4, 8, 16, 32):
        raise ValueError(f"num_warps={num_warps!r} is invalid: one of 4, 8, 16, 32")
    scores, ids, valid = select_outputs(scores, top_k)
    if bsz == 0:
        return ids, valid
    dev = scores.device
    cs, ce = candidate_start.to(dev), candidate_end.to(dev)
    mask = row_mask.to(dev) if row_mask is not None else valid  # dummy pointer when unused
    _topk_bisect_kernel[(bsz,)](
        scores, cs, ce, mask, ids, valid, n, top_k, scores.stride(0), ids.stride(0),
        HAS_ROW_MASK=row_mask is not None, BLOCK=block, OUT_BLOCK=min(2048, triton.next_power_of_2(top_k)),
        num_warps=num_warps,
    )
    return ids, valid
