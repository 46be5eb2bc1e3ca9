"""Top-k selection split over several programs per row, for small batches.

``topk_select``'s kernel gives each row one program, which at batch 1 leaves one SM busy
for the whole select. Here a row's candidate range is cut into ``P`` chunks:

1. ``_chunk_topk_kernel`` (grid ``P x B``): each program loads one chunk into registers,
   radix-selects the chunk's own top ``min(top_k, selectable)`` and writes those keys and ids,
   in id order, to its slot of the work buffers with their count.
2. ``_merge_topk_kernel`` (grid ``B``): loads the ``P`` shortlists (chunk after chunk, so in
   id order), radix-selects the row's top ``top_k`` among them and writes the ids ascending.

Exactness: order candidates by (score descending, id ascending). An id among the row's top
``top_k`` has at most ``top_k - 1`` candidates before it in the whole row, so at most that
many in its chunk: every chunk's shortlist keeps it, and the merge sees the same order.
Results equal ``topk_select_reference``'s (ties to the lower id, ``-0.0 == +0.0``, -inf and
NaN never selected).

Both stages find their threshold with ``radix_select._select_threshold``, which stops once
the boundary digit is wholly taken (often 2 or 3 histogram passes instead of 4).
``sparsehi.kernels.quest_select`` fuses stage 1 with the Quest page bounds
(``_chunk_bounds`` / ``_shortlist_to_work`` are its stage-1 pieces; ``split_work`` /
``merge_shortlists`` its buffers and stage 2).

Registers bound the shapes: a chunk of at most ``MAX_CHUNK`` ids and ``P * next_pow2(top_k)``
merge entries at most ``MAX_MERGE``; ``split_plan`` says whether (and how) a shape splits.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl

from hicache.triton_support import cdiv
from sparsehi.kernels.radix_select import _emit, _order_keys, _select_threshold, _write_row

MAX_CHUNK = 4096
MAX_MERGE = 4096


def split_plan(batch: int, n: int, top_k: int, sms: int) -> Optional[tuple[int, int]]:
    """``(P, chunk)`` for a ``[batch, n]`` select of ``top_k``, or None when one program per
    row is the better (or the only possible) plan: enough rows to fill the GPU, a shortlist
    that would not shrink the candidates, or shapes past the register bounds. ``P`` balances
    the chunk (stage 1's work) against the merge's ``P * next_pow2(top_k)`` entries."""
    kp = triton.next_power_of_2(top_k)
    if batch >= sms or n <= 2 * kp:
        return None
    p = triton.next_power_of_2(math.ceil(math.sqrt(n / kp)))
    while p > 1 and (p * kp > MAX_MERGE or batch * p > 2 * sms):
        p //= 2
    chunk = triton.next_power_of_2(cdiv(n, p))
    if p < 2 or chunk > MAX_CHUNK or chunk <= kp:
        return None
    return p, chunk


@triton.jit
def _chunk_bounds(cs_ptr, ce_ptr, mask_ptr, b, N, HAS_ROW_MASK: tl.constexpr):
    """Row ``b``'s candidate range ``[lo, hi)``, clipped to ``[0, N]`` (empty for a masked row)."""
    lo = tl.minimum(tl.maximum(tl.load(cs_ptr + b).to(tl.int64), 0), N)
    hi = tl.minimum(tl.maximum(tl.load(ce_ptr + b).to(tl.int64), lo), N)
    if HAS_ROW_MASK:
        hi = tl.where(tl.load(mask_ptr + b) != 0, hi, lo)
    return lo, hi


@triton.jit
def _shortlist_to_work(key, offs, TOP_K, wkey_ptr, wid_ptr, wcount_ptr, b, c, P: tl.constexpr, KP: tl.constexpr):
    """Stage 1's output for chunk ``c`` of row ``b``: the top ``min(TOP_K, selectable)`` of
    ``key`` (``_order_keys`` of the chunk, ids ``offs`` ascending) written in id order to the
    chunk's slot of the work buffers, with their count."""
    count = tl.sum((key != 0).to(tl.int32), 0)
    k_loc = tl.minimum(count, TOP_K)
    thr, need = _select_threshold(key, k_loc, count)
    thr = tl.where(k_loc > 0, thr, 0xFFFFFFFF)
    slot = (b * P + c) * KP
    _, n_out = _emit(wid_ptr + slot, key, offs.to(tl.int32), thr, need, 0, 0)
    # the same selection again for the keys (an _emit of the keys as values)
    _emit(wkey_ptr + slot, key, key.to(tl.int32, bitcast=True), thr, need, 0, 0)
    tl.store(wcount_ptr + b * P + c, n_out)


@triton.jit
def _chunk_topk_kernel(s_ptr, cs_ptr, ce_ptr, mask_ptr, wkey_ptr, wid_ptr, wcount_ptr,
                       N, TOP_K, stride_sb,
                       HAS_ROW_MASK: tl.constexpr, P: tl.constexpr, CHUNK: tl.constexpr, KP: tl.constexpr):
    c = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    lo, hi = _chunk_bounds(cs_ptr, ce_ptr, mask_ptr, b, N, HAS_ROW_MASK)
    offs = lo + c * CHUNK + tl.arange(0, CHUNK)
    inr = offs < hi
    key = _order_keys(tl.load(s_ptr + b * stride_sb + offs, mask=inr, other=float("-inf")), inr)
    _shortlist_to_work(key, offs, TOP_K, wkey_ptr, wid_ptr, wcount_ptr, b, c, P, KP)


@triton.jit
def _merge_topk_kernel(wkey_ptr, wid_ptr, wcount_ptr, ids_ptr, valid_ptr, TOP_K, stride_ib,
                       P: tl.constexpr, KP: tl.constexpr, OUT_BLOCK: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, P * KP)
    cnt = tl.load(wcount_ptr + b * P + j // KP)
    inl = (j % KP) < cnt
    base = b * P * KP
    key = tl.load(wkey_ptr + base + j, mask=inl, other=0).to(tl.uint32, bitcast=True)
    ids = tl.load(wid_ptr + base + j, mask=inl, other=-1)
    count = tl.sum(inl.to(tl.int32), 0)  # shortlisted keys are all selectable
    k_eff = tl.minimum(count, TOP_K)
    thr, need = _select_threshold(key, k_eff, count)
    thr = tl.where(k_eff > 0, thr, 0xFFFFFFFF)
    _write_row(ids_ptr + b * stride_ib, valid_ptr, b, key, ids, thr, need, TOP_K, OUT_BLOCK)


def select_outputs(scores: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``scores`` with unit column stride, and empty ``ids [B, top_k]`` / ``valid [B]`` int32
    outputs on its device (both select launchers)."""
    if scores.stride(1) != 1:
        scores = scores.contiguous()
    b = scores.shape[0]
    return (scores, torch.empty(b, top_k, dtype=torch.int32, device=scores.device),
            torch.empty(b, dtype=torch.int32, device=scores.device))


def check_plan(plan: tuple[int, int], n: int, top_k: int) -> int:
    """Raise ValueError unless ``plan = (P, chunk)`` covers ``n`` ids within the register
    bounds; returns the shortlist slot size ``next_pow2(top_k)``."""
    p, chunk = plan
    if p < 1 or chunk < 1 or p * chunk < n or chunk > MAX_CHUNK or chunk & (chunk - 1):
        raise ValueError(f"plan={plan} does not cover N={n} ids with power-of-two chunks of at most {MAX_CHUNK}")
    kp = triton.next_power_of_2(top_k)
    if p * kp > MAX_MERGE:
        raise ValueError(f"plan={plan} merges {p} x {kp} > {MAX_MERGE} entries: use fewer chunks")
    return kp


def topk_select_split(scores: torch.Tensor, top_k: int, candidate_start: torch.Tensor, candidate_end: torch.Tensor,
                      row_mask: Optional[torch.Tensor], plan: tuple[int, int],
                      num_warps: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """Two launches (see the module docstring) with ``plan = (P, chunk)`` from
    ``split_plan``; arguments and results as ``topk_select`` (checked by its caller)."""
    p, chunk = plan
    bsz, n = scores.shape
    kp = check_plan(plan, n, top_k)
    dev = scores.device
    scores, ids, valid = select_outputs(scores, top_k)
    if bsz == 0:
        return ids, valid
    work, wcount = split_work(bsz, p, kp, dev)
    cs, ce = candidate_start.to(dev), candidate_end.to(dev)
    mask = row_mask.to(dev) if row_mask is not None else valid  # dummy pointer when unused
    _chunk_topk_kernel[(p, bsz)](
        scores, cs, ce, mask, work[0], work[1], wcount, n, top_k, scores.stride(0),
        HAS_ROW_MASK=row_mask is not None, P=p, CHUNK=chunk, KP=kp, num_warps=num_warps,
    )
    merge_shortlists(work, wcount, ids, valid, top_k, num_warps)
    return ids, valid


def split_work(bsz: int, p: int, kp: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Stage 1's work buffers: ``work [2, B, P, KP] int32`` (keys, then ids, of every chunk's
    shortlist) and ``wcount [B, P] int32``; every entry is written before it is read."""
    return (torch.empty(2, bsz, p, kp, dtype=torch.int32, device=device),
            torch.empty(bsz, p, dtype=torch.int32, device=device))


def merge_shortlists(work: torch.Tensor, wcount: torch.Tensor, ids: torch.Tensor, valid: torch.Tensor, top_k: int,
                     num_warps: int = 4) -> None:
    """Stage 2 (one launch, one program per row): the row's top ``top_k`` of the chunk
    shortlists in ``work`` / ``wcount`` (from ``split_work``, filled by stage 1), written
    to ``ids [B, top_k]`` ascending, ``-1`` padded, and ``valid [B]``."""
    _, bsz, p, kp = work.shape
    _merge_topk_kernel[(bsz,)](
        work[0], work[1], wcount, ids, valid, top_k, ids.stride(0),
        P=p, KP=kp, OUT_BLOCK=min(1024, kp), num_warps=num_warps,
    )
