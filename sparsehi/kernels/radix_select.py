"""Radix-select building blocks shared by the Top-k kernels (``topk``, ``topk_split``).

Scores become ``uint32`` keys whose unsigned order is the float order (0: not selectable);
the threshold key of rank ``need`` is found digit by digit (8-bit histograms below the bits
every candidate shares), and ``_emit`` writes the ids above it plus the first ``need`` ties
in their given order (so, fed in id order, lower ids win ties; ``_write_row`` adds the
padding and the count). ``_select_threshold`` is
the variant for a selection alone: it stops once the boundary digit is wholly taken.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _order_keys(x, in_range):
    """``uint32`` keys whose unsigned order is the float order of ``x``; 0 where the id is
    not selectable (outside the candidates, -inf, NaN). Every selectable key is
    ``>= 0x00800000`` (the key of -inf is ``0x007FFFFF``)."""
    x = x.to(tl.float32)
    ok = in_range & (x > float("-inf"))  # NaN compares False
    x = tl.where(x == 0.0, 0.0, x)  # -0.0 ties with +0.0
    bits = x.to(tl.uint32, bitcast=True)
    # xor with all ones, not ``~``: Triton 3.8's interpreter evaluates ``~`` of a uint32 as -x-1
    # and overflows (same bits on every version and on the GPU)
    ones = tl.full([], 0xFFFFFFFF, tl.uint32)
    key = tl.where(bits >= 0x80000000, bits ^ ones, bits | 0x80000000)
    return tl.where(ok, key, tl.zeros_like(key))


@triton.jit
def _high_bits(n):
    """``uint32`` mask of bits ``[n, 32)`` (``n`` in ``[0, 32]``)."""
    ones = tl.full([], 0xFFFFFFFF, tl.uint32)
    return tl.where(n >= 32, tl.zeros_like(ones), ones << tl.minimum(n, 31).to(tl.uint32))


@triton.jit
def _extend(prefix, known_lo, need, digit, above_digit):
    """``_refine``'s result once the digit (and the keys above it) are known."""
    lo = tl.maximum(known_lo - 8, 0)
    # a window that overlaps known bits (lo + 8 > known_lo) only finds digits agreeing with them
    extended = (prefix & _high_bits(lo + 8)) | (digit.to(tl.uint32) << lo.to(tl.uint32))
    active = known_lo > 0
    return (tl.where(active, extended, prefix), tl.where(active, lo, known_lo),
            tl.where(active, need - above_digit, need))


@triton.jit
def _refine(hist, prefix, known_lo, need):
    """One radix digit of the threshold key.

    ``prefix`` holds the threshold's bits ``[known_lo, 32)``; ``hist [256]`` counts, among the
    keys sharing them, the digit ``(key >> lo) & 255`` with ``lo = max(known_lo - 8, 0)``;
    the threshold is the ``need``-th largest of those keys. Returns the prefix extended to
    bits ``[lo, 32)``, ``lo``, and the rank left inside the chosen digit. A no-op once
    every bit is known (``known_lo == 0``)."""
    above = tl.sum(hist, 0) - tl.cumsum(hist, 0)  # keys in higher digits
    digit = tl.sum((above >= need).to(tl.int32), 0)
    above_digit = tl.sum(tl.where(tl.arange(0, 256) == digit, above, 0), 0)
    return _extend(prefix, known_lo, need, digit, above_digit)


@triton.jit
def _refine_counted(hist, prefix, known_lo, need):
    """``_refine`` plus the number of keys in the chosen digit, for blocks of fewer than
    2**15 keys (both counts of the digit come out of one packed reduction)."""
    above = tl.sum(hist, 0) - tl.cumsum(hist, 0)
    digit = tl.sum((above >= need).to(tl.int32), 0)
    packed = tl.sum(tl.where(tl.arange(0, 256) == digit, above * 65536 + hist, 0), 0)
    prefix, known_lo, need = _extend(prefix, known_lo, need, digit, packed >> 16)
    return prefix, known_lo, need, packed & 65535


@triton.jit
def _shared_bits(kmin, kmax):
    """Every ``uint32`` in ``[kmin, kmax]`` has the bits of ``kmax`` above the highest bit where
    ``kmin`` and ``kmax`` differ. Returns those bits (``prefix``) and the lowest of them
    (``known_lo``; 0 when ``kmin == kmax``): the radix digits start right below."""
    diff = kmax ^ kmin
    d = diff
    msb = tl.full([], 0, tl.int32)
    for sh in tl.static_range(5):
        step = 16 >> sh
        big = (d >> step) != 0
        d = tl.where(big, d >> step, d)
        msb += tl.where(big, step, 0)
    known_lo = tl.where(diff != 0, msb + 1, 0)
    return kmax & _high_bits(known_lo), known_lo


@triton.jit
def _threshold_in_registers(keys, need):
    """The ``need``-th largest of ``keys`` (a block in registers, 0 = not selectable;
    ``need <= `` their count): returns ``(threshold key, ties of it to take)``."""
    ok = keys != 0
    prefix, known_lo = _shared_bits(tl.min(tl.where(ok, keys, 0xFFFFFFFF), 0), tl.max(keys, 0))
    known_lo = tl.where(need > 0, known_lo, 0)
    for _ in tl.static_range(4):
        if known_lo > 0:
            hb = _high_bits(known_lo)
            shift = tl.maximum(known_lo - 8, 0).to(tl.uint32)
            match = ok & ((keys & hb) == (prefix & hb))
            hist = tl.histogram(((keys >> shift) & 255).to(tl.int32), 256, mask=match)
            prefix, known_lo, need = _refine(hist, prefix, known_lo, need)
    return prefix, need


