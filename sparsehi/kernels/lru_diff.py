"""LRU diff: which selected ids are already in a request's GPU buffer, which slots to
evict for the rest, and the host->device load map — one launch for a whole batch of one
layer.

Policy: exact LRU over ``(last_used, slot)``. Each step the ``num_misses`` slots that this
step did not select and that have the smallest ``(last_used, slot)`` are evicted and
refilled; the j-th miss (in ``topk`` column order) takes the j-th victim in slot order.
Hits and refills get ``last_used = step``. A fresh state (``last_used = -1``) takes empty
slots in slot order.

Repeated ids: ``check_lru_diff_values`` rejects an id named twice in one row. Without
validation (benchmarks, CUDA graphs) a repeat is served by its first column: it is no
second miss, is not loaded and takes no victim; its ``device_slots`` entry is the first
column's slot and ``num_loads`` counts distinct missed ids. Ids that unvalidated input
clamps to one value (``-1`` inside the valid range, ids ``>= M``) repeat the same way.

Reverse map: ``slot_of[id]`` is where ``id`` was last installed. It is exact for resident
ids; entries of evicted ids are left stale (clearing them would cost one random store per
eviction), so an id is resident iff ``slot_of[id] >= 0 and resident[slot_of[id]] == id``.
Each id is resident in at most one slot.

How the kernel finds victims without a sort or an order array: the eviction threshold ``T``
is the smallest stamp with at least ``num_misses`` non-hit slots stamped ``<= T``. The
buffer side counts the slots stamped with each of the ``WINDOW`` consecutive values from
the oldest stamp up, in one packed reduction (while the reverse-map gather is in flight);
the selection side subtracts the hits among them (each hit's old stamp is gathered from
the buffer row in registers). When those values hold too few victims, distinct-minimum
rounds and then a bisection over the stamps take over; when every non-hit slot is a
victim there is no search. Victims are the non-hit slots below ``T`` and the first ties at
``T`` in slot order: one packed prefix sum. Only hits stamped ``<= T`` (few) must be known
per slot; the main program stamps them itself and reads the candidates' stamps back.

Repeats, without a sort: each miss claims its id in ``slot_of`` by an atomic min of
``column + INT_MIN`` (a marker below -1), issued as soon as the misses are known and read
back after the barrier the installs wait on anyway. Two things send a row to the exact
path (``_exact_path``): a miss that lost its claim (a repeated missed id), and a victim
ranked past the misses (repeated hits are counted once per column, which makes the counts
short and ``T`` too high when they reach the candidates; that victim marks the load lists'
-1 tail). The exact path claims again from a clean slate, stamps every hit, reads the row
back and bisects the threshold over per-slot hits; it is a device function of its own
(not inlined) so that it does not raise the register allocation of the common path.
When no id repeats, the repeat handling adds the misses' claims (fire-and-forget atomics,
in flight during the search), a gather of the claims and a coalesced load of the list tail
beside the loads that follow the install barrier, and one K-wide max reduction before the
installs (its cost and register use: docs/kernels.md).

Installs pair the j-th miss with the j-th victim through the row's ``load_*`` outputs in
global memory (Triton has no shared-memory scatter). Victim side: the misses list their
ids and columns by rank, each victim reads its miss and writes five S-wide masked passes.
Miss side (``miss_side``, the default when S >= 4K): the victims list their slots by rank,
each miss reads its victim and installs in K-wide passes (``default_miss_side``).

Helpers: one row's work runs on one SM, and what an SM does slowest is random stores, of
which the K stamps of the hits are most (the cost model: docs/kernels.md). So ``helpers``
extra programs per row stamp the hits and write the hits' device slots, while the main
program selects and installs victims without waiting for them. The races
between them are benign, and these orderings keep them so:
- a helper writes ``last_used = step`` only to slots that hold a selected id, and
  ``device_slots`` only for hit and padding columns; if it already sees this launch's
  refills, it writes the very values the main program writes for them;
- the main program reads each stamp once (one snapshot in registers) and counts both the
  buffer side and the hits from that snapshot, so a hit a helper stamped first is
  counted consistently either way;
- the read-back tells hits by ``last_used == step``; no non-hit slot can carry ``step``
  then because the main program installs refills only after the barrier that follows the
  read-back (keep it that way when reordering stores);
- between its claim and its install a missed id's ``slot_of`` entry holds a marker (or -1
  on the exact path): a helper reading it takes the id for not resident, which it is;
- the load lists' -1 entries are stored before the block barriers of the victims' scan,
  the victims' marks over them after those barriers.

Shapes (``B`` batch rows, ``K`` top-k width, ``S`` buffer slots, ``M`` logical ids per
request; ``R`` state rows, ``R = B`` unless ``rows`` maps batch rows to state rows):
    topk      ``[B, K] int32`` logical ids, the first ``valid[b]`` of row b valid, ``-1`` after
    valid     ``[B] int32``
    resident  ``[R, S] int32`` logical id held by each slot, ``-1`` empty       (updated)
    last_used ``[R, S] int32`` step of last use, ``-1`` never                   (updated)
    slot_of   ``[R, M] int32`` logical id -> slot it was last installed in, ``-1`` never (updated)
    step      int in ``[0, 2**31 - 3]`` or ``[1] int32`` tensor (graph-safe, same range,
              not checked); strictly larger than every earlier step used with this
              state. Repeating a step is not detected here (it would need a host sync)
              and corrupts the state: the kernel takes slots stamped with the current
              step as this step's hits. SparseKVCacheManager keeps each layer's last step
              on the host and rejects a second diff in one step.
    rows      ``[B] int64`` state row of each batch row (distinct), optional; ``-1`` marks a
              padding row: it selects nothing (outputs ``-1``, no load) and changes no state
    choice    ``sparsehi.row_choice.RowChoice``, optional: rows whose ``use`` is
              False read ``choice.ids`` / ``choice.count`` instead of ``topk`` / ``valid``
Out: ``device_slots [B, K] int32`` (slot of each selected id, -1 pad), ``load_ids [B, K]``
(missed ids, compacted, -1 pad), ``load_slots [B, K]`` (their slots), ``num_loads [B]``.
Limits: ``S <= 16384`` (the buffer row is held in registers and gathered through shared
memory; slot counts travel in 16-bit fields), ``0 <= step <= 2**31 - 3``, ``B <= 65535``.
"""
from __future__ import annotations

