"""Top-k selection of long rows by one radix select spread over the row's chunks.

``topk_select``'s one program per row is bound by one SM for the whole row; the chunk
shortlists of ``topk_split`` need chunks longer than ``top_k``, so a top 2048 of 32768
(DeepSeek-V3.2's indexer) stays on one program per row. Here each row is cut into ``P``
chunks of ``CHUNK`` ids and every launch but one has a grid of ``P x B`` programs:

1. ``_chunk_stats_kernel``: each chunk's smallest and largest selectable key and its count;
   it also zeroes the row's two digit histograms and boundary-list length.
2. ``_digit_histogram_kernel`` (``DIGIT=1``): from every chunk's bounds, the high key bits
   all of the row's keys share; each chunk adds the histogram of the 8 bits below them (the
   first digit) to the row's (integer atomics: the sums do not depend on their order).
3. ``_digit_histogram_kernel`` (``DIGIT=2``): the first digit holding the row's ``need``-th
   key (``need = min(top_k, selectable)``); each chunk adds the histogram of the next 8 bits
   of its keys in that digit. Two digits keep the boundary list short where keys differ in
   sign, so the first digit is only their sign and exponent.
4. ``_boundary_kernel``: the second digit holding the need-th key; each chunk counts its
   keys above the two digits and appends the keys in both, with their ids, to the row's
   boundary list.
5. ``_threshold_kernel`` (grid ``B``): radix select among the boundary list (in a register
   block of ``SMALL_BLOCK`` or ``REG_BLOCK`` keys, or 8-bit passes over it past
   ``REG_BLOCK`` keys) gives the threshold key and how many of
   its ties to take; ties go to the lowest ids (a select on the ids of the ties when only
   some are taken); then each chunk's output offset.
6. ``_emit_kernel``: each chunk writes its ids above the threshold, and its ties up to the
   largest id taken, at its offset: ascending ids, ``-1`` after the valid ones.

Results equal ``topk_select_reference``'s (ties to the lower id, ``-0.0 == +0.0``, -inf
and NaN never selected). The boundary list's order depends on the atomics, but nothing
read from it depends on its order. Shapes are fixed by ``(B, N, top_k)``: no host sync.
A chunk that starts past its row's candidate end skips its work in launches 2-4 and 6 (a
row shorter than ``N``, e.g. a decode's scores over the pool's ``max_context_len``, costs
little more than its own chunks).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from hicache.triton_support import cdiv
from sparsehi.kernels.radix_select import (_extend, _list_radix_pass, _order_keys, _shared_bits,
                                           _threshold_in_registers)
from sparsehi.kernels.topk_split import _chunk_bounds, select_outputs

CHUNK = 2048
LIST_BLOCK = 1024
REG_BLOCK = 4096
"""A boundary list of at most this many keys is selected in registers, read once."""
SMALL_BLOCK = 256
"""A boundary list of at most this many keys (the usual case: a few dozen for normal scores
at 32768 ids) is selected in a register block of this size: the histogram passes cost by
the block, not by the list."""


@triton.jit
def _chunk_keys(s_ptr, lo, hi, b, p, stride_sb, CHUNK: tl.constexpr):
    """Chunk ``p`` of row ``b``, whose candidates are ``[lo, hi)`` (``_chunk_bounds``):
    ``_order_keys`` of its scores (0: not selectable) and its ids (int64)."""
    offs = lo + p * CHUNK + tl.arange(0, CHUNK)
    inr = offs < hi
    key = _order_keys(tl.load(s_ptr + b * stride_sb + offs, mask=inr, other=float("-inf")), inr)
    return key, offs


@triton.jit
def _digit_of(key, lo):
    return ((key >> lo.to(tl.uint32)) & 255).to(tl.int32)


@triton.jit
def _boundary_digit(hist_ptr, need):
    """The digit of a 256-bin histogram holding the ``need``-th largest key, and the keys
    in higher digits (256 and 0 when ``need`` is 0)."""
    hist = tl.load(hist_ptr + tl.arange(0, 256))
    above = tl.sum(hist, 0) - tl.cumsum(hist, 0)  # keys in higher digits, per digit
    d = tl.sum((above >= need).to(tl.int32), 0)
    return d, tl.sum(tl.where(tl.arange(0, 256) == d, above, 0), 0)


@triton.jit
def _first_digit(stats_ptr, hist_ptr, b, TOP_K, P: tl.constexpr, PP: tl.constexpr):
    """From every chunk's stats: the key bits all of row ``b``'s selectable keys share
    (``prefix``, bits ``[known_lo, 32)``), ``need = min(top_k, selectable)``, the lowest bit
    of the first digit below the shared bits (``lo1``) and, once its histogram is filled,
    the digit holding the need-th key (``d1``) with the keys above it."""
    j = tl.arange(0, PP)  # PP: P rounded up to a power of two
    jm = j < P
    base = stats_ptr + (b * P + j) * 3
    kmin = tl.min(tl.load(base, mask=jm, other=-1).to(tl.uint32, bitcast=True), 0)
    kmax = tl.max(tl.load(base + 1, mask=jm, other=0).to(tl.uint32, bitcast=True), 0)
    need = tl.minimum(tl.sum(tl.load(base + 2, mask=jm, other=0), 0), TOP_K)
    prefix, known_lo = _shared_bits(kmin, kmax)
    d1, above1 = _boundary_digit(hist_ptr + b * 512, need)
    return prefix, known_lo, need, tl.maximum(known_lo - 8, 0), d1, above1


@triton.jit
def _second_digit(stats_ptr, hist_ptr, b, TOP_K, P: tl.constexpr, PP: tl.constexpr):
    """``_first_digit``'s digit and the one below it (``lo2``, ``d2``), from both histograms:
    the threshold's bits down to ``lo2`` (``thr``), and ``ties``: how many of the keys
    sharing them the row takes."""
    prefix, known_lo, need, lo1, d1, above1 = _first_digit(stats_ptr, hist_ptr, b, TOP_K, P, PP)
    thr, lo1, need1 = _extend(prefix, known_lo, need, d1, above1)
    d2, above2 = _boundary_digit(hist_ptr + b * 512 + 256, need1)
    thr, lo2, ties = _extend(thr, lo1, need1, d2, above2)
    return need, lo1, d1, lo2, d2, thr, ties


@triton.jit
def _chunk_stats_kernel(s_ptr, cs_ptr, ce_ptr, mask_ptr, stats_ptr, hist_ptr, blen_ptr, N, stride_sb,
                        HAS_ROW_MASK: tl.constexpr, P: tl.constexpr, PP: tl.constexpr, CHUNK: tl.constexpr,
                        ZERO_BLOCK: tl.constexpr):
    p = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    lo, hi = _chunk_bounds(cs_ptr, ce_ptr, mask_ptr, b, N, HAS_ROW_MASK)
    key, _ = _chunk_keys(s_ptr, lo, hi, b, p, stride_sb, CHUNK)
    ok = key != 0
    base = stats_ptr + (b * P + p) * 3
    tl.store(base, tl.min(tl.where(ok, key, 0xFFFFFFFF), 0).to(tl.int32, bitcast=True))
    tl.store(base + 1, tl.max(key, 0).to(tl.int32, bitcast=True))
    tl.store(base + 2, tl.sum(ok.to(tl.int32), 0))
    # the next launches add into these: both histograms of the row, and its list length
    z = p * ZERO_BLOCK + tl.arange(0, ZERO_BLOCK)
    tl.store(hist_ptr + b * 512 + z, tl.zeros([ZERO_BLOCK], tl.int32), mask=z < 512)
    tl.store(blen_ptr + b, 0, mask=p == 0)


@triton.jit
def _digit_histogram_kernel(s_ptr, cs_ptr, ce_ptr, mask_ptr, stats_ptr, hist_ptr, N, TOP_K, stride_sb,
                            HAS_ROW_MASK: tl.constexpr, P: tl.constexpr, PP: tl.constexpr, CHUNK: tl.constexpr,
                            DIGIT: tl.constexpr):
    """``DIGIT`` 1: each chunk's histogram of the first digit, added into the row's first
    histogram; 2: of the next 8 bits of its keys in the first digit holding the need-th key."""
    p = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    lo, hi = _chunk_bounds(cs_ptr, ce_ptr, mask_ptr, b, N, HAS_ROW_MASK)
    if lo + p * CHUNK < hi:  # a chunk past the row's candidates adds nothing
        # with DIGIT 1 the first digit itself is not known yet: only its position is used
        _, _, _, lo1, d1, _ = _first_digit(stats_ptr, hist_ptr, b, TOP_K, P, PP)
        key, _ = _chunk_keys(s_ptr, lo, hi, b, p, stride_sb, CHUNK)
        if DIGIT == 1:
            match = key != 0
            digit = _digit_of(key, lo1)
        else:
            match = (key != 0) & (_digit_of(key, lo1) == d1)
            digit = _digit_of(key, tl.maximum(lo1 - 8, 0))
        h = tl.histogram(digit, 256, mask=match)
        tl.atomic_add(hist_ptr + b * 512 + (DIGIT - 1) * 256 + tl.arange(0, 256), h, mask=h != 0, sem="relaxed")


@triton.jit
def _boundary_kernel(s_ptr, cs_ptr, ce_ptr, mask_ptr, stats_ptr, hist_ptr, above_ptr, bkey_ptr, bid_ptr, blen_ptr,
                     N, TOP_K, stride_sb, list_stride,
                     HAS_ROW_MASK: tl.constexpr, P: tl.constexpr, PP: tl.constexpr, CHUNK: tl.constexpr):
    p = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    lo, hi = _chunk_bounds(cs_ptr, ce_ptr, mask_ptr, b, N, HAS_ROW_MASK)
    if lo + p * CHUNK < hi:
        _, lo1, d1, lo2, d2, _, _ = _second_digit(stats_ptr, hist_ptr, b, TOP_K, P, PP)
        key, offs = _chunk_keys(s_ptr, lo, hi, b, p, stride_sb, CHUNK)
        ok = key != 0
        g1 = _digit_of(key, lo1)
        g2 = _digit_of(key, lo2)
        above = ok & ((g1 > d1) | ((g1 == d1) & (g2 > d2)))
        tl.store(above_ptr + b * P + p, tl.sum(above.to(tl.int32), 0))
        inb = ok & (g1 == d1) & (g2 == d2)
        bi = inb.to(tl.int32)
        n_b = tl.sum(bi, 0)
        start = tl.atomic_add(blen_ptr + b, n_b, mask=n_b > 0, sem="relaxed")
        at = b * list_stride + start + tl.cumsum(bi, 0) - bi
        tl.store(bkey_ptr + at, key.to(tl.int32, bitcast=True), mask=inb)
        tl.store(bid_ptr + at, offs.to(tl.int32), mask=inb)
    else:  # a chunk past the row's candidates: none above, none in the list
        tl.store(above_ptr + b * P + p, 0)


@triton.jit
def _take_in_registers(bkey_ptr, bid_ptr, m, need, ties, lo_row, BLOCK: tl.constexpr, PP: tl.constexpr,
                       CHUNK: tl.constexpr):
    """The threshold among a row's ``m <= BLOCK`` boundary keys, read once into registers:
    ``(thr, max_tie_id, taken [PP])``, the ids at ``thr`` taken up to ``max_tie_id`` and the
    list's keys taken per chunk (``PP``: the chunk count rounded up to a power of two)."""
    r = tl.arange(0, BLOCK)
    r_in = r < m
    r_key = tl.load(bkey_ptr + r, mask=r_in, other=0).to(tl.uint32, bitcast=True)
    r_ids = tl.load(bid_ptr + r, mask=r_in, other=0)
    thr, ties = _threshold_in_registers(r_key, ties)
    thr = tl.where(need > 0, thr, 0xFFFFFFFF)
    r_eq = r_key == thr
    n_eq = tl.sum(r_eq.to(tl.int32), 0)
    partial = ties < n_eq
    id_val = tl.where(r_eq, 0xFFFFFFFF - r_ids.to(tl.uint32), tl.zeros_like(r_key))
    id_thr, id_ties = _threshold_in_registers(id_val, tl.where(partial, ties, 0))
    max_tie_id = tl.where(partial, (0xFFFFFFFF - id_thr).to(tl.int32), 0x7FFFFFFF)
    max_tie_id = tl.where(need > 0, max_tie_id, -1)
    r_taken = r_in & ((r_key > thr) | (r_eq & (r_ids <= max_tie_id)))
    taken = tl.histogram(tl.where(r_taken, (r_ids - lo_row) // CHUNK, 0).to(tl.int32), PP, mask=r_taken)
    return thr, max_tie_id, taken


@triton.jit
def _threshold_kernel(stats_ptr, hist_ptr, above_ptr, bkey_ptr, bid_ptr, blen_ptr, offset_ptr, row_ptr, valid_ptr,
                      cs_ptr, ce_ptr, mask_ptr, N, TOP_K, list_stride,
                      HAS_ROW_MASK: tl.constexpr, P: tl.constexpr, PP: tl.constexpr, CHUNK: tl.constexpr,
                      LIST_BLOCK: tl.constexpr, REG_BLOCK: tl.constexpr, SMALL_BLOCK: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    # the threshold's bits down to lo2 (a digit window reaching into the shared bits agrees
    # with them, as every key has them) and the boundary keys to take: the threshold is the
    # ties-th largest of the list
    need, lo1, d1, lo2, d2, thr, ties = _second_digit(stats_ptr, hist_ptr, b, TOP_K, P, PP)
    m = tl.load(blen_ptr + b)
    row_off = b * list_stride
    lo_row, hi_row = _chunk_bounds(cs_ptr, ce_ptr, mask_ptr, b, N, HAS_ROW_MASK)
    chunks = tl.arange(0, PP)
    # each chunk's keys above the list's
    per_chunk = tl.load(above_ptr + b * P + chunks, mask=chunks < P, other=0)
    if m <= SMALL_BLOCK:
        # the usual case: the whole list in a small register block
        thr, max_tie_id, taken = _take_in_registers(bkey_ptr + row_off, bid_ptr + row_off, m, need, ties, lo_row,
                                                    SMALL_BLOCK, PP, CHUNK)
        per_chunk += taken
    elif m <= REG_BLOCK:
        thr, max_tie_id, taken = _take_in_registers(bkey_ptr + row_off, bid_ptr + row_off, m, need, ties, lo_row,
                                                    REG_BLOCK, PP, CHUNK)
        per_chunk += taken
    else:
        # a crowded boundary: passes over the list in blocks
        known = tl.where(need > 0, lo2, 0)
        for _ in tl.static_range(2):  # at most 16 bits below the two digits
            thr, known, ties = _list_radix_pass(bkey_ptr + row_off, bid_ptr + row_off, m, thr, known, ties,
                                                LIST_BLOCK)
        thr = tl.where(need > 0, thr, 0xFFFFFFFF)
        # ties of the threshold: all of them (the usual case), or the `ties` lowest ids
        offs = tl.arange(0, LIST_BLOCK)
        n_eq = tl.full([], 0, tl.int32)
        for start in range(0, m, LIST_BLOCK):
            o = start + offs
            key = tl.load(bkey_ptr + row_off + o, mask=o < m, other=0).to(tl.uint32, bitcast=True)
            n_eq += tl.sum((key == thr).to(tl.int32), 0)
        id_thr = tl.full([], 0, tl.uint32)
        id_known = tl.where((need > 0) & (ties < n_eq), 32, 0)
        id_need = ties
        for _ in tl.static_range(4):
            id_thr, id_known, id_need = _list_radix_pass(bkey_ptr + row_off, bid_ptr + row_off, m, id_thr, id_known,
                                                         id_need, LIST_BLOCK, True, thr)
        max_tie_id = tl.where(ties < n_eq, (0xFFFFFFFF - id_thr).to(tl.int32), 0x7FFFFFFF)
        max_tie_id = tl.where(need > 0, max_tie_id, -1)
        for start in range(0, m, LIST_BLOCK):
            o = start + offs
            inl = o < m
            key = tl.load(bkey_ptr + row_off + o, mask=inl, other=0).to(tl.uint32, bitcast=True)
            ids = tl.load(bid_ptr + row_off + o, mask=inl, other=0)
            taken = inl & ((key > thr) | ((key == thr) & (ids <= max_tie_id)))
            per_chunk += tl.histogram(tl.where(taken, (ids - lo_row) // CHUNK, 0).to(tl.int32), PP, mask=taken)
    tl.store(offset_ptr + b * P + chunks, tl.cumsum(per_chunk, 0) - per_chunk, mask=chunks < P)
    tl.store(row_ptr + b * 2, thr.to(tl.int32, bitcast=True))
    tl.store(row_ptr + b * 2 + 1, max_tie_id)
    tl.store(valid_ptr + b, tl.sum(per_chunk, 0))


@triton.jit
def _emit_kernel(s_ptr, cs_ptr, ce_ptr, mask_ptr, offset_ptr, row_ptr, valid_ptr, ids_ptr,
                 N, TOP_K, stride_sb, stride_ib,
                 HAS_ROW_MASK: tl.constexpr, P: tl.constexpr, PP: tl.constexpr, CHUNK: tl.constexpr,
                 PAD_BLOCK: tl.constexpr):
    p = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    out = ids_ptr + b * stride_ib
    lo, hi = _chunk_bounds(cs_ptr, ce_ptr, mask_ptr, b, N, HAS_ROW_MASK)
    if lo + p * CHUNK < hi:  # a chunk past the row's candidates has no ids to write
        key, offs = _chunk_keys(s_ptr, lo, hi, b, p, stride_sb, CHUNK)
        thr = tl.load(row_ptr + b * 2).to(tl.uint32, bitcast=True)
        max_tie_id = tl.load(row_ptr + b * 2 + 1)
        ids = offs.to(tl.int32)
        sel = (key > thr) | ((key == thr) & (ids <= max_tie_id))  # a key of 0 is never above nor at thr
        si = sel.to(tl.int32)
        tl.store(out + tl.load(offset_ptr + b * P + p) + tl.cumsum(si, 0) - si, ids, mask=sel)
    # -1 after the valid ids: this chunk's share of the row's output positions
    valid = tl.load(valid_ptr + b)
    pad = p * PAD_BLOCK + tl.arange(0, PAD_BLOCK)
    tl.store(out + pad, tl.full([PAD_BLOCK], -1, tl.int32), mask=(pad >= valid) & (pad < TOP_K))


def topk_select_radix_grid(scores: torch.Tensor, top_k: int, candidate_start: torch.Tensor,
                           candidate_end: torch.Tensor, row_mask: Optional[torch.Tensor], chunks: int,
                           num_warps: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """Six launches (see the module docstring) over ``chunks`` chunks of ``CHUNK`` ids per
    row (covering ``N``, from ``topk.radix_grid_plan``); arguments and results as
    ``topk_select`` (checked by its caller)."""
    bsz, n = scores.shape
    if not isinstance(chunks, int) or chunks < 1 or chunks * CHUNK < n:
        raise ValueError(f"chunks={chunks} is invalid: an int >= 1 with chunks x {CHUNK} >= N={n}")
    dev = scores.device
    scores, ids, valid = select_outputs(scores, top_k)
    if bsz == 0:
        return ids, valid
    p = chunks
    list_stride = p * CHUNK
    i32 = dict(dtype=torch.int32, device=dev)
    stats = torch.empty(bsz, p, 3, **i32)
    hist = torch.empty(bsz, 2, 256, **i32)
    above = torch.empty(bsz, p, **i32)
    blist = torch.empty(2, bsz, list_stride, **i32)
    blen = torch.empty(bsz, **i32)
    offsets = torch.empty(bsz, p, **i32)
    row = torch.empty(bsz, 2, **i32)
    cs, ce = candidate_start.to(dev), candidate_end.to(dev)
    mask = row_mask.to(dev) if row_mask is not None else valid  # dummy pointer when unused
    src = (scores, cs, ce, mask)
    grid = (p, bsz)
    geo = dict(HAS_ROW_MASK=row_mask is not None, P=p, PP=triton.next_power_of_2(p), CHUNK=CHUNK)
    _chunk_stats_kernel[grid](*src, stats, hist, blen, n, scores.stride(0),
                              ZERO_BLOCK=triton.next_power_of_2(cdiv(512, p)), num_warps=num_warps, **geo)
    for digit in (1, 2):
        _digit_histogram_kernel[grid](*src, stats, hist, n, top_k, scores.stride(0), DIGIT=digit, num_warps=num_warps,
                                      **geo)
    _boundary_kernel[grid](*src, stats, hist, above, blist[0], blist[1], blen, n, top_k, scores.stride(0),
                           list_stride, num_warps=num_warps, **geo)
    _threshold_kernel[(bsz,)](stats, hist, above, blist[0], blist[1], blen, offsets, row, valid, cs, ce, mask, n,
                              top_k, list_stride, LIST_BLOCK=LIST_BLOCK, REG_BLOCK=REG_BLOCK, SMALL_BLOCK=SMALL_BLOCK,
                              num_warps=8, **geo)
    _emit_kernel[grid](*src, offsets, row, valid, ids, n, top_k, scores.stride(0), ids.stride(0),
                       PAD_BLOCK=triton.next_power_of_2(cdiv(top_k, p)), num_warps=num_warps, **geo)
    return ids, valid
