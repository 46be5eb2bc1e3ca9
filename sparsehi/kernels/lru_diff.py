"""LRU diff: which selected ids are already in a request's GPU buffer, which slots to
evict for the rest, and the host->device load map — one launch for a whole batch of one
layer.

Policy: exact LRU. Each state row keeps its slots in recency order (``order``, least
recently used first). Each step the ``num_misses`` least recently used slots that this step
did not select are evicted and refilled, the j-th miss (in ``topk`` column order) taking
the j-th victim. The new order is ``[slots not used this step, old order kept][hit slots,
in topk column order][refilled slots, in miss order]`` — so ties between slots used in the
same step are broken by their column in ``topk``, hits before refills. A fresh state
(``order = arange``, ``last_used = -1``) takes empty slots in slot order.

Why an ``order`` array: ranking slots by recency would need a sort of ``S`` keys per row
every layer. With the order kept, the victims are the first ``num_misses`` non-hit entries
of ``order`` (one prefix sum), the survivors keep their order (same prefix sum) and the
used slots go to the tail at positions known from the ``topk`` columns. No ``K x S``
compare, no sort: phase 1 is a gather through the reverse map ``slot_of``; the buffer-side
work reads each state row once, coalesced, and gathers within registers.

Shapes (``B`` batch rows, ``K`` top-k width, ``S`` buffer slots, ``M`` logical ids per
request; ``R`` state rows, ``R = B`` unless ``rows`` maps batch rows to state rows):
    topk      ``[B, K] int32`` logical ids, the first ``valid[b]`` of row b valid, ``-1`` after
    valid     ``[B] int32``
    resident  ``[R, S] int32`` logical id held by each slot, ``-1`` empty       (updated)
    last_used ``[R, S] int32`` step of last use, ``-1`` never                   (updated)
    slot_of   ``[R, M] int32`` logical id -> slot, ``-1`` not resident          (updated)
    order     ``[R, S] int32`` slots, least recently used first                 (updated)
              (None: derived from ``last_used``, ties by slot index — exact only for
              states that never had two slots used in one step, e.g. fresh ones)
    step      int or ``[1] int32`` tensor (graph-safe); strictly larger than every earlier
              step used with this state. Repeating a step is not detected here (it would
              need a host sync) and corrupts the state: the kernel takes slots stamped with
              the current step as this step's hits. SparseKVCacheManager keeps each layer's
              last step on the host and rejects a second diff in one step.
    rows      ``[B] int64`` state row of each batch row (distinct), optional
Out: ``device_slots [B, K] int32`` (slot of each selected id, -1 pad), ``load_ids [B, K]``
(missed ids, compacted, -1 pad), ``load_slots [B, K]`` (their slots), ``num_loads [B]``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch
import triton
import triton.language as tl

from hicache.triton_support import announce_path, use_triton


@dataclass
class LruDiffResult:
    """device_slots/load_ids/load_slots ``[B, K] int32`` (-1 padded), num_loads ``[B] int32``."""

    device_slots: torch.Tensor
    load_ids: torch.Tensor
    load_slots: torch.Tensor
    num_loads: torch.Tensor


# --------------------------------------------------------------------------- validation
def _check_args(topk, valid, resident, last_used, slot_of, order, rows) -> None:
    """Shape/dtype checks only: no host sync, safe inside CUDA graphs."""
    def need(cond: bool, msg: str) -> None:
        if not cond:
            raise ValueError(msg)

    need(topk.dim() == 2 and topk.dtype == torch.int32, f"topk must be [B, K] int32, got {tuple(topk.shape)} {topk.dtype}")
    b, k = topk.shape
    need(valid.shape == (b,) and valid.dtype == torch.int32, f"valid must be [B={b}] int32, got {tuple(valid.shape)} {valid.dtype}")
    need(resident.dim() == 2 and resident.dtype == torch.int32, f"resident must be [R, S] int32, got {tuple(resident.shape)} {resident.dtype}")
    r, s = resident.shape
    need(k <= s, f"topk width K={k} exceeds buffer slots S={s}: K must be <= S (raise device_buffer_size or lower top_k)")
    need(last_used.shape == (r, s) and last_used.dtype == torch.int32, f"last_used must be [R={r}, S={s}] int32, got {tuple(last_used.shape)} {last_used.dtype}")
    need(slot_of.dim() == 2 and slot_of.shape[0] == r and slot_of.dtype == torch.int32,
         f"slot_of must be [R={r}, M] int32, got {tuple(slot_of.shape)} {slot_of.dtype}")
    if order is not None:
        need(order.shape == (r, s) and order.dtype == torch.int32, f"order must be [R={r}, S={s}] int32, got {tuple(order.shape)} {order.dtype}")
    if rows is None:
        need(r == b, f"without rows, state must have B={b} rows, got {r}")
    else:
        need(rows.shape == (b,), f"rows must be [B={b}] int64, got {tuple(rows.shape)}")
    for name, t in (("resident", resident), ("last_used", last_used), ("slot_of", slot_of), ("order", order)):
        if t is not None:
            need(t.stride(1) == 1, f"{name} must be contiguous in its last dim")
    for name, t in (("valid", valid), ("resident", resident), ("last_used", last_used), ("slot_of", slot_of)):
        need(t.device == topk.device, f"{name} is on {t.device}, topk on {topk.device}: all on one device")


def check_lru_diff_values(topk: torch.Tensor, valid: torch.Tensor, num_ids: int | torch.Tensor,
                          rows: Optional[torch.Tensor] = None, num_rows: Optional[int] = None) -> None:
    """Value checks (sync with the host): ``valid`` in ``[0, K]``, ids in ``[0, num_ids)``
    (an int, or ``[B]`` per-row limits), ``-1`` padding after ``valid``, no duplicate id in a
    row, distinct ``rows``. Raises ValueError; call before the kernel so state is untouched."""
    b, k = topk.shape
    v = valid.long()
    if bool(((v < 0) | (v > k)).any()):
        raise ValueError(f"valid must lie in [0, K={k}] per row, got {valid.tolist()}")
    cols = torch.arange(k, device=topk.device)[None, :]
    in_range = cols < v[:, None]
    t = topk.long()
    if bool(((t >= 0) != in_range).any()):
        raise ValueError("topk must hold valid[b] ids >= 0 then -1 padding in every row")
    lim = torch.as_tensor(num_ids, device=topk.device).long()
    lim = lim[:, None] if lim.dim() == 1 else lim
    if bool((in_range & (t >= lim)).any()):
        raise ValueError(f"topk holds ids beyond the request's length (allowed: [0, {num_ids if isinstance(num_ids, int) else 'per-row limit'}))")
    srt, _ = torch.sort(torch.where(in_range, t, -1 - cols), dim=1)
    if bool((srt[:, 1:] == srt[:, :-1]).any()):
        raise ValueError("topk holds duplicate ids in a row")
    if rows is not None:
        rl = rows.long()
        if rl.unique().numel() != rl.numel():
            raise ValueError("rows must be distinct (two batch rows cannot share one buffer state)")
        if num_rows is not None and bool(((rl < 0) | (rl >= num_rows)).any()):
            raise ValueError(f"rows must lie in [0, {num_rows})")


def order_from_last_used(last_used: torch.Tensor) -> torch.Tensor:
    """``[R, S] int32`` slots sorted by (last_used, slot): the LRU order of a state."""
    s = last_used.shape[1]
    key = last_used.long() * s + torch.arange(s, device=last_used.device)
    return torch.argsort(key, dim=1).to(torch.int32)


def _step_tensor(step: Union[int, torch.Tensor], device: torch.device) -> torch.Tensor:
    if isinstance(step, torch.Tensor):
        if step.numel() != 1:
            raise ValueError(f"step must be an int or a one-element tensor, got shape {tuple(step.shape)}")
        return step.reshape(1).to(device=device, dtype=torch.int32)
    if not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be an int >= 0, got {step!r}")
    return torch.tensor([step], dtype=torch.int32, device=device)


# --------------------------------------------------------------------------- reference
def lru_diff_reference(topk: torch.Tensor, valid: torch.Tensor, resident: torch.Tensor, last_used: torch.Tensor,
                       slot_of: torch.Tensor, step: Union[int, torch.Tensor], *, order: Optional[torch.Tensor] = None,
                       rows: Optional[torch.Tensor] = None) -> LruDiffResult:
    """Plain-torch LRU diff (same contract and results as the kernel)."""
    _check_args(topk, valid, resident, last_used, slot_of, order, rows)
    dev = topk.device
    b, k = topk.shape
    s = resident.shape[1]
    st = _step_tensor(step, dev).long()
    ridx = torch.arange(b, device=dev) if rows is None else rows.to(dev).long()
    res, lu, so = resident[ridx].long(), last_used[ridx].long(), slot_of[ridx].long()
    od = order_from_last_used(last_used[ridx]).long() if order is None else order[ridx].long()
    cols = torch.arange(k, device=dev)[None, :]
    sel = cols < valid.long().clamp(0, k)[:, None]
    ids = torch.where(sel, topk.long(), torch.zeros_like(topk, dtype=torch.long))
    ids = ids.clamp(0, so.shape[1] - 1)  # as the kernel: unvalidated bad ids stay inside the row
    slot = torch.where(sel, so.gather(1, ids), torch.full_like(ids, -1))
    hit = slot >= 0
    miss = sel & ~hit
    nmiss = miss.sum(1)
    hit_mask = torch.zeros(b, s + 1, dtype=torch.bool, device=dev)
    hit_mask.scatter_(1, torch.where(hit, slot, s), True)
    nonhit = ~hit_mask[:, :s].gather(1, od)  # in order-position space
    # victims: the non-hit entries of the order, least recent first
    victims = od.gather(1, torch.sort((~nonhit).to(torch.int8), dim=1, stable=True).indices)
    mrank = torch.cumsum(miss.long(), 1) - miss.long()
    miss_slot = victims.gather(1, torch.where(miss, mrank, 0))
    device_slots = torch.where(hit, slot, torch.where(miss, miss_slot, torch.full_like(slot, -1)))
    load_valid = cols.expand(b, k) < nmiss[:, None]
    load_slots = torch.where(load_valid, victims[:, :k], torch.full_like(victims[:, :k], -1))
    spill = torch.full((b, k + 1), -1, dtype=torch.long, device=dev)
    spill.scatter_(1, torch.where(miss, mrank, k), ids)  # non-misses land in the spill column k
    load_ids = spill[:, :k]
    # state: drop evicted ids from the reverse map, install the misses
    old = torch.where(load_valid, res.gather(1, torch.where(load_valid, load_slots, 0)), -1)
    m = so.shape[1]
    so_ext = torch.cat([so, torch.full((b, 1), -1, dtype=torch.long, device=dev)], 1)  # spill column m
    so_ext.scatter_(1, torch.where(old >= 0, old, m), -1)
    so_ext.scatter_(1, torch.where(miss, ids, m), torch.where(miss, device_slots, -1))
    res_ext = torch.cat([res, torch.full((b, 1), -1, dtype=torch.long, device=dev)], 1)
    res_ext.scatter_(1, torch.where(miss, device_slots, s), ids)
    lu_ext = torch.cat([lu, torch.full((b, 1), -1, dtype=torch.long, device=dev)], 1)
    lu_ext.scatter_(1, torch.where(sel, device_slots, s), st.expand(b, k).clone())
    # new order: survivors (old order) | hits (column order) | refills (miss order)
    nrank = torch.cumsum(nonhit.long(), 1) - nonhit.long()
    surv = nonhit & (nrank >= nmiss[:, None])
    key = torch.cat([torch.where(surv, 0, 3), torch.where(hit, 1, torch.where(miss, 2, 3))], 1)
    vals = torch.cat([od, device_slots], 1)
    new_order = vals.gather(1, torch.sort(key.to(torch.int8), dim=1, stable=True).indices)[:, :s]
    resident[ridx] = res_ext[:, :s].to(torch.int32)
    last_used[ridx] = lu_ext[:, :s].to(torch.int32)
    slot_of[ridx] = so_ext[:, :m].to(torch.int32)
    if order is not None:
        order[ridx] = new_order.to(torch.int32)
    return LruDiffResult(device_slots.to(torch.int32), load_ids.to(torch.int32), load_slots.to(torch.int32),
                         nmiss.to(torch.int32))


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
def _lru_diff_kernel(
    topk_ptr, valid_ptr, rows_ptr, resident_ptr, last_used_ptr, order_ptr, slot_of_ptr, step_ptr,
    dev_slots_ptr, load_ids_ptr, load_slots_ptr, num_loads_ptr,
    M, stride_topk, stride_state, stride_slot_of, stride_out,
    K: tl.constexpr, S: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_S: tl.constexpr, SCAN_R: tl.constexpr,
):
    # One program per batch row; the row's whole selection and buffer fit one block, so the
    # phases only need block barriers between them. The time is one row's latency: a few
    # dependent global round trips plus instruction issue on one SM, so loads that do not
    # depend on each other are issued together and K, S are compile-time constants (no
    # bounds masks when they are powers of two).
    b = tl.program_id(0)
    kk = tl.arange(0, BLOCK_K)
    ss = tl.arange(0, BLOCK_S)
    row = tl.load(rows_ptr + b).to(tl.int64)
    step = tl.load(step_ptr)
    nvalid = tl.minimum(tl.load(valid_ptr + b), K)
    # topk is read whole (its -1 padding is masked by `valid` below), so it does not wait
    # for `valid`.
    if K == BLOCK_K:
        raw = tl.load(topk_ptr + b.to(tl.int64) * stride_topk + kk)
    else:
        raw = tl.load(topk_ptr + b.to(tl.int64) * stride_topk + kk, mask=kk < K, other=0)
    res_p = resident_ptr + row * stride_state
    lu_p = last_used_ptr + row * stride_state
    ord_p = order_ptr + row * stride_state
    so_p = slot_of_ptr + row * stride_slot_of
    out = b.to(tl.int64) * stride_out
    ds_p = dev_slots_ptr + out
    li_p = load_ids_ptr + out
    ls_p = load_slots_ptr + out
    # The order and resident rows depend only on `row`: fetched now, their latency hides
    # behind the reverse-map gather. (Nothing writes them before the barriers below.)
    if S == BLOCK_S:
        osl = tl.load(ord_p + ss)
        res_row = tl.load(res_p + ss)
    else:
        osl = tl.load(ord_p + ss, mask=ss < S, other=0)
        res_row = tl.load(res_p + ss, mask=ss < S, other=-1)

    # Phase 1: intersect via the reverse map (a gather, no K x S compare).
    sel = kk < nvalid
    # Ids are validated by the caller (check_lru_diff_values); clamping keeps a bad id from
    # touching another request's state when validation is off.
    ids = tl.minimum(tl.maximum(raw, 0), M - 1)
    slot = tl.load(so_p + ids, mask=sel, other=-1)  # -1: miss or past valid
    miss_i = (sel & (slot < 0)).to(tl.int32)
    mrank = _exclusive_cumsum(miss_i, BLOCK_K, SCAN_R)
    nmiss = tl.sum(miss_i, 0)
    # Marking hits in last_used is both the state update and the slot-indexed scatter that
    # phase 2 reads back (registers cannot scatter). Misses are compacted by rank.
    tl.store(lu_p + slot, tl.zeros_like(slot) + step, mask=slot >= 0)
    tl.store(li_p + mrank, ids, mask=miss_i != 0)
    pad = (kk >= nmiss) & (kk < K)
    tl.store(li_p + kk, tl.full([BLOCK_K], -1, tl.int32), mask=pad)
    tl.store(ls_p + kk, tl.full([BLOCK_K], -1, tl.int32), mask=pad)
    tl.store(num_loads_ptr + b, nmiss)
    tl.debug_barrier()

    # Phase 2: victims = the first nmiss non-hit slots in LRU order (hits were just marked
    # with `step` in last_used). The row is read coalesced and indexed in registers (random
    # global gathers would serialise on the one SM that owns the row).
    if S == BLOCK_S:
        lu_row = tl.load(lu_p + ss)
        nh_i = (tl.gather(lu_row, osl, 0) != step).to(tl.int32)
    else:
        lu_row = tl.load(lu_p + ss, mask=ss < S, other=0)
        nh_i = ((tl.gather(lu_row, osl, 0) != step) & (ss < S)).to(tl.int32)
    nrank = _exclusive_cumsum(nh_i, BLOCK_S, SCAN_R)
    evict = (nh_i != 0) & (nrank < nmiss)
    old = tl.gather(res_row, osl, 0)
    tl.store(ls_p + nrank, osl, mask=evict)
    tl.store(ord_p + (nrank - nmiss), osl, mask=(nh_i != 0) & (nrank >= nmiss))  # survivors
    tl.store(so_p + old, tl.full([BLOCK_S], -1, tl.int32), mask=evict & (old >= 0))
    tl.debug_barrier()

    # Phase 3: each miss takes the victim of its rank; install it and finish the order:
    # [survivors][hits in column order][refills in miss order].
    miss = miss_i != 0
    ms = tl.load(ls_p + mrank, mask=miss, other=0)
    tl.store(res_p + ms, ids, mask=miss)
    tl.store(lu_p + ms, tl.zeros_like(ms) + step, mask=miss)
    tl.store(so_p + ids, ms, mask=miss)
    dev = tl.where(miss, ms, slot)  # slot of every selected id; -1 past valid
    tl.store(ds_p + kk, dev, mask=kk < K)
    # hits at tail + (hits before them), refills after all hits, in miss order
    tail = S - nvalid
    tl.store(ord_p + tail + tl.where(miss, (nvalid - nmiss) + mrank, kk - mrank), dev, mask=sel)


# Warps per program by buffer block size (overrides of the default below; the benchmark
# fills it from its sweep).
NUM_WARPS_BY_BLOCK_S: dict[int, int] = {}


# Pair-folding depth of the prefix sums (``_exclusive_cumsum``'s R) by buffer block size,
# overrides of DEFAULT_SCAN_R (the benchmark sweeps it with num_warps).
SCAN_R_BY_BLOCK_S: dict[int, int] = {}
DEFAULT_SCAN_R = 4


def default_scan_r(block_s: int) -> int:
    return SCAN_R_BY_BLOCK_S.get(block_s, DEFAULT_SCAN_R)


def default_num_warps(block_s: int) -> int:
    if block_s in NUM_WARPS_BY_BLOCK_S:
        return NUM_WARPS_BY_BLOCK_S[block_s]
    # H200, B=64, K=2048 (benchmarks/results/lru_diff.json): 8 and 16 warps are within
    # 0.5-3 % of each other for S = 2048..8192 at scan_r 2..8 (scan_r 1, the plain
    # tl.cumsum, is 12-28 % slower); 4 warps spill. The benchmark re-sweeps and records its
    # pick beside this default.
    return 8 if block_s >= 2048 else 4


def lru_diff_triton(topk: torch.Tensor, valid: torch.Tensor, resident: torch.Tensor, last_used: torch.Tensor,
                    slot_of: torch.Tensor, step: Union[int, torch.Tensor], *, order: Optional[torch.Tensor] = None,
                    rows: Optional[torch.Tensor] = None, out: Optional[LruDiffResult] = None,
                    num_warps: Optional[int] = None, scan_r: Optional[int] = None) -> LruDiffResult:
    """Triton LRU diff: one launch, one program per batch row. ``out`` reuses result buffers
    (fixed addresses for CUDA graphs). Without ``order`` one is derived from ``last_used``
    (an argsort: pass the manager's ``order`` on the hot path). ``K`` and ``S`` are
    compile-time constants of the kernel: one compile per (top-k width, buffer size), which
    a deployment fixes (the coordinator pads top-k to ``K``)."""
    _check_args(topk, valid, resident, last_used, slot_of, order, rows)
    if scan_r is not None and (not isinstance(scan_r, int) or scan_r < 1 or scan_r & (scan_r - 1)):
        raise ValueError(f"scan_r must be a power of two >= 1 (1, 2, 4, 8, ...), got {scan_r!r}")
    dev = topk.device
    b, k = topk.shape
    s = resident.shape[1]
    st = _step_tensor(step, dev)
    rows_t = torch.arange(b, device=dev, dtype=torch.int64) if rows is None else rows.to(dev, torch.int64)
    own_order = order is None
    if own_order:
        order = torch.empty_like(resident)
        order[rows_t] = order_from_last_used(last_used[rows_t])
    if out is None:
        out = LruDiffResult(
            torch.empty(b, k, dtype=torch.int32, device=dev), torch.empty(b, k, dtype=torch.int32, device=dev),
            torch.empty(b, k, dtype=torch.int32, device=dev), torch.empty(b, dtype=torch.int32, device=dev),
        )
    if b == 0 or k == 0:
        out.device_slots.fill_(-1), out.load_ids.fill_(-1), out.load_slots.fill_(-1), out.num_loads.zero_()
        return out
    topk_c = topk if topk.stride(1) == 1 else topk.contiguous()
    block_s = triton.next_power_of_2(s)
    block_k = triton.next_power_of_2(k)
    nw = num_warps if num_warps is not None else default_num_warps(block_s)
    r = min(scan_r if scan_r is not None else default_scan_r(block_s), block_k)
    _lru_diff_kernel[(b,)](
        topk_c, valid, rows_t, resident, last_used, order, slot_of, st,
        out.device_slots, out.load_ids, out.load_slots, out.num_loads,
        slot_of.shape[1], topk_c.stride(0), resident.stride(0), slot_of.stride(0), out.device_slots.stride(0),
        K=k, S=s, BLOCK_K=block_k, BLOCK_S=block_s, SCAN_R=r, num_warps=nw,
    )
    return out


def lru_diff(topk: torch.Tensor, valid: torch.Tensor, resident: torch.Tensor, last_used: torch.Tensor,
             slot_of: torch.Tensor, step: Union[int, torch.Tensor], *, order: Optional[torch.Tensor] = None,
             rows: Optional[torch.Tensor] = None, out: Optional[LruDiffResult] = None) -> LruDiffResult:
    """Dispatch: Triton on CUDA (or CPU under the interpreter when forced), torch otherwise."""
    if use_triton(topk):
        announce_path("lru_diff", "triton")
        return lru_diff_triton(topk, valid, resident, last_used, slot_of, step, order=order, rows=rows, out=out)
    announce_path("lru_diff", "reference")
    res = lru_diff_reference(topk, valid, resident, last_used, slot_of, step, order=order, rows=rows)
    if out is not None:
        out.device_slots.copy_(res.device_slots), out.load_ids.copy_(res.load_ids)
        out.load_slots.copy_(res.load_slots), out.num_loads.copy_(res.num_loads)
        return out
    return res
