"""Top-k selection over per-id scores, shared by the built-in algorithms.

``topk_select`` is the decode path: one Triton launch (one program per row) that finds the
exact top ``top_k`` candidates of every row by radix select on the scores' bits and writes
them in ascending id order (``topk_select_triton``; ``topk_select_reference`` is the torch
twin with identical results); rows of 2048 to 8192 ids are held in registers and their
threshold bisected (``topk_bisect``), a batch too small to fill the GPU splits each row over
several programs (``topk_split``), and long rows at small batches that do not split so
(top 2048 of 32768, say) share one radix select among their chunks (``topk_radix_grid``).
``masked_topk`` is a torch top-k of another output order (a stable sort of the masked
scores, ids by descending score), which benchmarks and tests compare against;
``IdentityMemo`` caches its candidate mask across layers.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from hicache.triton_support import dispatch, sm_count
from sparsehi.kernels.radix_select import (_emit, _list_radix_pass, _order_keys, _shared_bits,
                                           _threshold_in_registers)
from sparsehi.kernels.topk_bisect import topk_select_bisect
from sparsehi.kernels.topk_radix_grid import CHUNK as RADIX_GRID_CHUNK, topk_select_radix_grid
from sparsehi.kernels.topk_split import _chunk_bounds, select_outputs, split_plan, topk_select_split

MIN_IDS_PER_TOP_K = 4
"""``radix_grid_plan`` takes rows of at least this many ids per id selected: below it the
boundary digit holds a large part of the row and one program per row is as fast."""
MIN_IDS = 8192
MAX_ROWS = 48
MAX_PROGRAMS = 3072
"""``radix_grid_plan`` takes at most ``MAX_ROWS`` rows and ``MAX_PROGRAMS`` chunk programs
(``B x P``). The grid's time grows with ``B x P`` (about 27 + 0.046 B P us on an H100,
``results/topk_long_rows.json``; 27 + 0.039 B P on an H200) while one program per row takes
the same time for any batch up to the SM count: past these the rows' own programs are as
fast or faster. 3072 (2048 before 2026-11-28) takes 39 and 48 rows of 131072 ids to the
grid: 1.30x and 1.08x one program per row for whole rows, 1.07x and 0.99x for rows of 32768
candidates in them (one H200, section ``max_programs``)."""
GRID_BEFORE_SPLIT_TOP_K = 2048
"""From this ``top_k`` the radix grid goes before the chunk shortlists where both plans
apply: top 2048 of 8192 ids took 27-29 us on the grid against 36-49 us in shortlists at
batch 1 and 30 (``results/topk_long_rows.json``, ``threshold_small_block``); at top 512 of
16384 the shortlists were faster in 11 of 12 rows before the grid's small register block."""


BISECT_MIN_IDS = 2048
BISECT_MAX_IDS = 8192
BISECT_MAX_IDS_MANY_ROWS = 16384
BISECT_SPLIT_RATIO = 64
"""``bisect_plan``'s bounds, from one H200, 2026-11-28 (``results/topk_long_rows.json``
section ``bisect``, CUDA-graph replays): rows of 2048 to 8192 ids took 1.2-2.0x less time
in registers than by the best other plan at batch 1-64 (3.4x at 200 rows of 2048), except
where the chunk shortlists keep a small part of the row (top 128 of 8192: the shortlists
0.79-0.99x of the time up to batch 30, so from ``BISECT_SPLIT_RATIO`` ids per id selected
they keep the rows where their plan applies); rows of 12288-16384 ids only from 64 rows
(1.08-1.5x; at batch 1-30 the radix grid was up to 1.28x faster); 32768 ids 1.5-3x slower
than the grid at every batch."""


