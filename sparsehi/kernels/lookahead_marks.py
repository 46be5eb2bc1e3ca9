"""Which hits of a sparse layer a load ahead brought in, and which pages are marked as
loaded ahead: one launch per layer and step, one program per batch row.

``marks [R, M] uint8`` holds, per request row and logical page, 1 while a page that a load
ahead copied into the layer's GPU buffer has not been selected since. Per batch row ``b``
(state row ``r = rows[b]``; padding rows, ``r < 0``, do nothing):

1. ``hidden[b] = sum(marks[r, selected[b, :num_selected[b]]])
   - sum(marks[r, missed[b, :num_missed[b]]])``: the selected pages that were marked and
   are hits (a marked page that was evicted again before its use is a miss, loaded on the
   critical path, and is not counted). Rows with ``uses[b]`` False (not sparse: they take
   their whole candidate list, and nothing is loaded ahead for them) count 0;
2. the selected pages' marks are cleared (they are now used);
3. ``marks[r, ahead[b, :num_ahead[b]]] = 1``: the pages this step loaded ahead.

Ids are clamped into ``[0, M)`` (unvalidated input stays inside its own row). The three
phases are ordered by block barriers: a page both selected and loaded ahead cannot be (a
load ahead takes only pages outside the selection).

Shapes: ``rows [B] int64``; ``selected [B, K]``, ``missed [B, K]``, ``ahead [B, Ka]``
int32 (-1 past their counts); ``num_selected``, ``num_missed``, ``num_ahead [B] int32``;
``uses [B] bool``; ``hidden [B] int32`` (written).

Entry points: ``fold_lookahead_marks`` (dispatch), ``fold_lookahead_marks_triton``,
``fold_lookahead_marks_reference``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from hicache.triton_support import dispatch

_BLOCK = 256


def _check(marks, rows, selected, num_selected, uses, missed, num_missed, ahead, num_ahead, hidden) -> None:
    if marks.dim() != 2 or marks.dtype != torch.uint8 or not marks.is_contiguous():
        raise ValueError(f"marks must be a contiguous [R, M] uint8 tensor, got {tuple(marks.shape)} {marks.dtype}")
    b = rows.shape[0] if rows.dim() == 1 else -1
    if rows.dim() != 1 or rows.dtype != torch.int64:
        raise ValueError(f"rows must be [B] int64, got {tuple(rows.shape)} {rows.dtype}")
    for name, t in (("selected", selected), ("missed", missed), ("ahead", ahead)):
        if t.dim() != 2 or t.shape[0] != b or t.dtype != torch.int32 or t.stride(1) != 1:
            raise ValueError(f"{name} must be [B={b}, N] int32 with unit column stride, got {tuple(t.shape)} {t.dtype}")
    for name, t, dt in (("num_selected", num_selected, torch.int32), ("num_missed", num_missed, torch.int32),
                        ("num_ahead", num_ahead, torch.int32), ("uses", uses, torch.bool),
                        ("hidden", hidden, torch.int32)):
        if t.shape != (b,) or t.dtype != dt or (t.numel() and t.stride(0) != 1):
            raise ValueError(f"{name} must be [B={b}] {dt} with unit stride, got {tuple(t.shape)} {t.dtype}")
    devs = {t.device for t in (marks, rows, selected, num_selected, uses, missed, num_missed, ahead, num_ahead, hidden)}
    if len(devs) != 1:
        raise ValueError(f"every tensor must be on one device, got {sorted(map(str, devs))}")


def fold_lookahead_marks_reference(marks: torch.Tensor, rows: torch.Tensor, selected: torch.Tensor,
                                   num_selected: torch.Tensor, uses: torch.Tensor, missed: torch.Tensor,
                                   num_missed: torch.Tensor, ahead: torch.Tensor, num_ahead: torch.Tensor,
                                   hidden: torch.Tensor) -> None:
    """Torch reference (module docstring)."""
    _check(marks, rows, selected, num_selected, uses, missed, num_missed, ahead, num_ahead, hidden)
    m = marks.shape[1]
    for b in range(rows.shape[0]):
        r = int(rows[b])
        if r < 0:
            hidden[b] = 0
            continue
        row = marks[r]
        counting = bool(uses[b])
        sel = selected[b, : max(0, int(num_selected[b]))].long().clamp(0, m - 1) if counting else selected[b, :0].long()
        mis = missed[b, : max(0, int(num_missed[b]))].long().clamp(0, m - 1) if counting else missed[b, :0].long()
        hidden[b] = int(row[sel].long().sum()) - int(row[mis].long().sum())
        row[sel] = 0
        row[ahead[b, : max(0, int(num_ahead[b]))].long().clamp(0, m - 1)] = 1


@triton.jit
def _marks_sum(row_ptr, ids_ptr, n, M, BLOCK: tl.constexpr, N_COLS):
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    offs = tl.arange(0, BLOCK)
    for c0 in range(0, N_COLS, BLOCK):
        ok = (c0 + offs) < n
        ids = tl.load(ids_ptr + c0 + offs, mask=ok, other=0)
        ids = tl.minimum(tl.maximum(ids, 0), M - 1).to(tl.int64)
        acc += tl.load(row_ptr + ids, mask=ok, other=0).to(tl.int32)
    return tl.sum(acc, 0)


@triton.jit
def _marks_set(row_ptr, ids_ptr, n, M, value, BLOCK: tl.constexpr, N_COLS):
    offs = tl.arange(0, BLOCK)
    for c0 in range(0, N_COLS, BLOCK):
        ok = (c0 + offs) < n
        ids = tl.load(ids_ptr + c0 + offs, mask=ok, other=0)
        ids = tl.minimum(tl.maximum(ids, 0), M - 1).to(tl.int64)
        tl.store(row_ptr + ids, tl.full([BLOCK], value, tl.uint8), mask=ok)


@triton.jit
def _fold_marks_kernel(marks_ptr, rows_ptr, sel_ptr, nsel_ptr, uses_ptr, miss_ptr, nmiss_ptr, ahead_ptr, nahead_ptr,
                       hidden_ptr, M, KS, KM, KA, stride_sel, stride_miss, stride_ahead, BLOCK: tl.constexpr):
    b = tl.program_id(0)
    r = tl.load(rows_ptr + b)
    live = r >= 0
    counting = live & (tl.load(uses_ptr + b) != 0)
    # counts past a list's width (unvalidated input) read no further than the list
    nsel = tl.minimum(tl.where(counting, tl.load(nsel_ptr + b), 0), KS)
    nmiss = tl.minimum(tl.where(counting, tl.load(nmiss_ptr + b), 0), KM)
    nahead = tl.minimum(tl.where(live, tl.load(nahead_ptr + b), 0), KA)
    row = marks_ptr + tl.maximum(r, 0) * M
    sel = sel_ptr + b.to(tl.int64) * stride_sel
    h = _marks_sum(row, sel, nsel, M, BLOCK, KS) - _marks_sum(row, miss_ptr + b.to(tl.int64) * stride_miss, nmiss,
                                                              M, BLOCK, KM)
    tl.debug_barrier()  # every mark read before the selected pages' are cleared
    _marks_set(row, sel, nsel, M, 0, BLOCK, KS)
    tl.debug_barrier()
    _marks_set(row, ahead_ptr + b.to(tl.int64) * stride_ahead, nahead, M, 1, BLOCK, KA)
    tl.store(hidden_ptr + b, h)


def fold_lookahead_marks_triton(marks: torch.Tensor, rows: torch.Tensor, selected: torch.Tensor,
                                num_selected: torch.Tensor, uses: torch.Tensor, missed: torch.Tensor,
                                num_missed: torch.Tensor, ahead: torch.Tensor, num_ahead: torch.Tensor,
                                hidden: torch.Tensor) -> None:
    """Triton launcher: one program per batch row."""
    _check(marks, rows, selected, num_selected, uses, missed, num_missed, ahead, num_ahead, hidden)
    b = rows.shape[0]
    if b == 0:
        return
    ks, km, ka = selected.shape[1], missed.shape[1], ahead.shape[1]
    block = min(_BLOCK, triton.next_power_of_2(max(ks, km, ka, 1)))
    _fold_marks_kernel[(b,)](marks, rows, selected, num_selected, uses, missed, num_missed, ahead, num_ahead, hidden,
                             marks.shape[1], ks, km, ka, selected.stride(0), missed.stride(0), ahead.stride(0),
                             BLOCK=block, num_warps=4)


def fold_lookahead_marks(marks: torch.Tensor, rows: torch.Tensor, selected: torch.Tensor, num_selected: torch.Tensor,
                         uses: torch.Tensor, missed: torch.Tensor, num_missed: torch.Tensor, ahead: torch.Tensor,
                         num_ahead: torch.Tensor, hidden: torch.Tensor) -> None:
    """Count the hits a load ahead brought in and mark this step's loads ahead (module
    docstring). Graph-safe: fixed shapes, no host sync."""
    impl = dispatch("fold_lookahead_marks", marks, fold_lookahead_marks_triton, fold_lookahead_marks_reference)
    impl(marks, rows, selected, num_selected, uses, missed, num_missed, ahead, num_ahead, hidden)
