"""Top-k of long rows: a floor from a sample, the ids at or above it kept by many programs
at once, then one program per row selecting among them (``topk_select``'s path for rows of
tens of thousands of ids, where one program per row spends most of its time walking the row).

1. ``_floor_filter_kernel`` (grid ``P x B``, one chunk of ``CHUNK`` ids per program): every
   program of a row derives the same floor from the row's strided sample of ``SAMPLE``
   candidates (their key of rank about ``1.25 top_k / stride``, so that about ``1.25
   top_k`` ids of the row are at or above it; 1, i.e. every selectable id, when the sample
   is the whole range), keeps its chunk's selectable ids whose key is at or above the floor,
   in id order, in the chunk's own slot of the work buffer, and writes the count kept, the
   chunk's selectable count, its largest selectable key and the floor.
2. ``_select_filtered_kernel`` (grid ``B``): the chunks' lists, read in chunk order, are the
   row's shortlist in id order (list position ``j`` maps to its chunk by the counts'
   prefix sums). If the shortlist holds fewer than ``min(top_k, selectable)`` ids (the
   floor was above that rank: an unrepresentative sample), the program shortlists every
   selectable id itself, in one pass over the row. It then radix-selects the threshold
   key among the shortlist (8-bit digits below the bits floor and largest key share) and
   writes the ids above it and its first ties, ascending.

Exactness: the shortlist holds every id whose key is at or above the floor, and at least
``min(top_k, selectable)`` of them, so every id of the row's top set is in it; read in id
order, ties go to the lower id. Results equal ``topk_select_reference``'s.

Registers bound the shapes: ``P`` chunks at most ``MAX_CHUNKS`` (the list-position map is a
``[LIST_BLOCK, P]`` compare), ``floor_plan`` picks the chunk.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from hicache.triton_support import cdiv
from sparsehi.kernels.radix_select import _emit, _high_bits, _order_keys, _refine, _shared_bits, _threshold_in_registers
from sparsehi.kernels.topk_split import _chunk_bounds, select_outputs

MAX_CHUNKS = 64
MIN_IDS = 16384
"""Rows shorter than this keep the other paths (``floor_plan`` returns None)."""
LIST_PAD = tl.constexpr(1 << 30)  # prefix of the padding chunks: past every list position


def floor_plan(batch: int, n: int, top_k: int, sms: int, chunk: Optional[int] = None) -> Optional[tuple[int, int]]:
    """``(P, chunk)`` for a ``[batch, n]`` select of ``top_k``, or None where the other paths
    are meant (rows under ``MIN_IDS``, no GPU to size by, a ``top_k`` near the row). The
    chunk is a power of two of at least 2048 ids, large enough that a row has at most
    ``MAX_CHUNKS`` and the launch at most about ``2 * sms`` programs."""
    if sms <= 0 or n < MIN_IDS or 4 * top_k > n:
        return None
    if chunk is None:
        per_row = max(1, min(MAX_CHUNKS, (2 * sms) // max(1, batch)))
        chunk = max(2048, triton.next_power_of_2(cdiv(n, per_row)))
    p = cdiv(n, chunk)
    if p > MAX_CHUNKS or chunk & (chunk - 1):
        return None
    return p, chunk


@triton.jit
def _sample_floor(row, lo, hi, TOP_K, SAMPLE: tl.constexpr):
    """The floor key of a row's candidates ``[lo, hi)``: the key of rank about ``1.25 TOP_K /
    stride + 16`` among every ``stride``-th candidate (``stride = ceil(range / SAMPLE)``),
    or 1 (every selectable key) when the sample is the whole range or holds none."""
    stride = tl.maximum((hi - lo + SAMPLE - 1) // SAMPLE, 1)
    sid = lo + tl.arange(0, SAMPLE).to(tl.int64) * stride
    sin = sid < hi
    skey = _order_keys(tl.load(row + sid, mask=sin, other=float("-inf")), sin)
    s_count = tl.sum((skey != 0).to(tl.int32), 0)
    want = tl.minimum((TOP_K * 5 + stride * 4 - 1) // (stride * 4) + 16, s_count).to(tl.int32)
    t0, _ = _threshold_in_registers(skey, want)
    one = tl.full([], 1, tl.uint32)
    return tl.where((want > 0) & (stride > 1), t0, one)


@triton.jit
def _keep_block(row, wkey, wid, offs, lo, hi, floor, m, count, kmax):
    """Append the block's selectable ids ``offs`` with a key ``>= floor`` (and their keys),
    in id order, at list position ``m``; count every selectable id and track the largest
    selectable key."""
    inr = (offs >= lo) & (offs < hi)
    key = _order_keys(tl.load(row + offs, mask=inr, other=float("-inf")), inr)
    ok = key != 0
    keep = ok & (key >= floor)
    ki = keep.to(tl.int32)
    at = m + tl.cumsum(ki, 0) - ki
    tl.store(wkey + at, key.to(tl.int32, bitcast=True), mask=keep)
    tl.store(wid + at, offs.to(tl.int32), mask=keep)
    return m + tl.sum(ki, 0), count + tl.sum(ok.to(tl.int32), 0), tl.maximum(kmax, tl.max(key, 0))


@triton.jit
def _floor_filter_kernel(s_ptr, cs_ptr, ce_ptr, mask_ptr, wkey_ptr, wid_ptr, stats_ptr,
                         N, TOP_K, stride_sb,
                         HAS_ROW_MASK: tl.constexpr, P: tl.constexpr, SAMPLE: tl.constexpr,
                         CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    c = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    lo, hi = _chunk_bounds(cs_ptr, ce_ptr, mask_ptr, b, N, HAS_ROW_MASK)
    row = s_ptr + b * stride_sb
    floor = _sample_floor(row, lo, hi, TOP_K, SAMPLE)
    slot = b * (P * CHUNK) + c * CHUNK
    m = tl.full([], 0, tl.int32)
    count = tl.full([], 0, tl.int32)
    kmax = tl.full([], 0, tl.uint32)
    offs_blk = tl.arange(0, BLOCK).to(tl.int64)
    for start in tl.static_range(0, CHUNK, BLOCK):
        m, count, kmax = _keep_block(row, wkey_ptr + slot, wid_ptr + slot, c * CHUNK + start + offs_blk, lo, hi,
                                     floor, m, count, kmax)
    st = stats_ptr + b * (4 * P) + c
    tl.store(st, m)
    tl.store(st + P, count)
    tl.store(st + 2 * P, kmax.to(tl.int32, bitcast=True))
    tl.store(st + 3 * P, floor.to(tl.int32, bitcast=True))


@triton.jit
def _list_address(j, prefix, redo, CHUNK: tl.constexpr):
    """Work-buffer offset (within the row) of shortlist position ``j [LIST_BLOCK]``: in the
    chunk whose list starts last at or before ``j`` (``prefix [PB]``: each chunk's first
    position, ``LIST_PAD`` for padding chunks; an empty chunk shares its start with the next
    one, which wins), or ``j`` itself once the row was shortlisted whole (``redo``)."""
    le = prefix[None, :] <= j[:, None]
    c = tl.sum(le.to(tl.int32), 1) - 1
    start = tl.max(tl.where(le, prefix[None, :], 0), 1)
    return tl.where(redo, j, c.to(tl.int64) * CHUNK + (j - start))


@triton.jit
def _select_filtered_kernel(s_ptr, cs_ptr, ce_ptr, mask_ptr, wkey_ptr, wid_ptr, stats_ptr, ids_ptr, valid_ptr,
                            N, TOP_K, stride_sb, stride_ib,
                            HAS_ROW_MASK: tl.constexpr, P: tl.constexpr, PB: tl.constexpr, CHUNK: tl.constexpr,
                            BLOCK: tl.constexpr, LIST_BLOCK: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    lo, hi = _chunk_bounds(cs_ptr, ce_ptr, mask_ptr, b, N, HAS_ROW_MASK)
    cidx = tl.arange(0, PB)
    cin = cidx < P
    st = stats_ptr + b * (4 * P) + cidx
    cnt = tl.load(st, mask=cin, other=0)
    count = tl.sum(tl.load(st + P, mask=cin, other=0), 0)
    lmax = tl.max(tl.load(st + 2 * P, mask=cin, other=0).to(tl.uint32, bitcast=True), 0)
    floor = tl.load(stats_ptr + b * (4 * P) + 3 * P).to(tl.uint32, bitcast=True)
    m = tl.sum(cnt, 0)
    prefix = tl.where(cin, tl.cumsum(cnt, 0) - cnt, LIST_PAD)
    k_eff = tl.minimum(count, TOP_K)
    wkey = wkey_ptr + b * (P * CHUNK)
    wid = wid_ptr + b * (P * CHUNK)
    row = s_ptr + b * stride_sb
    # the floor was above rank k_eff: shortlist every selectable id of the row instead
    redo = m < k_eff
    one = tl.full([], 1, tl.uint32)
    floor = tl.where(redo, one, floor)
    m = tl.where(redo, 0, m)
    offs_blk = tl.arange(0, BLOCK).to(tl.int64)
    start0 = (lo // BLOCK) * BLOCK
    kmax = tl.full([], 0, tl.uint32)
    seen = tl.full([], 0, tl.int32)
    for start in range(start0, tl.where(redo, hi, start0), BLOCK):
        m, seen, kmax = _keep_block(row, wkey, wid, start + offs_blk, lo, hi, floor, m, seen, kmax)
    tl.debug_barrier()  # the whole-row shortlist is read back by other threads of this program
    # radix select over the shortlist (its keys lie in [floor, lmax])
    prefix_bits, known_lo = _shared_bits(floor, lmax)
    known_lo = tl.where(k_eff > 0, known_lo, 0)
    need = k_eff
    offs_lst = tl.arange(0, LIST_BLOCK)
    for _ in tl.static_range(4):
        hb = _high_bits(known_lo)
        shift = tl.maximum(known_lo - 8, 0).to(tl.uint32)
        hist = tl.zeros([256], dtype=tl.int32)
        for start in range(0, tl.where(known_lo > 0, m, 0), LIST_BLOCK):
            j = start + offs_lst
            addr = _list_address(j, prefix, redo, CHUNK)
            key = tl.load(wkey + addr, mask=j < m, other=0).to(tl.uint32, bitcast=True)
            match = (key != 0) & ((key & hb) == (prefix_bits & hb))
            hist += tl.histogram(((key >> shift) & 255).to(tl.int32), 256, mask=match)
        prefix_bits, known_lo, need = _refine(hist, prefix_bits, known_lo, need)
    thr = tl.where(k_eff > 0, prefix_bits, 0xFFFFFFFF)
    out = ids_ptr + b * stride_ib
    ties = tl.full([], 0, tl.int32)
    n_out = tl.full([], 0, tl.int32)
    for start in range(0, m, LIST_BLOCK):
        j = start + offs_lst
        inl = j < m
        addr = _list_address(j, prefix, redo, CHUNK)
        key = tl.load(wkey + addr, mask=inl, other=0).to(tl.uint32, bitcast=True)
        ids = tl.load(wid + addr, mask=inl, other=-1)
        ties, n_out = _emit(out, key, ids, thr, need, ties, n_out)
    for start in range(0, TOP_K, LIST_BLOCK):
        o = start + offs_lst
        tl.store(out + o, tl.full([LIST_BLOCK], -1, tl.int32), mask=(o >= n_out) & (o < TOP_K))
    tl.store(valid_ptr + b, n_out)


def topk_select_floor(scores: torch.Tensor, top_k: int, candidate_start: torch.Tensor, candidate_end: torch.Tensor,
                      row_mask: Optional[torch.Tensor], plan: tuple[int, int], *, sample: int = 1024,
                      block: int = 2048, list_block: int = 1024, num_warps: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Two launches (module docstring) with ``plan = (P, chunk)`` from ``floor_plan``;
    arguments and results as ``topk_select`` (checked by its caller). sample / block (ids per
    step of a chunk, at most the chunk) / list_block (shortlist entries per step): powers
    of two >= 16."""
    p, chunk = plan
    bsz, n = scores.shape
    for name, v in (("sample", sample), ("block", block), ("list_block", list_block), ("chunk", chunk)):
        if not isinstance(v, int) or v < 16 or v & (v - 1):
            raise ValueError(f"{name}={v!r} is invalid: a power of two >= 16")
    if not (1 <= p <= MAX_CHUNKS) or p * chunk < n:
        raise ValueError(f"plan={plan} does not cover N={n} ids in at most {MAX_CHUNKS} chunks")
    block = min(block, chunk)
    scores, ids, valid = select_outputs(scores, top_k)
    if bsz == 0:
        return ids, valid
    dev = scores.device
    work = torch.empty(2, bsz, p * chunk, dtype=torch.int32, device=dev)
    stats = torch.empty(bsz, 4, p, dtype=torch.int32, device=dev)
    cs, ce = candidate_start.to(dev), candidate_end.to(dev)
    mask = row_mask.to(dev) if row_mask is not None else valid  # dummy pointer when unused
    _floor_filter_kernel[(p, bsz)](
        scores, cs, ce, mask, work[0], work[1], stats, n, top_k, scores.stride(0),
        HAS_ROW_MASK=row_mask is not None, P=p, SAMPLE=sample, CHUNK=chunk, BLOCK=block, num_warps=num_warps,
    )
    _select_filtered_kernel[(bsz,)](
        scores, cs, ce, mask, work[0], work[1], stats, ids, valid, n, top_k, scores.stride(0), ids.stride(0),
        HAS_ROW_MASK=row_mask is not None, P=p, PB=max(2, triton.next_power_of_2(p)), CHUNK=chunk, BLOCK=block,
        LIST_BLOCK=list_block, num_warps=num_warps,
    )
    return ids, valid