def bisect_plan(batch: int, n: int, top_k: int, sms: int) -> bool:
    """Whether ``[batch, n]`` rows go to ``topk_bisect`` (one program per row, the row in
    registers, the threshold bisected) on a GPU of ``sms`` SMs: rows of ``BISECT_MIN_IDS`` to
    ``BISECT_MAX_IDS`` ids unless the chunk shortlists apply with ``BISECT_SPLIT_RATIO`` or
    more ids per id selected, and rows up to ``BISECT_MAX_IDS_MANY_ROWS`` ids past
    ``MAX_ROWS`` rows (where the radix grid stops)."""
    if n < BISECT_MIN_IDS or n <= top_k:
        return False
    if n <= BISECT_MAX_IDS:
        return n < BISECT_SPLIT_RATIO * top_k or split_plan(batch, n, top_k, sms) is None
    return batch > MAX_ROWS and n <= BISECT_MAX_IDS_MANY_ROWS


def radix_grid_plan(batch: int, n: int, top_k: int) -> Optional[int]:
    """The chunk count ``P = ceil(n / CHUNK)`` for ``[batch, n]`` rows of ``topk_radix_grid``,
    or None when the grid does not pay: rows shorter than ``MIN_IDS`` ids or than
    ``MIN_IDS_PER_TOP_K`` ids per id selected, more than ``MAX_ROWS`` rows or more than
    ``MAX_PROGRAMS`` chunk programs."""
    if n < MIN_IDS or n < MIN_IDS_PER_TOP_K * top_k or batch > MAX_ROWS:
        return None
    p = -(-n // RADIX_GRID_CHUNK)
    return p if batch * p <= MAX_PROGRAMS else None


def _capturing() -> bool:
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


class IdentityMemo:
    """One cached value keyed by the identity (and in-place version) of some tensors plus a
    few plain values: decode steps pass the same per-step tensors (req_pool_indices,
    seq_lens, candidate ranges) to every layer, so what is derived from them alone is
    computed by the first layer and reused by the others. A tensor modified in place
    bumps its version and misses the cache; the cached tensors are kept alive with the
    value, so an ``id`` cannot be reused while it is cached.

    CUDA graphs: nothing is cached while a graph is being captured (each call records its
    own build, so a replay recomputes from the replay's inputs: a static input buffer keeps
    its identity and version across replays), and a value built before the capture (its
    warm-up) is never handed to it."""

    def __init__(self) -> None:
        self._tensors: tuple = ()
        self._versions: tuple = ()
        self._extra: tuple = ()
        self._value = None

    def get(self, tensors: tuple, extra: tuple, build):
        if _capturing():
            return build()
        if (len(tensors) == len(self._tensors) and extra == self._extra
                and all(a is b for a, b in zip(tensors, self._tensors))
                and tuple(t._version for t in tensors) == self._versions):
            return self._value
        value = build()
        self._tensors, self._versions, self._extra = tuple(tensors), tuple(t._version for t in tensors), extra
        self._value = value
        return value


_ARANGE: dict = {}


def _arange(n: int, device: torch.device) -> torch.Tensor:
    key = (n, device)
    t = _ARANGE.get(key)
    if t is None:
        t = _ARANGE[key] = torch.arange(n, device=device)
    return t


def candidate_mask(
    num_ids: int,
    candidate_start: torch.Tensor,
    candidate_end: torch.Tensor,
    sparse_mask: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``[B, num_ids] bool``: id ``i`` of row ``b`` is selectable.

    candidate_start / candidate_end: ``[B]`` int, the half-open id range ``[start, end)``.
    sparse_mask: ``[B] bool`` or None; rows with False select nothing.
    """
    ids = _arange(num_ids, candidate_start.device)[None, :]
    mask = (ids >= candidate_start.long()[:, None]) & (ids < candidate_end.long()[:, None])
    if sparse_mask is not None:
        mask &= sparse_mask.to(device=mask.device, dtype=torch.bool)[:, None]
    return mask


def masked_topk(
    scores: torch.Tensor,
    top_k: int,
    candidate_start: torch.Tensor,
    candidate_end: torch.Tensor,
    sparse_mask: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top ``top_k`` ids per row among the candidates.

    scores:          ``[B, N]`` float, score of id ``i`` (ids ``>= N`` do not exist; ``-inf``
                     or NaN: not selectable).
    top_k:           int > 0, ids returned per row at most.
    candidate_start: ``[B]`` int, candidate_end: ``[B]`` int (clipped to ``[0, N]``).
    sparse_mask:     ``[B] bool`` or None; False rows return nothing.

    Returns ``(selected [B, top_k] int32`` ids by descending score, ``-1`` padded,
    ``valid [B] int32)``. Ties break towards the lower id (deterministic).
    """
    if not isinstance(top_k, int) or top_k <= 0:
        raise ValueError(f"top_k={top_k!r} is invalid: an integer > 0 (selection units)")
    if scores.dim() != 2:
        raise ValueError(f"scores must be [B, N], got shape {tuple(scores.shape)}")
    bsz, n = scores.shape
    dev = scores.device
    masks = (candidate_start, candidate_end) + (() if sparse_mask is None else (sparse_mask,))
    cand = _MASK_MEMO.get(masks, (n, dev), lambda: candidate_mask(
        n, candidate_start.to(dev).long().clamp(0, n), candidate_end.to(dev).long().clamp(0, n), sparse_mask))
    # A score of -inf (or NaN) means "not selectable" (e.g. a position the index does not
    # cover yet): such ids are neither selected nor counted in valid.
    s = torch.nan_to_num(scores.float(), nan=float("-inf"), posinf=torch.finfo(torch.float32).max, neginf=float("-inf"))
    s = torch.where(cand, s, float("-inf"))
    valid = (s > float("-inf")).sum(dim=1, dtype=torch.int32).clamp_(max=top_k)
    k_eff = min(top_k, n)
    if k_eff > 0:
        # stable sort gives lower-id-first among ties on every device
        _, order = torch.sort(s, dim=1, descending=True, stable=True)
        idx = order[:, :k_eff]
    else:
        idx = torch.empty(bsz, 0, dtype=torch.long, device=dev)
    cols = _arange(k_eff, dev)[None, :]
    sel = torch.where(cols < valid[:, None], idx, -1).to(torch.int32)
    if k_eff < top_k:
        out = torch.full((bsz, top_k), -1, dtype=torch.int32, device=dev)
        out[:, :k_eff] = sel
        sel = out
    return sel, valid


_MASK_MEMO = IdentityMemo()


# ----------------------------------------------------------------------------- topk_select
def _check_select_args(scores: object, top_k: object, candidate_start: object, candidate_end: object,
                       row_mask: object) -> None:
    if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k <= 0:
        raise ValueError(f"top_k={top_k!r} is invalid: an integer > 0 (selection units)")
    if not isinstance(scores, torch.Tensor) or scores.dim() != 2 or not scores.is_floating_point():
        got = (tuple(scores.shape), scores.dtype) if isinstance(scores, torch.Tensor) else type(scores).__name__
        raise ValueError(f"scores must be a floating [B, N] tensor, got {got}")
    b = scores.shape[0]
    for name, t in (("candidate_start", candidate_start), ("candidate_end", candidate_end)):
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != (b,) or t.dtype not in (torch.int32, torch.int64):
            got = (tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must be a [B={b}] int32/int64 tensor, got {got}")
    if row_mask is not None and (not isinstance(row_mask, torch.Tensor) or tuple(row_mask.shape) != (b,)
                                 or row_mask.dtype != torch.bool):
        got = (tuple(row_mask.shape), row_mask.dtype) if isinstance(row_mask, torch.Tensor) else type(row_mask).__name__
        raise ValueError(f"row_mask must be a [B={b}] bool tensor or None, got {got}")


def topk_select_reference(
    scores: torch.Tensor,
    top_k: int,
    candidate_start: torch.Tensor,
    candidate_end: torch.Tensor,
    row_mask: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of :func:`topk_select` (same arguments, identical results)."""
    _check_select_args(scores, top_k, candidate_start, candidate_end, row_mask)
    bsz, n = scores.shape
    dev = scores.device
    s = scores.float()
    ids = torch.arange(n, device=dev)[None, :]
    ok = ((ids >= candidate_start.to(dev).long()[:, None]) & (ids < candidate_end.to(dev).long()[:, None])
          & (s > float("-inf")))  # False for NaN too
    if row_mask is not None:
        ok &= row_mask.to(dev)[:, None]
    # -0.0 ties with +0.0 (the kernel compares bit patterns)
    s = torch.where(ok, torch.where(s == 0, torch.zeros_like(s), s), torch.full_like(s, float("-inf")))
    valid = ok.sum(dim=1).clamp(max=top_k).to(torch.int32)
    k_eff = min(top_k, n)
    out = torch.full((bsz, top_k), -1, dtype=torch.int32, device=dev)
    if k_eff > 0:
        # stable: lower id first among equal scores
        order = torch.sort(s, dim=1, descending=True, stable=True).indices[:, :k_eff]
        cols = torch.arange(k_eff, device=dev)[None, :]
        picked = torch.sort(torch.where(cols < valid[:, None], order, n), dim=1).values
        out[:, :k_eff] = torch.where(picked < n, picked, -1).to(torch.int32)
    return out, valid


@triton.jit
def _shortlist_chunk(row, list_keys, list_ids, offs, lo, hi, floor, m, count, lmax):
    """One chunk of the pass over the row: append the selectable ids whose key is
    ``>= floor`` (and their keys) to the shortlist, in id order; count every selectable id."""
    inr = (offs >= lo) & (offs < hi)
    key = _order_keys(tl.load(row + offs, mask=inr, other=float("-inf")), inr)
    ok = key != 0
    keep = ok & (key >= floor)
    ki = keep.to(tl.int32)
    at = m + tl.cumsum(ki, 0) - ki
    tl.store(list_keys + at, key.to(tl.int32, bitcast=True), mask=keep)
    tl.store(list_ids + at, offs, mask=keep)
    return m + tl.sum(ki, 0), count + tl.sum(ok.to(tl.int32), 0), tl.maximum(lmax, tl.max(tl.where(keep, key, 0), 0))


@triton.jit
def _topk_select_kernel(
    s_ptr, cs_ptr, ce_ptr, mask_ptr, ids_ptr, valid_ptr, work_ptr,
    N, TOP_K, stride_sb, stride_ib,
    HAS_ROW_MASK: tl.constexpr, SAMPLE: tl.constexpr, BLOCK: tl.constexpr, LIST_BLOCK: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    lo, hi = _chunk_bounds(cs_ptr, ce_ptr, mask_ptr, b, N, HAS_ROW_MASK)
    lo = lo.to(tl.int32)
    hi = hi.to(tl.int32)
    row = s_ptr + b * stride_sb
    out = ids_ptr + b * stride_ib
    # SAMPLE candidates in registers: all of them when they fit, else every stride-th
    stride = tl.maximum((hi - lo + SAMPLE - 1) // SAMPLE, 1)
    sid = lo + tl.arange(0, SAMPLE) * stride
    sin = sid < hi
    skey = _order_keys(tl.load(row + sid, mask=sin, other=float("-inf")), sin)
    s_count = tl.sum((skey != 0).to(tl.int32), 0)
    if stride == 1:
        # the whole candidate range is in registers: select there
        k_eff = tl.minimum(s_count, TOP_K)
        thr, need = _threshold_in_registers(skey, k_eff)
        thr = tl.where(k_eff > 0, thr, 0xFFFFFFFF)
        _, n_out = _emit(out, skey, sid, thr, need, 0, 0)
    else:
        # 1. a floor from the sample: its key of rank ~1.25 top_k / stride, so that about
        # 1.25 top_k ids of the row are at or above it
        want = tl.minimum((TOP_K * 5 + stride * 4 - 1) // (stride * 4) + 16, s_count)
        t0, _ = _threshold_in_registers(skey, want)
        floor = tl.where(want > 0, t0, 1)
        # 2. one pass over the row: the shortlist of the ids at or above the floor, in id
        # order (per row: its keys, then its ids, in work)
        list_keys = work_ptr + b * 2 * N
        list_ids = list_keys + N
        offs_blk = tl.arange(0, BLOCK)
        start0 = (lo // BLOCK) * BLOCK
        m = tl.full([], 0, tl.int32)
        count = tl.full([], 0, tl.int32)
        lmax = tl.full([], 0, tl.uint32)
        for start in range(start0, hi, BLOCK):
            m, count, lmax = _shortlist_chunk(row, list_keys, list_ids, start + offs_blk, lo, hi, floor, m, count, lmax)
        k_eff = tl.minimum(count, TOP_K)
        # the floor was above the k_eff-th key (an unrepresentative sample, or fewer than
        # top_k selectable ids): shortlist every selectable id instead
        redo = m < k_eff
        floor = tl.where(redo, 1, floor)
        m = tl.where(redo, 0, m)
        for start in range(start0, tl.where(redo, hi, start0), BLOCK):
            m, count, lmax = _shortlist_chunk(row, list_keys, list_ids, start + offs_blk, lo, hi, floor, m, count, lmax)
        tl.debug_barrier()  # the shortlist is read back by other threads of this program
        # 3. radix select over the shortlist (its keys lie in [floor, lmax])
        prefix, known_lo = _shared_bits(floor, lmax)
        known_lo = tl.where(k_eff > 0, known_lo, 0)
        need = k_eff
        for _ in tl.static_range(4):
            prefix, known_lo, need = _list_radix_pass(list_keys, list_ids, m, prefix, known_lo, need, LIST_BLOCK)
        offs_lst = tl.arange(0, LIST_BLOCK)
        # 4. output: the shortlisted ids above the threshold and its first `need` ties
        thr = tl.where(k_eff > 0, prefix, 0xFFFFFFFF)
        ties = tl.full([], 0, tl.int32)
        n_out = tl.full([], 0, tl.int32)
        for start in range(0, m, LIST_BLOCK):
            offs = start + offs_lst
            inl = offs < m
            key = tl.load(list_keys + offs, mask=inl, other=0, cache_modifier=".cg").to(tl.uint32, bitcast=True)
            ids = tl.load(list_ids + offs, mask=inl, other=-1, cache_modifier=".cg")
            ties, n_out = _emit(out, key, ids, thr, need, ties, n_out)
    offs_out = tl.arange(0, LIST_BLOCK)
    for start in range(0, TOP_K, LIST_BLOCK):
        offs = start + offs_out
        tl.store(out + offs, tl.full([LIST_BLOCK], -1, tl.int32), mask=(offs >= n_out) & (offs < TOP_K))
    tl.store(valid_ptr + b, n_out)


def topk_select_triton(
    scores: torch.Tensor,
    top_k: int,
    candidate_start: torch.Tensor,
    candidate_end: torch.Tensor,
    row_mask: Optional[torch.Tensor] = None,
    *,
    sample: int = 4096,
    block: int = 4096,
    list_block: int = 2048,
    num_warps: int = 8,
    split: Optional[bool] = None,
    radix_grid: Optional[bool] = None,
    bisect: Optional[bool] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton launcher of :func:`topk_select`: for rows that ``bisect_plan`` takes (``bisect``
    None; False: never), one program per row holding the row in registers
    (``sparsehi.kernels.topk_bisect``); otherwise one launch, one program per row, or, for a
    batch too small to fill the GPU (``split`` None: by ``topk_split.split_plan``; False:
    never), two launches with several programs per row (``sparsehi.kernels.topk_split``),
    or, for rows many times longer than ``top_k`` (``radix_grid`` None: by
    ``radix_grid_plan``; False: never), one radix select spread over each row's chunks
    (``sparsehi.kernels.topk_radix_grid``, six launches): before the chunk shortlists from
    ``GRID_BEFORE_SPLIT_TOP_K``, after them below it.

    A row whose candidate range fits in ``sample`` ids is loaded once and selected in
    registers (radix select on the keys, 8-bit digits below the bits all candidates share).
    A longer row selects a floor from every ``ceil(range / sample)``-th candidate, keeps the
    ids at or above it in one pass (about 1.25 ``top_k`` of them; all selectable ids, in a
    second pass, if the floor was too high), and radix-selects that shortlist.
    sample / block (ids per chunk of the pass over the row) / list_block (entries per chunk
    of the shortlist): powers of two >= 256.
    """
    _check_select_args(scores, top_k, candidate_start, candidate_end, row_mask)
    for name, v in (("sample", sample), ("block", block), ("list_block", list_block)):
        if not isinstance(v, int) or v < 256 or v & (v - 1):
            raise ValueError(f"{name}={v!r} is invalid: a power of two >= 256")
    bsz, n = scores.shape
    dev = scores.device
    if bisect is not False and bisect_plan(bsz, n, top_k, sm_count(dev)):
        return topk_select_bisect(scores, top_k, candidate_start, candidate_end, row_mask)
    chunks = radix_grid_plan(bsz, n, top_k) if radix_grid is not False else None
    if chunks is not None and top_k >= GRID_BEFORE_SPLIT_TOP_K:
        return topk_select_radix_grid(scores, top_k, candidate_start, candidate_end, row_mask, chunks)
    if split is not False:
        plan = split_plan(bsz, n, top_k, sm_count(dev))
        if plan is not None:
            return topk_select_split(scores, top_k, candidate_start, candidate_end, row_mask, plan)
    if chunks is not None:
        return topk_select_radix_grid(scores, top_k, candidate_start, candidate_end, row_mask, chunks)
    scores, ids, valid = select_outputs(scores, top_k)
    if bsz == 0:
        return ids, valid
    # shortlist space (keys, then ids, per row) only for rows longer than the sample
    work = torch.empty(bsz, 2, n, dtype=torch.int32, device=dev) if n > sample else valid
    cs, ce = candidate_start.to(dev), candidate_end.to(dev)
    mask = row_mask.to(dev) if row_mask is not None else valid  # dummy pointer when unused
    _topk_select_kernel[(bsz,)](
        scores, cs, ce, mask, ids, valid, work,
        n, top_k, scores.stride(0), ids.stride(0),
        HAS_ROW_MASK=row_mask is not None, SAMPLE=sample, BLOCK=block, LIST_BLOCK=list_block, num_warps=num_warps,
    )
    return ids, valid


def topk_select(
    scores: torch.Tensor,
    top_k: int,
    candidate_start: torch.Tensor,
    candidate_end: torch.Tensor,
    row_mask: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact top ``top_k`` ids per row among the candidates, in ascending id order.

    scores:          ``[B, N]`` float (any float dtype; compared in float32). ``-inf`` and NaN
                     are never selected nor counted; ``-0.0`` ties with ``+0.0``.
    top_k:           int > 0, ids returned per row at most.
    candidate_start: ``[B]`` int32/int64, candidate_end ``[B]`` int32/int64: the half-open id
                     range ``[start, end)`` per row, clipped to ``[0, N]``.
    row_mask:        ``[B] bool`` or None; rows with False select nothing.

    Returns ``(ids [B, top_k] int32`` ascending, ``-1`` after the valid ones,
    ``valid [B] int32 = min(top_k, selectable ids))``. Among equal scores the lower id is
    taken. Triton on CUDA (one launch; no host sync, fixed shapes), the torch reference on CPU.
    """
    impl = dispatch("topk_select", scores, topk_select_triton, topk_select_reference)
    return impl(scores, top_k, candidate_start, candidate_end, row_mask)
