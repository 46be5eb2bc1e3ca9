"""A decode step's per-step tables in one launch.

Every decode step starts from the batch's request rows and lengths and derives, per row,
where the new token goes and which pages the sparse layers may choose from. Written as
torch ops that is some fifty tiny elementwise launches once per step (a CUDA-graph step of a
small model is launch bound); here one program per row computes all of it.

Per row ``b`` (``rows[b] == -1``: a padding row), with ``t = max(seq_lens[b] - 1, 0)`` the
new token's position, ``p = min(t // page_size, M - 1)`` its logical page and
``off = t - p * page_size``:

- ``live = rows >= 0``, ``safe_rows = max(rows, 0)``, ``num_pages = live ? p + 1 : 0``;
- ``out_loc``: the main-pool slot of the new token, ``page * page_size + off`` (0 for
  padding rows) with ``page = page_table[safe, p]`` (GPU-only) or, hierarchical, the sink page
  (``p < sink``: ``sink_table[safe, p]``) or recent ring page (``ring_table[safe, p % R]``),
  a dense row's own page (``page_table``) when ``dense_rows_t`` is given;
- hierarchical: ``host_loc = host_page_table[safe, p] * page_size + off`` (-1 for padding),
  ``dense_loc`` from ``dense_pool_table`` the same way (0 for padding), when given;
- ``dense_rows = dense_rows_t[safe] & live`` when ``dense_rows_t`` is given, else None;
- the sparse selection's candidate range ``cs = min(P, sink)``, ``ce = max(cs, P - R)``
  (``P = num_pages``), ``sparse_mask = ce - cs > top_k`` (never for dense rows),
  ``use = sparse_mask & live``, ``ncand = ce - cs`` (0 for dense rows) and the plain candidate
  list ``all_ids[b, k] = k < ncand ? cs + k : -1`` (``[B, top_k]``);
- ``zero_cols[:, b] = 0`` (optional ``[N, B] int32``: the step's counters, zeroed here
  rather than by a launch of their own).

No host sync, no data-dependent shape: the outputs are allocated per call with fixed shapes
(graph-safe; under capture they come from the graph's pool).

Entry points: ``step_setup`` (dispatch), ``step_setup_triton``, ``step_setup_reference``
(``dense_pages`` is the same idea for the dense selection).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from hicache.triton_support import dispatch


@dataclass
class StepSetup:
    """The per-step tables of ``step_setup`` (``B`` rows).

    live ``[B] bool``; safe_rows ``[B] int64``; num_pages ``[B] int32``; out_loc ``[B] int64``;
    host_loc / dense_loc ``[B] int64`` or None; dense_rows ``[B] bool`` or None;
    cs / ce / ncand ``[B] int32``; sparse_mask / use ``[B] bool``; all_ids ``[B, top_k] int32``.
    """

    live: torch.Tensor
    safe_rows: torch.Tensor
    num_pages: torch.Tensor
    out_loc: torch.Tensor
    host_loc: Optional[torch.Tensor]
    dense_loc: Optional[torch.Tensor]
    dense_rows: Optional[torch.Tensor]
    cs: torch.Tensor
    ce: torch.Tensor
    ncand: torch.Tensor
    sparse_mask: torch.Tensor
    use: torch.Tensor
    all_ids: torch.Tensor


def _check_table(name: str, t: Optional[torch.Tensor], dtype: torch.dtype, device: torch.device) -> None:
    if t is None:
        return
    if t.dim() != 2 or t.dtype != dtype or t.stride(1) != 1:
        raise ValueError(f"{name} must be a 2-D {dtype} tensor contiguous in its last dim, got {tuple(t.shape)} "
                         f"{t.dtype}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, rows on {device}: one device")


def _check(rows, seq_lens, page_table, page_size, top_k, sink, recent, sink_table, ring_table, host_page_table,
           dense_pool_table, dense_rows_t, zero_cols) -> None:
    if rows.dim() != 1 or rows.dtype != torch.int64:
        raise ValueError(f"rows must be [B] int64, got {tuple(rows.shape)} {rows.dtype}")
    if seq_lens.shape != rows.shape or seq_lens.dtype != torch.int32 or seq_lens.device != rows.device:
        raise ValueError(f"seq_lens must be [B={rows.shape[0]}] int32 on {rows.device}, got {tuple(seq_lens.shape)} "
                         f"{seq_lens.dtype} on {seq_lens.device}")
    for name, v, lo in (("page_size", page_size, 1), ("top_k", top_k, 1), ("sink", sink, 0), ("recent", recent, 1)):
        if not isinstance(v, int) or isinstance(v, bool) or v < lo:
            raise ValueError(f"{name}={v!r} is invalid: an int >= {lo}")
    dev = rows.device
    _check_table("page_table", page_table, torch.int32, dev)
    hier = (sink_table, ring_table, host_page_table)
    if any(x is None for x in hier) and any(x is not None for x in hier):
        raise ValueError("sink_table, ring_table and host_page_table come together (hierarchical) or not at all")
    if sink_table is None and dense_pool_table is not None:
        raise ValueError("dense_pool_table is hierarchical only: give sink_table, ring_table, host_page_table too")
    _check_table("sink_table", sink_table, torch.int32, dev)
    _check_table("ring_table", ring_table, torch.int32, dev)
    _check_table("host_page_table", host_page_table, torch.int64, dev)
    _check_table("dense_pool_table", dense_pool_table, torch.int32, dev)
    if sink_table is not None and (sink_table.shape[1] < max(sink, 1) or ring_table.shape[1] < recent):
        raise ValueError(f"sink_table must have >= max(sink, 1)={max(sink, 1)} columns and ring_table >= "
                         f"recent={recent}, got {sink_table.shape[1]} and {ring_table.shape[1]}")
    if dense_rows_t is not None and (dense_rows_t.dim() != 1 or dense_rows_t.dtype != torch.bool
                                     or dense_rows_t.device != dev):
        raise ValueError(f"dense_rows_t must be a 1-D bool tensor on {dev}, got {tuple(dense_rows_t.shape)} "
                         f"{dense_rows_t.dtype}")
    if zero_cols is not None and (zero_cols.dim() != 2 or zero_cols.shape[1] != rows.shape[0]
                                  or zero_cols.dtype != torch.int32 or not zero_cols.is_contiguous()
                                  or zero_cols.device != dev):
        raise ValueError(f"zero_cols must be a contiguous [N, B={rows.shape[0]}] int32 tensor on {dev}, got "
                         f"{tuple(zero_cols.shape)} {zero_cols.dtype}")


def step_setup_reference(rows: torch.Tensor, seq_lens: torch.Tensor, page_table: torch.Tensor, *, page_size: int,
                         top_k: int, sink: int, recent: int, sink_table: Optional[torch.Tensor] = None,
                         ring_table: Optional[torch.Tensor] = None, host_page_table: Optional[torch.Tensor] = None,
                         dense_pool_table: Optional[torch.Tensor] = None, dense_rows_t: Optional[torch.Tensor] = None,
                         zero_cols: Optional[torch.Tensor] = None) -> StepSetup:
    """Torch reference (see the module docstring)."""
    _check(rows, seq_lens, page_table, page_size, top_k, sink, recent, sink_table, ring_table, host_page_table,
           dense_pool_table, dense_rows_t, zero_cols)
    ps, M = page_size, page_table.shape[1]
    live = rows >= 0
    safe = rows.clamp(min=0)
    t = (seq_lens.long() - 1).clamp(min=0)
    p = t.div(ps, rounding_mode="floor").clamp(max=M - 1)
    off = t - p * ps
    own = page_table[safe, p]
    dense_rows = (dense_rows_t[safe] & live) if dense_rows_t is not None else None
    num_pages = torch.where(live, p + 1, 0).to(torch.int32)
    host_loc = dense_loc = None
    if sink_table is not None:
        sink_p = sink_table[safe, p.clamp(max=max(sink, 1) - 1)]
        ring_p = ring_table[safe, p % recent]
        page = torch.where(p < sink, sink_p, ring_p)
        if dense_rows is not None:
            page = torch.where(dense_rows, own, page)
        host_loc = torch.where(live, host_page_table[safe, p] * ps + off, -1)
        if dense_pool_table is not None:
            dense_loc = torch.where(live, dense_pool_table[safe, p].long() * ps + off, 0)
    else:
        page = own
    out_loc = torch.where(live, page.long() * ps + off, 0)
    # the sparse selection's candidates: a row is sparse once they outgrow top-k; dense rows
    # never are (they attend their own pages)
    n_sink = num_pages.clamp(max=sink)
    recent_start = torch.maximum(n_sink, num_pages - recent)
    cs, ce = n_sink.to(torch.int32), recent_start.to(torch.int32)
    ncand = ce - cs
    sparse_mask = ncand > top_k
    plain = ncand
    if dense_rows is not None:
        sparse_mask = sparse_mask & ~dense_rows
        plain = torch.where(dense_rows, 0, ncand)
    cols = torch.arange(top_k, device=rows.device, dtype=torch.int32)[None, :]
    all_ids = torch.where(cols < plain[:, None], cs[:, None] + cols, -1).to(torch.int32)
    if zero_cols is not None:
        zero_cols.zero_()
    return StepSetup(live=live, safe_rows=safe, num_pages=num_pages, out_loc=out_loc, host_loc=host_loc,
                     dense_loc=dense_loc, dense_rows=dense_rows, cs=cs, ce=ce, ncand=plain.to(torch.int32),
                     sparse_mask=sparse_mask, use=sparse_mask & live, all_ids=all_ids)


@triton.jit
def _step_setup_kernel(rows_ptr, seq_ptr, pt_ptr, pt_stride, drt_ptr, sink_ptr, sink_stride, ring_ptr, ring_stride,
                       host_ptr, host_stride, dpt_ptr, dpt_stride, i64_ptr, i32_ptr, b_ptr, ids_ptr, zero_ptr,
                       B, M, K, PS, SINK, SINK_W, R, NZ,
                       HIER: tl.constexpr, DENSE_POOL: tl.constexpr, DENSE_ROWS: tl.constexpr,
                       BLOCK_K: tl.constexpr, BLOCK_Z: tl.constexpr):
    b = tl.program_id(0)
    row = tl.load(rows_ptr + b)
    live = row >= 0
    safe = tl.maximum(row, 0)
    t = tl.maximum(tl.load(seq_ptr + b).to(tl.int64) - 1, 0)
    p = tl.minimum(t // PS, M - 1)
    off = t - p * PS
    page = tl.load(pt_ptr + safe * pt_stride + p).to(tl.int64)  # the row's own page
    if DENSE_ROWS:  # (dr is only defined, and only read, under DENSE_ROWS)
        dr = (tl.load(drt_ptr + safe) != 0) & live
        tl.store(b_ptr + B + b, dr)
    if HIER:
        sink_p = tl.load(sink_ptr + safe * sink_stride + tl.minimum(p, SINK_W - 1)).to(tl.int64)
        ring_p = tl.load(ring_ptr + safe * ring_stride + p % R).to(tl.int64)
        fixed = tl.where(p < SINK, sink_p, ring_p)
        if DENSE_ROWS:
            page = tl.where(dr, page, fixed)
        else:
            page = fixed
        hp = tl.load(host_ptr + safe * host_stride + p)
        tl.store(i64_ptr + 2 * B + b, tl.where(live, hp * PS + off, -1))
        if DENSE_POOL:
            dp = tl.load(dpt_ptr + safe * dpt_stride + p).to(tl.int64)
            tl.store(i64_ptr + 3 * B + b, tl.where(live, dp * PS + off, 0))
    tl.store(i64_ptr + b, safe)
    tl.store(i64_ptr + B + b, tl.where(live, page * PS + off, 0))
    P = tl.where(live, p + 1, 0)
    cs = tl.minimum(P, SINK)
    ce = tl.maximum(cs, P - R)
    ncand = ce - cs
    sparse = ncand > K
    if DENSE_ROWS:
        sparse = sparse & (dr == 0)
        ncand = tl.where(dr, 0, ncand)
    tl.store(i32_ptr + b, P.to(tl.int32))
    tl.store(i32_ptr + B + b, cs.to(tl.int32))
    tl.store(i32_ptr + 2 * B + b, ce.to(tl.int32))
    tl.store(i32_ptr + 3 * B + b, ncand.to(tl.int32))
    tl.store(b_ptr + b, live)
    tl.store(b_ptr + 2 * B + b, sparse)
    tl.store(b_ptr + 3 * B + b, sparse & live)
    ids_row = ids_ptr + b.to(tl.int64) * K
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        ids = tl.where(k < ncand, cs + k, -1)
        tl.store(ids_row + k, ids.to(tl.int32), mask=k < K)
    for z0 in range(0, NZ, BLOCK_Z):
        z = z0 + tl.arange(0, BLOCK_Z)
        tl.store(zero_ptr + z.to(tl.int64) * B + b, tl.zeros([BLOCK_Z], dtype=tl.int32), mask=z < NZ)


def step_setup_triton(rows: torch.Tensor, seq_lens: torch.Tensor, page_table: torch.Tensor, *, page_size: int,
                      top_k: int, sink: int, recent: int, sink_table: Optional[torch.Tensor] = None,
                      ring_table: Optional[torch.Tensor] = None, host_page_table: Optional[torch.Tensor] = None,
                      dense_pool_table: Optional[torch.Tensor] = None, dense_rows_t: Optional[torch.Tensor] = None,
                      zero_cols: Optional[torch.Tensor] = None) -> StepSetup:
    """Triton launcher (see the module docstring): one program per row, three output
    allocations (int64, int32 and bool tables, views of which are returned)."""
    _check(rows, seq_lens, page_table, page_size, top_k, sink, recent, sink_table, ring_table, host_page_table,
           dense_pool_table, dense_rows_t, zero_cols)
    B, K, dev = rows.shape[0], top_k, rows.device
    hier, dpool, drows = sink_table is not None, dense_pool_table is not None, dense_rows_t is not None
    i64 = torch.empty(4, B, dtype=torch.int64, device=dev)  # safe_rows, out_loc, host_loc, dense_loc
    i32 = torch.empty(4 * B + B * K, dtype=torch.int32, device=dev)  # num_pages, cs, ce, ncand | all_ids
    flags = torch.empty(4, B, dtype=torch.bool, device=dev)  # live, dense_rows, sparse_mask, use
    if B:
        pt = page_table
        st = sink_table if hier else pt
        rt = ring_table if hier else pt
        ht = host_page_table if hier else i64
        dt = dense_pool_table if dpool else pt
        zc, nz = (zero_cols, zero_cols.shape[0]) if zero_cols is not None else (i32, 0)
        _step_setup_kernel[(B,)](
            rows, seq_lens, pt, pt.stride(0), dense_rows_t if drows else flags, st, st.stride(0), rt, rt.stride(0),
            ht, ht.stride(0), dt, dt.stride(0), i64, i32, flags, i32[4 * B:], zc,
            B, pt.shape[1], K, page_size, sink, max(sink, 1), recent, nz,
            HIER=hier, DENSE_POOL=dpool, DENSE_ROWS=drows, BLOCK_K=min(1024, triton.next_power_of_2(K)),
            BLOCK_Z=16, num_warps=4,
        )
    n = i32[: 4 * B].view(4, B)
    return StepSetup(live=flags[0], safe_rows=i64[0], num_pages=n[0], out_loc=i64[1],
                     host_loc=i64[2] if hier else None, dense_loc=i64[3] if dpool else None,
                     dense_rows=flags[1] if drows else None, cs=n[1], ce=n[2], ncand=n[3], sparse_mask=flags[2],
                     use=flags[3], all_ids=i32[4 * B:].view(B, K))


def step_setup(rows: torch.Tensor, seq_lens: torch.Tensor, page_table: torch.Tensor, *, page_size: int, top_k: int,
               sink: int, recent: int, sink_table: Optional[torch.Tensor] = None,
               ring_table: Optional[torch.Tensor] = None, host_page_table: Optional[torch.Tensor] = None,
               dense_pool_table: Optional[torch.Tensor] = None, dense_rows_t: Optional[torch.Tensor] = None,
               zero_cols: Optional[torch.Tensor] = None) -> StepSetup:
    """A decode step's tables (see the module docstring).

    rows ``[B] int64`` (-1: padding row); seq_lens ``[B] int32`` (the new token included);
    page_table ``[*, M] int32`` the request's own pages; hierarchical: sink_table
    ``[*, >= max(sink, 1)] int32``, ring_table ``[*, >= recent] int32``, host_page_table
    ``[*, M] int64``, dense_pool_table ``[*, M] int32`` or None; dense_rows_t ``[*] bool``
    (None: no row of the batch is dense); zero_cols ``[N, B] int32`` zeroed, or None.
    """
    impl = dispatch("step_setup", rows, step_setup_triton, step_setup_reference)
    return impl(rows, seq_lens, page_table, page_size=page_size, top_k=top_k, sink=sink, recent=recent,
                sink_table=sink_table, ring_table=ring_table, host_page_table=host_page_table,
                dense_pool_table=dense_pool_table, dense_rows_t=dense_rows_t, zero_cols=zero_cols)