from typing import Any, Optional, Union

import torch
import triton
import triton.language as tl

from hicache.triton_support import INT32_MAX, dispatch, sm_count
from sparsehi.kernels.lru_diff_reference import (MAX_SLOTS, MAX_STEP, LruDiffResult, _check_args, _check_out,
                                                 _step_tensor, check_lru_diff_values, lru_diff_reference)

__all__ = ["LruDiffResult", "MAX_SLOTS", "MAX_STEP", "check_lru_diff_values", "lru_diff", "lru_diff_reference",
           "lru_diff_triton"]

INT_MAX = tl.constexpr(INT32_MAX)
INT_MIN = tl.constexpr(-INT32_MAX - 1)


# --------------------------------------------------------------------------- Triton
@triton.jit
def _exclusive_cumsum(x, N: tl.constexpr, R: tl.constexpr):
    """Exclusive prefix sum of ``x`` ``[N] int32`` (``R`` a power of two <= N). R == 1:
    ``tl.cumsum(x) - x``. Otherwise adjacent pairs are folded log2(R) times before the
    block-wide scan, which then runs over N/R elements, and the pair offsets are added back
    on the way out. The block-wide scan pays a cross-warp combine for every run of elements
    a thread holds, so R = 4..8 roughly halves the kernel's scan instructions, at the price
    of a few shared-memory layout changes (block barriers) per fold."""
    if R == 1:
        return tl.cumsum(x, 0) - x
    else:
        e, o = tl.split(tl.reshape(x, (N // 2, 2)))
        pe = _exclusive_cumsum(e + o, N // 2, R // 2)
        return tl.reshape(tl.join(pe, pe + e), (N,))


@triton.jit
def _min_count(m1, c1, m2, c2):
    m = tl.minimum(m1, m2)
    return m, tl.where(m1 == m, c1, 0) + tl.where(m2 == m, c2, 0)


@triton.jit
def _rank_victims(nonhit, lu_row, T, below, nmiss, BLOCK_S: tl.constexpr, SCAN_R: tl.constexpr):
    """Victims in slot order: the non-hit slots stamped below ``T`` (``below`` of them) and the
    first ``nmiss - below`` stamped ``T``. Returns (chosen ``[BLOCK_S]`` bool, rank ``[BLOCK_S]``
    int32, the number of chosen slots before each): one packed prefix sum."""
    rem = tl.maximum(nmiss - below, 0)
    gt = nonhit & (lu_row < T)
    eq = nonhit & (lu_row == T)
    ex = _exclusive_cumsum(gt.to(tl.int32) + (eq.to(tl.int32) << 16), BLOCK_S, SCAN_R)
    gt_b = ex & 0xFFFF
    eq_b = ex >> 16
    return gt | (eq & (eq_b < rem)), gt_b + tl.minimum(eq_b, rem)


@triton.jit
def _exact_threshold(nonhit, lu_row, lo_stamp, nmiss):
    """The smallest stamp ``T`` with at least ``nmiss`` slots of ``nonhit`` stamped ``<= T``
    (bisection over the stamps, from the oldest ``lo_stamp``), and how many are below it."""
    lb = lo_stamp.to(tl.int64) - 1
    hi = tl.maximum(tl.max(tl.where(nonhit, lu_row, INT_MIN), 0).to(tl.int64), lb)
    while hi - lb > 1:
        mid = (lb + (hi - lb) // 2).to(tl.int32)
        big = tl.sum((nonhit & (lu_row <= mid)).to(tl.int32), 0) >= nmiss
        hi = tl.where(big, mid.to(tl.int64), hi)
        lb = tl.where(big, lb, mid.to(tl.int64))
    t = hi.to(tl.int32)
    return t, tl.sum((nonhit & (lu_row < t)).to(tl.int32), 0)


@triton.jit
def _install_from_misses(ds_p, so_p, res_p, lu_p, kk, mids, serve, vslot, step, S: tl.constexpr):
    """Miss side: each missed id (``mids >= 0``) installs the slot its rank drew, ``vslot``
    (K-wide passes instead of S-wide ones); ``serve`` marks the columns that get it as their
    device slot (the misses and their repeats)."""
    ok = (vslot >= 0) & (vslot < S)
    inst = (mids >= 0) & ok
    tl.store(ds_p + kk, vslot, mask=serve & ok)
    tl.store(so_p + mids, vslot, mask=inst)
    tl.store(res_p + vslot, mids, mask=inst)
    tl.store(lu_p + vslot, tl.zeros_like(vslot) + step, mask=inst)


@triton.jit
def _install_by_victims(ds_p, so_p, res_p, lu_p, ls_p, ss, victim, vrank, new_id, col, step):
    """Victim side: each victim slot installs the miss of its rank (``new_id`` from column
    ``col``) and lists itself in ``load_slots``."""
    tl.store(ls_p + vrank, ss, mask=victim)
    tl.store(lu_p + ss, tl.zeros_like(ss) + step, mask=victim)
    tl.store(res_p + ss, new_id, mask=victim)
    tl.store(so_p + new_id, ss, mask=victim)
    tl.store(ds_p + col, ss, mask=victim)


@triton.jit
def _row_ids(topk_ptr, alt_ptr, b, stride_topk, stride_alt, cols, mask, u, HAS_ALT: tl.constexpr):
    """Row ``b`` of the selection at ``cols`` (``other`` 0): ``topk``'s where ``u``, else the
    row choice's alternative (sparsehi/row_choice.py; one of the two loads is masked
    off entirely)."""
    b64 = b.to(tl.int64)
    if HAS_ALT:
        ut = (tl.zeros_like(cols) + u.to(tl.int32)) != 0  # the scalar as a tile (masks must be tiles)
        x = tl.load(topk_ptr + b64 * stride_topk + cols, mask=mask & ut, other=0)
        y = tl.load(alt_ptr + b64 * stride_alt + cols, mask=mask & ~ut, other=0)
        x = tl.where(ut, x, y)
    else:
        x = tl.load(topk_ptr + b64 * stride_topk + cols, mask=mask, other=0)
    return x


@triton.jit(noinline=True)
def _exact_path(topk_ptr, alt_ptr, u, resident_ptr, last_used_ptr, slot_of_ptr, dev_slots_ptr, load_ids_ptr, load_slots_ptr,
                num_loads_ptr, row, b, nvalid, step, M, stride_topk, stride_alt, stride_state, stride_slot_of,
                stride_out, K: tl.constexpr, S: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_S: tl.constexpr,
                SCAN_R: tl.constexpr, MISS_SIDE: tl.constexpr, HAS_ALT: tl.constexpr):
    """The victims and installs of row ``b`` when the fast path cannot serve it exactly: a
    repeated id in the row (a caller that skipped validation), or duplicate hits. Claims
    again from a clean slate (no stale marker can win), stamps every hit and reads the row
    back, so every count is over distinct slots. Called after the fast path's claims and the
    barrier that follows them, before any install. (Not inlined, so the rare path does not
    raise the register allocation of the common one; hence it rebuilds its inputs from
    memory.)"""
    kk = tl.arange(0, BLOCK_K)
    ss = tl.arange(0, BLOCK_S)
    res_p = resident_ptr + row * stride_state
    lu_p = last_used_ptr + row * stride_state
    so_p = slot_of_ptr + row * stride_slot_of
    ds_p = dev_slots_ptr + b.to(tl.int64) * stride_out
    li_p = load_ids_ptr + b.to(tl.int64) * stride_out
    ls_p = load_slots_ptr + b.to(tl.int64) * stride_out
    marker = kk + INT_MIN
    # every missed id's entry now holds a claim marker (< -1), every hit's its slot (>= 0)
    raw = _row_ids(topk_ptr, alt_ptr, b, stride_topk, stride_alt, kk, kk < K, u, HAS_ALT)
    ids = tl.minimum(tl.maximum(raw, 0), M - 1)
    sel = kk < nvalid
    entry = tl.load(so_p + ids, mask=sel, other=0, cache_modifier=".cg")
    missed = sel & (entry < -1)
    hit = sel & (entry >= 0) & (entry < S)
    mids = tl.where(missed, ids, -1)
    tl.store(so_p + mids, tl.full([BLOCK_K], -1, tl.int32), mask=missed)
    tl.store(lu_p + entry, tl.zeros_like(entry) + step, mask=hit)
    if MISS_SIDE:
        tl.store(li_p + kk, tl.full([BLOCK_K], -1, tl.int32), mask=kk < K)
        tl.store(ls_p + kk, tl.full([BLOCK_K], -1, tl.int32), mask=kk < K)
    tl.debug_barrier()
    tl.atomic_min(so_p + mids, marker, mask=missed, sem="relaxed")
    tl.debug_barrier()
    claim = tl.load(so_p + mids, mask=missed, other=0, cache_modifier=".cg")
    claimed = missed & (claim == marker)
    first_i = claimed.to(tl.int32)
    mrank = _exclusive_cumsum(first_i, BLOCK_K, SCAN_R)
    nmiss = tl.sum(first_i, 0)
    # the rank whose victim serves each column (a repeat: its first column's), -1 none
    first_col = tl.minimum(tl.maximum(claim ^ INT_MIN, 0), BLOCK_K - 1)
    rk = tl.where(claimed, mrank, tl.where(missed, tl.gather(mrank, first_col, 0), -1))
    mids = tl.where(claimed, mids, -1)
    if MISS_SIDE:
        tl.store(li_p + mrank, mids, mask=claimed)
    else:
        dst = tl.where(claimed, mrank, nmiss + kk - mrank)
        tl.store(li_p + dst, mids, mask=kk < K)
        tl.store(ls_p + dst, tl.where(claimed, kk, -1), mask=kk < K)
    tl.store(num_loads_ptr + b, nmiss)
    # (read back rather than kept: the snapshot would stay live across the installs)
    row_x = tl.load(lu_p + ss, mask=ss < S, other=INT_MAX)
    nonhit_x = (ss < S) & (row_x != step)
    lo_x = tl.min(tl.where(nonhit_x, row_x, INT_MAX), 0)
    t_x, below_x = _exact_threshold(nonhit_x, row_x, lo_x, nmiss)
    chosen, vrank = _rank_victims(nonhit_x, row_x, t_x, below_x, nmiss, BLOCK_S, SCAN_R)
    victim = chosen & (vrank < nmiss)
    if MISS_SIDE:
        tl.store(ls_p + vrank, ss, mask=victim)
        tl.debug_barrier()
        vslot = tl.load(ls_p + rk, mask=rk >= 0, other=-1)
        _install_from_misses(ds_p, so_p, res_p, lu_p, kk, mids, rk >= 0, vslot, step, S)
    else:
        tl.debug_barrier()
        new_id = tl.load(li_p + vrank, mask=victim, other=0)
        col = tl.load(ls_p + vrank, mask=victim, other=0)
        _install_by_victims(ds_p, so_p, res_p, lu_p, ls_p, ss, victim, vrank, new_id, col, step)
        # a repeat takes its first column's slot, which that column's victim just listed
        tl.debug_barrier()
        dup = (rk >= 0) & (mids < 0)
        tl.store(ds_p + kk, tl.load(ls_p + rk, mask=dup, other=-1), mask=dup)


@triton.jit
def _lru_diff_kernel(
    topk_ptr, valid_ptr, rows_ptr, resident_ptr, last_used_ptr, slot_of_ptr, step_ptr,
    dev_slots_ptr, load_ids_ptr, load_slots_ptr, num_loads_ptr, num_valid_ptr,
    use_ptr, alt_ptr, alt_valid_ptr,
    M, stride_topk, stride_state, stride_slot_of, stride_out, stride_alt,
    K: tl.constexpr, S: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_S: tl.constexpr, SCAN_R: tl.constexpr,
    WINDOW: tl.constexpr, MAX_ROUNDS: tl.constexpr, HELPERS: tl.constexpr, MISS_SIDE: tl.constexpr,
    HAS_NVALID: tl.constexpr, HAS_ALT: tl.constexpr,
):
    # Grid (1 + HELPERS, B): program 0 of a row selects and installs victims, programs
    # 1..HELPERS stamp the row's hits (a column chunk each). Nothing waits for a helper.
    p = tl.program_id(0)
    b = tl.program_id(1)
    row = tl.load(rows_ptr + b).to(tl.int64)
    step = tl.load(step_ptr)
    # a padding row (row < 0, e.g. the unused rows of a CUDA-graph batch) selects nothing:
    # every state store below is masked by a hit, miss or victim, so its (row 0) state is
    # only read; its outputs are all -1 and no load
    if HAS_ALT:
        # the row choice (row_choice.py): rows that do not use topk read the alternative
        u = tl.load(use_ptr + b) != 0
        vin = tl.where(u, tl.load(valid_ptr + b), tl.load(alt_valid_ptr + b))
    else:
        u = b >= 0
        vin = tl.load(valid_ptr + b)
    nvalid = tl.where(row < 0, 0, tl.minimum(tl.maximum(vin, 0), K))
    if HAS_NVALID:
        if p == 0:
            tl.store(num_valid_ptr + b, nvalid)
    row = tl.maximum(row, 0)
    res_p = resident_ptr + row * stride_state
    lu_p = last_used_ptr + row * stride_state
    so_p = slot_of_ptr + row * stride_slot_of
    ds_p = dev_slots_ptr + b.to(tl.int64) * stride_out
    if (HELPERS > 0) & (p > 0):
        CH: tl.constexpr = BLOCK_K // max(HELPERS, 1)
        kc = (p - 1) * CH + tl.arange(0, CH)
        rawc = _row_ids(topk_ptr, alt_ptr, b, stride_topk, stride_alt, kc, kc < K, u, HAS_ALT)
        selc = kc < nvalid
        idc = tl.minimum(tl.maximum(rawc, 0), M - 1)
        hintc = tl.load(so_p + idc, mask=selc, other=-1)
        hintc = tl.where(hintc < S, hintc, -1)
        hitc = (hintc >= 0) & (tl.load(res_p + hintc, mask=hintc >= 0, other=-1) == idc)
        tl.store(lu_p + hintc, tl.zeros_like(hintc) + step, mask=hitc)
        # device slots of hits and of padding; the main program writes the misses'
        tl.store(ds_p + kc, tl.where(hitc, hintc, -1), mask=(kc < K) & (hitc | ~selc))

    else:
        kk = tl.arange(0, BLOCK_K)
        ss = tl.arange(0, BLOCK_S)
        raw = _row_ids(topk_ptr, alt_ptr, b, stride_topk, stride_alt, kk, kk < K, u, HAS_ALT)
        li_p = load_ids_ptr + b.to(tl.int64) * stride_out
        ls_p = load_slots_ptr + b.to(tl.int64) * stride_out
        lu_row = tl.load(lu_p + ss, mask=ss < S, other=INT_MAX)
        res_row = tl.load(res_p + ss, mask=ss < S, other=-1)
        sel = kk < nvalid
        # Ids are validated by the caller (check_lru_diff_values); clamping keeps a bad id
        # from touching another request's state when validation is off.
        ids = tl.minimum(tl.maximum(raw, 0), M - 1)
        hint = tl.load(so_p + ids, mask=sel, other=-1)
        hint = tl.where(hint < S, hint, -1)  # a corrupted reverse map stays inside the row
        # Buffer side, independent of the gather in flight: the oldest stamp and the number
        # of slots stamped with each of the WINDOW values from it up (16-bit fields, one sum).
        lo_stamp = tl.min(lu_row, 0)
        d = lu_row - lo_stamp
        cs = tl.sum(tl.where((d >= 0) & (d < WINDOW), tl.full([BLOCK_S], 1, tl.int64) << (16 * d).to(tl.int64), 0), 0)
        hit = (hint >= 0) & (tl.gather(res_row, tl.maximum(hint, 0), 0) == ids)
        slot = tl.where(hit, hint, -1)
        miss = sel & ~hit
        # Each missed id is claimed for its first column (the smallest marker wins) while the
        # threshold is searched; read back after the install barrier. Only misses write
        # markers (a helper reading one takes the id for a miss, which it is) and the install
        # overwrites every claimed entry.
        marker = kk + INT_MIN
        tl.atomic_min(so_p + ids, marker, mask=miss, sem="relaxed")
        # the one K-wide value kept past the victim search: missed ids, -1 elsewhere (a valid
        # column that is not a miss is a hit, whose slot_of entry no claim touches)
        mids = tl.where(miss, ids, -1)
        miss_i = miss.to(tl.int32)
        mrank = _exclusive_cumsum(miss_i, BLOCK_K, SCAN_R)
        if HELPERS == 0:
            tl.store(ds_p + kk, slot, mask=(kk < K) & ~miss)
        # old stamp of each hit's slot; the hits' counts per window value, with the number
        # of misses in the top field
        hk = tl.where(hit, tl.gather(lu_row, tl.maximum(slot, 0), 0), INT_MAX)
        dh = hk - lo_stamp  # (wraps for stamps 2^31 apart, as d does: both sides drop dh < 0)
        in_win = hit & (dh >= 0) & (dh < WINDOW)
        packed = tl.sum(tl.where(in_win, tl.full([BLOCK_K], 1, tl.int64) << (16 * dh).to(tl.int64), 0)
                        + (miss_i.to(tl.int64) << 48), 0)
        nmiss = (packed >> 48).to(tl.int32)
        ch = packed & 0xFFFFFFFFFFFF
        # Load lists (only this program knows the misses: a helper may already see this
        # launch's refills). Miss side: ids to their rank, -1 tails; the victims fill
        # load_slots later.
        if MISS_SIDE:
            tl.store(li_p + mrank, ids, mask=miss)
            tl.store(li_p + kk, tl.full([BLOCK_K], -1, tl.int32), mask=(kk < K) & (kk >= nmiss))
            # every rank starts without a victim: a rank left so, or a victim ranked past the
            # misses, shows after the install barrier
            tl.store(ls_p + kk, tl.full([BLOCK_K], -1, tl.int32), mask=kk < K)
        else:
            # misses to their rank, every other column to the -1 tail: one dense store
            # each; load_slots carries the miss's column until its victim replaces it
            dst = tl.where(miss, mrank, nmiss + kk - mrank)
            tl.store(li_p + dst, tl.where(miss, ids, -1), mask=kk < K)
            tl.store(ls_p + dst, tl.where(miss, kk, -1), mask=kk < K)
        tl.store(num_loads_ptr + b, nmiss)

        # Threshold T; below = non-hit slots stamped < T; rel = hits stamped <= T. (An
        # explicit done flag: any int32 is a legal stamp of a corrupted state, none is a
        # safe "not found" sentinel.)
        zero = nmiss * 0
        done = (nmiss == 0).to(tl.int32)
        T = zero
        below = zero
        rel = zero
        acc = zero
        acc_h = zero
        for w in tl.static_range(WINDOW):
            cs_w = ((cs >> (16 * w)) & 0xFFFF).to(tl.int32)
            ch_w = ((ch >> (16 * w)) & 0xFFFF).to(tl.int32)
            nxt = acc + cs_w - ch_w
            first = (done == 0) & (nxt >= nmiss)
            T = tl.where(first, lo_stamp + w, T)
            below = tl.where(first, acc, below)
            rel = tl.where(first, acc_h + ch_w, rel)
            done = done | first.to(tl.int32)
            acc = nxt
            acc_h = acc_h + ch_w
        nonhits = S - (nvalid - nmiss)
        if (done == 0) & (nmiss >= nonhits):
            # every non-hit slot is a victim (K close to S): no search; stamps are below
            # INT_MAX - 1 (the step range)
            T = zero + (INT_MAX - 1)
            below = nonhits
            rel = nvalid - nmiss
            done = zero + 1
        if done == 0:
            # the window's stamps hold too few victims: next distinct stamps, then bisect
            lo = lo_stamp + (WINDOW - 1)
            go = done == 0
            r = zero
            while go:
                cand = tl.where(lu_row > lo, lu_row, INT_MAX)
                mn, c = tl.reduce((cand, tl.full([BLOCK_S], 1, tl.int32)), 0, _min_count)
                c = c - tl.sum((hk == mn).to(tl.int32), 0)
                found = acc + c >= nmiss
                T = tl.where(found, mn, T)
                below = tl.where(found, acc, below)
                done = done | found.to(tl.int32)
                acc = acc + c
                lo = mn
                r += 1
                go = (found == 0) & (r < MAX_ROUNDS)
            if done == 0:
                hi = tl.max(tl.where(lu_row < INT_MAX, lu_row, INT_MIN), 0).to(tl.int64)
                lb = lo.to(tl.int64)
                while hi - lb > 1:
                    mid = (lb + (hi - lb) // 2).to(tl.int32)
                    c = tl.sum((lu_row <= mid).to(tl.int32), 0) - tl.sum((hk <= mid).to(tl.int32), 0)
                    big = c >= nmiss
                    hi = tl.where(big, mid.to(tl.int64), hi)
                    lb = tl.where(big, lb, mid.to(tl.int64))
                T = hi.to(tl.int32)
                below = tl.sum((lu_row < T).to(tl.int32), 0) - tl.sum((hk < T).to(tl.int32), 0)
            rel = tl.sum((hk <= T).to(tl.int32), 0)
        cand = lu_row <= T  # (with no misses there is no victim: vrank < nmiss = 0)
        if rel > 0:
            # hits among the eviction candidates: stamp them and read the candidates back
            tl.store(lu_p + slot, tl.zeros_like(slot) + step, mask=hit & (hk <= T))
            tl.debug_barrier()
            now = tl.load(lu_p + ss, mask=cand & (ss < S), other=0)
            nonhit = cand & (now != step)
        else:
            nonhit = cand
        chosen, vrank = _rank_victims(nonhit, lu_row, T, below, nmiss, BLOCK_S, SCAN_R)
        # 0 <= vrank < nmiss for a consistent state and distinct ids. A victim ranked from
        # nmiss on means duplicate hits made the counts short (T too high): it marks the
        # lists' -1 tail, checked after the barrier. (The tail's -1 stores precede the scan's
        # block barriers.)
        victim = chosen & (vrank < nmiss)
        over = chosen & (vrank >= nmiss) & (vrank < K)
        if MISS_SIDE:
            # victims list themselves by rank; each miss reads the victim of its rank
            tl.store(ls_p + vrank, ss, mask=victim | over)
            tail_p = ls_p
        else:
            tl.store(li_p + vrank, tl.full([BLOCK_S], -2, tl.int32), mask=over)
            tail_p = li_p
        tl.debug_barrier()
        missed = mids >= 0
        # (.cg: the claims were made at L2, the hint gather may have left the lines in L1)
        claim = tl.load(so_p + mids, mask=missed, other=0, cache_modifier=".cg")
        tail = tl.load(tail_p + kk, mask=(kk < K) & (kk >= nmiss), other=-1)
        if MISS_SIDE:
            vslot = tl.load(ls_p + mrank, mask=missed, other=-1)
            bad = (missed & ((claim != marker) | (vslot < 0))) | (tail != -1)
        else:
            # each victim takes the miss of its rank (listed above by other threads)
            new_id = tl.load(li_p + vrank, mask=victim, other=0)
            col = tl.load(ls_p + vrank, mask=victim, other=0)
            bad = (missed & (claim != marker)) | (tail != -1)
        redo = tl.max(bad.to(tl.int32), 0)
        if redo > 0:
            _exact_path(topk_ptr, alt_ptr, u, resident_ptr, last_used_ptr, slot_of_ptr, dev_slots_ptr, load_ids_ptr,
                        load_slots_ptr, num_loads_ptr, row, b, nvalid, step, M, stride_topk, stride_alt, stride_state,
                        stride_slot_of, stride_out, K, S, BLOCK_K, BLOCK_S, SCAN_R, MISS_SIDE, HAS_ALT)
        else:
            if MISS_SIDE:
                _install_from_misses(ds_p, so_p, res_p, lu_p, kk, mids, missed, vslot, step, S)
            else:
                _install_by_victims(ds_p, so_p, res_p, lu_p, ls_p, ss, victim, vrank, new_id, col, step)
        if HELPERS == 0:
            tl.store(lu_p + slot, tl.zeros_like(slot) + step, mask=slot >= 0)


# Launch defaults by buffer block size (overrides below; the benchmark fills them from its
# sweep and records its pick beside the built-in default).
NUM_WARPS_BY_BLOCK_S: dict[int, int] = {}
SCAN_R_BY_BLOCK_S: dict[int, int] = {}
DEFAULT_SCAN_R = 4
WINDOW = 3
MAX_ROUNDS = 4


def default_scan_r(block_s: int) -> int:
    return SCAN_R_BY_BLOCK_S.get(block_s, DEFAULT_SCAN_R)


def default_num_warps(block_s: int) -> int:
    if block_s in NUM_WARPS_BY_BLOCK_S:
        return NUM_WARPS_BY_BLOCK_S[block_s]
    # 16 warps from S = 8192, where 8 run out of registers (the buffer row is held in registers)
    return 16 if block_s >= 8192 else 8 if block_s >= 2048 else 4


def default_miss_side(block_k: int, block_s: int) -> bool:
    """Install from the miss side when the buffer is at least 4x the top-k width: its
    passes are K wide instead of S wide (measured: docs/kernels.md)."""
    return block_s >= 4 * block_k


def default_helpers(batch: int, device: torch.device) -> int:
    """Helper programs per row: one while every row's two programs get an SM of their own
    (a helper sharing an SM with a main program slows both down), else none. (Runs per
    layer per step: the SM count is looked up once per device.)"""
    if device.type != "cuda":
        return 1  # the interpreter runs programs one by one; exercise the helper path
    return 1 if 2 * batch <= sm_count(device) else 0


def lru_diff_triton(topk: torch.Tensor, valid: torch.Tensor, resident: torch.Tensor, last_used: torch.Tensor,
                    slot_of: torch.Tensor, step: Union[int, torch.Tensor], *, rows: Optional[torch.Tensor] = None,
                    out: Optional[LruDiffResult] = None, num_warps: Optional[int] = None,
                    scan_r: Optional[int] = None, helpers: Optional[int] = None,
                    miss_side: Optional[bool] = None, choice: Any = None) -> LruDiffResult:
    """Triton LRU diff: one launch, ``1 + helpers`` programs per batch row. ``out`` reuses
    result buffers (fixed addresses for CUDA graphs). ``K`` and ``S`` are compile-time
    constants: one compile per (top-k width, buffer size), which a deployment fixes (the
    coordinator pads top-k to ``K``). ``choice``: rows that do not use ``topk`` read
    ``choice.ids`` / ``choice.count`` (the same result as on ``choice.apply``'s output)."""
    _check_args(topk, valid, resident, last_used, slot_of, rows)
    if choice is not None:
        choice.check(topk, valid)
    if scan_r is not None and (not isinstance(scan_r, int) or scan_r < 1 or scan_r & (scan_r - 1)):
        raise ValueError(f"scan_r must be a power of two >= 1 (1, 2, 4, 8, ...), got {scan_r!r}")
    if miss_side is not None and not isinstance(miss_side, bool):
        raise ValueError(f"miss_side must be None (by shape), True or False, got {miss_side!r}")
    if helpers is not None and helpers not in (0, 1, 2, 4):
        raise ValueError(f"helpers must be one of 0, 1, 2, 4 (programs per row that stamp hits), got {helpers!r}")
    dev = topk.device
    b, k = topk.shape
    s = resident.shape[1]
    st = _step_tensor(step, dev)
    rows_t = torch.arange(b, device=dev, dtype=torch.int64) if rows is None else rows.to(dev, torch.int64)
    if out is None:
        out = LruDiffResult(
            torch.empty(b, k, dtype=torch.int32, device=dev), torch.empty(b, k, dtype=torch.int32, device=dev),
            torch.empty(b, k, dtype=torch.int32, device=dev), torch.empty(b, dtype=torch.int32, device=dev),
        )
    _check_out(out, b, k, dev)
    if b == 0 or k == 0:
        out.device_slots.fill_(-1), out.load_ids.fill_(-1), out.load_slots.fill_(-1), out.num_loads.zero_()
        if out.num_valid is not None:
            out.num_valid.zero_()
        return out
    topk_c = topk if topk.stride(1) == 1 else topk.contiguous()
    valid = valid if valid.is_contiguous() else valid.contiguous()
    rows_t = rows_t if rows_t.is_contiguous() else rows_t.contiguous()
    block_s = triton.next_power_of_2(s)
    block_k = triton.next_power_of_2(k)
    nw = num_warps if num_warps is not None else default_num_warps(block_s)
    r = min(scan_r if scan_r is not None else default_scan_r(block_s), block_k)
    h = default_helpers(b, dev) if helpers is None else helpers
    h = min(h, block_k)
    _lru_diff_kernel[(1 + h, b)](
        topk_c, valid, rows_t, resident, last_used, slot_of, st,
        out.device_slots, out.load_ids, out.load_slots, out.num_loads,
        out.num_valid if out.num_valid is not None else out.num_loads,
        *((choice.use, choice.ids, choice.count) if choice is not None else (valid, topk_c, valid)),
        slot_of.shape[1], topk_c.stride(0), resident.stride(0), slot_of.stride(0), out.device_slots.stride(0),
        choice.ids.stride(0) if choice is not None else 0,
        K=k, S=s, BLOCK_K=block_k, BLOCK_S=block_s, SCAN_R=r, WINDOW=WINDOW, MAX_ROUNDS=MAX_ROUNDS, HELPERS=h,
        MISS_SIDE=int(default_miss_side(block_k, block_s) if miss_side is None else miss_side),
        HAS_NVALID=out.num_valid is not None, HAS_ALT=choice is not None, num_warps=nw,
    )
    return out


def lru_diff(topk: torch.Tensor, valid: torch.Tensor, resident: torch.Tensor, last_used: torch.Tensor,
             slot_of: torch.Tensor, step: Union[int, torch.Tensor], *, rows: Optional[torch.Tensor] = None,
             out: Optional[LruDiffResult] = None, choice: Any = None) -> LruDiffResult:
    """The LRU diff of one layer's batch (module docstring); Triton on CUDA, the torch
    reference elsewhere."""
    impl = dispatch("lru_diff", topk, lru_diff_triton, lru_diff_reference)
    return impl(topk, valid, resident, last_used, slot_of, step, rows=rows, out=out, choice=choice)
