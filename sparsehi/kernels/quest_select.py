"""Quest page selection, and an optional fused path for small batches.

``quest_retrieve`` scores the pages (``quest_score``) and selects among them
(``topk_select``; at a small batch that is the chunk shortlists of ``topk_split`` and the
merge). With ``fused=True`` it runs two launches instead: ``_quest_chunk_topk_kernel``
(grid ``P x B``, one program per chunk of a row's candidate range) scores its chunk's
pages, tile by tile, into a scratch row, reads them back and writes the chunk's shortlist
to the work buffers of the split select, and the merge follows.

The fused path is an option, off by default: it measured slower on an H100 (18.5 us
against 12.3 us per call at a 2048-page, 2 KV-head x 32 shape at B = 2, 193 us against
20 us at the Llama-8B shape; docs/kernels.md), because the score kernel spreads the bound
loads over ``B x P / 4`` programs and the fused one over ``B x P_chunks``. Its plan is
``topk_split.split_plan``'s, capped at ``FUSED_MAX_CHUNK_BYTES`` of bounds per program.

Exactness: a page's bound is computed by the same helper as ``quest_score``'s
(``quest_score._score_pages``: heads in order, a fixed pairwise sum over D that no tiling
or layout changes), so the fused scores are ``quest_score``'s float32 bits, and the
shortlist and merge are the split select's: ids, valid lengths and tie-breaks (lower id)
equal ``quest_score`` + ``topk_select``.

Entry points: ``quest_retrieve`` (dispatch), ``quest_select_plan``, ``quest_select_split``
(the fused path's two launches).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from hicache.triton_support import announce_path, cdiv, sm_count, use_triton
from sparsehi.kernels.quest_score import _check, _row_pages, _score_pages, quest_score
from sparsehi.kernels.radix_select import _order_keys
from sparsehi.kernels.topk import _check_select_args, topk_select
from sparsehi.kernels.topk_split import (_chunk_bounds, _shortlist_to_work, check_plan, merge_shortlists,
                                         select_outputs, split_plan, split_work)

# Bounds one fused program may read (its chunk's pages x 2 x Hkv x D x element size): a
# chunk of megabytes on one SM reads several times slower than the score kernel's full grid.
FUSED_MAX_CHUNK_BYTES = 256 * 1024
# [pages, D] elements per score tile and group; every group's tile is loaded up front when
# the groups' tiles together stay under UNROLL_ELEMS (registers at 4 warps)
TILE_ELEMS = 2048
UNROLL_ELEMS = 8192


@triton.jit
def _quest_chunk_topk_kernel(
    q_ptr, kmin_ptr, kmax_ptr, req_ptr, len_ptr, cs_ptr, ce_ptr, mask_ptr, s_ptr, wkey_ptr, wid_ptr, wcount_ptr,
    R, N, D, PAGE_SIZE, TOP_K,
    stride_qb, stride_qh, stride_kr, stride_kp, stride_kg, stride_sb,
    HKV: tl.constexpr, GROUP: tl.constexpr, SUM_HEADS: tl.constexpr, BLOCK_P: tl.constexpr,
    BLOCK_D: tl.constexpr, LOG_D: tl.constexpr, UNROLL: tl.constexpr,
    HAS_ROW_MASK: tl.constexpr, P: tl.constexpr, CHUNK: tl.constexpr, KP: tl.constexpr,
):
    c = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    lo, hi = _chunk_bounds(cs_ptr, ce_ptr, mask_ptr, b, N, HAS_ROW_MASK)
    req, n = _row_pages(req_ptr, len_ptr, b, R, PAGE_SIZE)
    start = lo + c * CHUNK
    end = tl.minimum(start + CHUNK, hi)
    # Pages past the row's live ones score -inf: no tile for them (the read-back below
    # masks them to -inf), and no load past the chunk's end.
    live_end = tl.minimum(end, n)
    row = s_ptr + b * stride_sb
    q_row = q_ptr + b * stride_qb
    for t in range(start, live_end, BLOCK_P):
        offs_p = t + tl.arange(0, BLOCK_P)
        acc = _score_pages(q_row, kmin_ptr, kmax_ptr, req, offs_p, live_end, D, stride_qh,
                           stride_kr, stride_kp, stride_kg, HKV, GROUP, SUM_HEADS, BLOCK_P, BLOCK_D, LOG_D, UNROLL)
        tl.store(row + offs_p, acc, mask=offs_p < live_end)
    tl.debug_barrier()  # the scores are read back by other threads of this program
    offs = start + tl.arange(0, CHUNK)
    inr = offs < hi
    s = tl.load(row + offs, mask=offs < live_end, other=float("-inf"), cache_modifier=".cg")
    _shortlist_to_work(_order_keys(s, inr), offs, TOP_K, wkey_ptr, wid_ptr, wcount_ptr, b, c, P, KP)


def quest_select_plan(batch: int, pages: int, top_k: int, sms: int, page_bytes: int) -> Optional[tuple[int, int]]:
    """``(P, chunk)`` for the fused select of ``top_k`` among ``pages`` per row, or None
    (score and select apart): ``split_plan``'s plan while a chunk's bounds
    (``chunk x page_bytes``, ``page_bytes = 2 x Hkv x D x element size``) stay within
    ``FUSED_MAX_CHUNK_BYTES``."""
    plan = split_plan(batch, pages, top_k, sms)
    if plan is None or plan[1] * page_bytes > FUSED_MAX_CHUNK_BYTES:
        return None
    return plan


def quest_select_split(
    q: torch.Tensor,
    kmin: torch.Tensor,
    kmax: torch.Tensor,
    req_pool_indices: torch.Tensor,
    lengths: torch.Tensor,
    head_reduce: str,
    page_size: int,
    top_k: int,
    candidate_start: torch.Tensor,
    candidate_end: torch.Tensor,
    row_mask: Optional[torch.Tensor],
    plan: tuple[int, int],
    *,
    num_warps: int = 4,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Two launches (module docstring) with ``plan = (P, chunk)`` (any plan that covers
    the pages: the result does not depend on it). Arguments as :func:`quest_retrieve`;
    returns what ``topk_select(quest_score(...), ...)`` returns, bit for bit."""
    _check(q, kmin, kmax, req_pool_indices, lengths, head_reduce, page_size)
    b, hq, d = q.shape
    r, n, hkv, _ = kmin.shape
    dev = q.device
    # the page scores, written and read back by the fused kernel only
    scratch = torch.empty(b, n, dtype=torch.float32, device=dev)
    _check_select_args(scratch, top_k, candidate_start, candidate_end, row_mask)
    kp = check_plan(plan, n, top_k)
    p, chunk = plan
    if kmin.stride(3) != 1 or kmax.stride() != kmin.stride():
        raise ValueError("kmin/kmax must share a layout with a contiguous last dim")
    if q.stride(2) != 1:
        q = q.contiguous()
    scratch, ids, valid = select_outputs(scratch, top_k)
    if b == 0:
        return ids, valid
    work, wcount = split_work(b, p, kp, dev)
    block_d = triton.next_power_of_2(d)
    block_p = max(1, min(chunk, TILE_ELEMS // block_d))
    mask = row_mask.to(dev) if row_mask is not None else valid  # dummy pointer when unused
    _quest_chunk_topk_kernel[(p, b)](
        q, kmin, kmax, req_pool_indices.to(dev), lengths.to(dev), candidate_start.to(dev), candidate_end.to(dev), mask,
        scratch, work[0], work[1], wcount,
        r, n, d, page_size, top_k,
        q.stride(0), q.stride(1), kmin.stride(0), kmin.stride(1), kmin.stride(2), scratch.stride(0),
        HKV=hkv, GROUP=hq // hkv, SUM_HEADS=(head_reduce == "sum"), BLOCK_P=block_p, BLOCK_D=block_d,
        LOG_D=block_d.bit_length() - 1, UNROLL=hkv * block_p * block_d <= UNROLL_ELEMS,
        HAS_ROW_MASK=row_mask is not None, P=p, CHUNK=chunk, KP=kp, num_warps=num_warps,
    )
    merge_shortlists(work, wcount, ids, valid, top_k, num_warps)
    return ids, valid


def quest_retrieve(
    q: torch.Tensor,
    kmin: torch.Tensor,
    kmax: torch.Tensor,
    req_pool_indices: torch.Tensor,
    lengths: torch.Tensor,
    head_reduce: str,
    page_size: int,
    top_k: int,
    candidate_start: torch.Tensor,
    candidate_end: torch.Tensor,
    row_mask: Optional[torch.Tensor] = None,
    *,
    fused: Optional[bool] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top ``top_k`` pages per row by the Quest bound, in ascending page order.

    q, kmin, kmax, req_pool_indices, lengths, head_reduce, page_size: as
    :func:`sparsehi.kernels.quest_score.quest_score_reference` (pages past
    ``ceil(lengths / page_size)`` and padding rows are never selected).
    top_k, candidate_start, candidate_end, row_mask: as
    :func:`sparsehi.kernels.topk.topk_select` over the ``[B, P]`` page scores.
    fused: None / False score and select apart (the default: faster on the GPU, module
    docstring); True fuses (Triton only) with ``quest_select_plan``'s plan, else
    ``split_plan``'s, or two chunks when that has none.

    Returns ``(ids [B, top_k] int32`` ascending, ``-1`` padded, ``valid [B] int32)``, equal
    to ``topk_select(quest_score(...), ...)`` on every path.
    """
    if use_triton(q) and fused:
        n, hkv, d = kmin.shape[1:]
        sms = sm_count(q.device)
        plan = quest_select_plan(q.shape[0], n, top_k, sms, 2 * hkv * d * kmin.element_size())
        if plan is None:
            # two chunks when there is no GPU to size a plan by
            plan = split_plan(q.shape[0], n, top_k, sms) or (2, triton.next_power_of_2(cdiv(max(n, 2), 2)))
        announce_path("quest_select", "triton-fused")
        return quest_select_split(q, kmin, kmax, req_pool_indices, lengths, head_reduce, page_size, top_k,
                                  candidate_start, candidate_end, row_mask, plan)
    scores = quest_score(q, kmin, kmax, req_pool_indices, lengths, head_reduce, page_size=page_size)
    return topk_select(scores, top_k, candidate_start, candidate_end, row_mask)