@triton.jit
def _select_threshold(keys, need, count):
    """``(thr, ties)`` for ``_emit`` to write the ``need`` largest of ``keys`` (a block in
    registers of fewer than 2**15 keys, 0 = not selectable, ``count`` of them selectable;
    ``need <= count``), in fewer radix passes than
    ``_threshold_in_registers``: it stops as soon as every key sharing the bits found so far
    is needed, answering a threshold just below them and no ties (``_emit`` writes the same
    ids; ``thr`` need not be a key, so it is no rank statistic). Every selectable key
    needed stops before the first pass. Once two 8-bit digits are known the boundary digit
    of a few hundred keys mostly holds one key, so a select of 32 unknown bits often takes
    2 or 3 histogram passes, not 4."""
    ok = keys != 0
    prefix, known_lo = _shared_bits(tl.min(tl.where(ok, keys, 0xFFFFFFFF), 0), tl.max(keys, 0))
    take_all = need >= count  # every selectable key: above 0
    prefix = tl.where(take_all, 0, prefix)
    known_lo = tl.where((need > 0) & ~take_all, known_lo, 0)
    need = tl.where(take_all, 0, need)
    for _ in tl.static_range(4):
        if known_lo > 0:
            hb = _high_bits(known_lo)
            shift = tl.maximum(known_lo - 8, 0).to(tl.uint32)
            match = ok & ((keys & hb) == (prefix & hb))
            hist = tl.histogram(((keys >> shift) & 255).to(tl.int32), 256, mask=match)
            prefix, known_lo, need, in_digit = _refine_counted(hist, prefix, known_lo, need)
            # the whole chosen digit is needed: every key >= its lowest value (its bits
            # below known_lo are zero in prefix), i.e. every key > prefix - 1
            done = in_digit == need
            prefix = tl.where(done, prefix - 1, prefix)
            need = tl.where(done, 0, need)
            known_lo = tl.where(done, 0, known_lo)
    return prefix, need


@triton.jit
def _list_radix_pass(keys_ptr, ids_ptr, m, prefix, known_lo, need, LIST_BLOCK: tl.constexpr,
                     BY_ID: tl.constexpr = False, tie_key=0):
    """``_refine`` over a list of ``m`` keys in global memory (``keys_ptr``, int32 bits of
    the uint32 keys), read in blocks of ``LIST_BLOCK`` past L1 (a list this program wrote is
    read back by its other threads): one 8-bit digit of the threshold. ``BY_ID``: the values
    are instead those of the entries whose key is ``tie_key``, from their ids
    (``ids_ptr``), ordered so that the lowest id is the largest value."""
    hb = _high_bits(known_lo)
    shift = tl.maximum(known_lo - 8, 0).to(tl.uint32)
    hist = tl.zeros([256], dtype=tl.int32)
    offs_lst = tl.arange(0, LIST_BLOCK)
    for start in range(0, tl.where(known_lo > 0, m, 0), LIST_BLOCK):
        offs = start + offs_lst
        inl = offs < m
        key = tl.load(keys_ptr + offs, mask=inl, other=0, cache_modifier=".cg").to(tl.uint32, bitcast=True)
        if BY_ID:
            ids = tl.load(ids_ptr + offs, mask=inl, other=0, cache_modifier=".cg")
            key = tl.where(inl & (key == tie_key), 0xFFFFFFFF - ids.to(tl.uint32), tl.zeros_like(key))
        match = (key != 0) & ((key & hb) == (prefix & hb))
        hist += tl.histogram(((key >> shift) & 255).to(tl.int32), 256, mask=match)
    return _refine(hist, prefix, known_lo, need)


@triton.jit
def _emit(out, keys, ids, thr, need, ties, n_out):
    """Write, in their order, the ``ids`` whose key is above ``thr`` and the ties of ``thr``
    ranked below ``need`` (``ties`` met before this block); ``n_out`` written before."""
    eq = keys == thr  # a key of 0 (not selectable) never equals a threshold
    ei = eq.to(tl.int32)
    rank = ties + tl.cumsum(ei, 0) - ei
    sel = (keys > thr) | (eq & (rank < need))
    si = sel.to(tl.int32)
    tl.store(out + n_out + tl.cumsum(si, 0) - si, ids, mask=sel)
    return ties + tl.sum(ei, 0), n_out + tl.sum(si, 0)


@triton.jit
def _write_row(out, valid_ptr, b, keys, ids, thr, need, TOP_K, OUT_BLOCK: tl.constexpr):
    """A row's whole output from one block of keys in id order: ``_emit``'s ids at ``out``,
    ``-1`` after them up to ``TOP_K``, and their count at ``valid_ptr + b``."""
    _, n_out = _emit(out, keys, ids, thr, need, 0, 0)
    offs = tl.arange(0, OUT_BLOCK)
    for start in range(0, TOP_K, OUT_BLOCK):
        o = start + offs
        tl.store(out + o, tl.full([OUT_BLOCK], -1, tl.int32), mask=(o >= n_out) & (o < TOP_K))
    tl.store(valid_ptr + b, n_out)
