"""Table entries written at page boundaries, in one launch after one asynchronous copy.

When decode tokens open new pages, the host allocates them and the device tables that map
(request row, logical page) to a physical page must learn the new entries: the sparse
manager's host / dense-pool / device page tables, a dense mode's ``req_to_token`` rows. Done
with indexed torch assignments this is a synchronous copy from pageable memory per index
tensor plus a launch per table and dtype cast; here the entries travel in one pinned,
non-blocking copy (``stage_entries``) and one kernel writes them all (``table_scatter``).

Entries ``[E, 4] int64``: ``(table, row, col, value)``. Entry ``e`` writes
``tables[table][row, col * span + j] = value + j`` for ``j < span`` (``span`` 1: one page
table entry; ``span == page_size`` with ``value`` a page's first slot: a ``req_to_token``
row's slots of that page). Entries naming no table, or rows / columns outside their table,
are skipped. Up to three tables per launch, any integer dtypes (values are cast on store).

Entry points: ``EntryStager`` / ``stage_entries``, ``table_scatter`` (dispatch), ``table_scatter_triton``,
``table_scatter_reference``.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
import triton
import triton.language as tl

from hicache.triton_support import cdiv, dispatch

MAX_TABLES = 3


def stage_entries(entries: np.ndarray, device: torch.device) -> torch.Tensor:
    """``[E, 4] int64`` entries on ``device``: through pinned memory, non-blocking, when
    ``device`` is CUDA (the pinned block is held by the host allocator until the copy ran).
    Callers that stage often keep an ``EntryStager`` instead (no allocation per call)."""
    arr = np.ascontiguousarray(entries, dtype=np.int64).reshape(-1, 4)
    t = torch.from_numpy(arr)
    if torch.device(device).type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


class EntryStager:
    """A pinned host buffer and a device buffer of ``capacity`` entries, reused by every
    ``stage`` call: the entries are written into the pinned buffer (after the previous
    copy out of it has run: an event, normally long complete) and copied to the device
    buffer non-blocking, on the current stream, so a kernel queued after it reads them.
    More entries than ``capacity`` go through ``stage_entries``."""

    def __init__(self, capacity: int, device: torch.device) -> None:
        if not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"capacity={capacity!r} is invalid: an int >= 1")
        self.device = torch.device(device)
        self.capacity = capacity
        self._cuda = self.device.type == "cuda"
        self._host = torch.empty(capacity, 4, dtype=torch.int64, pin_memory=self._cuda)
        self._host_np = self._host.numpy()
        self._dev = torch.empty(capacity, 4, dtype=torch.int64, device=self.device)
        self._event = torch.cuda.Event() if self._cuda else None
        self._pending = False

    def stage(self, entries: np.ndarray) -> torch.Tensor:
        """``[E, 4] int64`` on the device (a view of the reused buffer, valid until the next
        ``stage``: consume it with kernels queued on the same stream)."""
        arr = np.asarray(entries, dtype=np.int64).reshape(-1, 4)
        n = arr.shape[0]
        if n > self.capacity:
            return stage_entries(arr, self.device)
        if not self._cuda:
            return torch.from_numpy(arr.copy()).to(self.device)
        if self._pending:
            self._event.synchronize()
        self._host_np[:n] = arr
        out = self._dev[:n]
        out.copy_(self._host[:n], non_blocking=True)
        self._event.record()
        self._pending = True
        return out


def _check(entries: torch.Tensor, tables: Sequence[torch.Tensor], span: int) -> None:
    if entries.dim() != 2 or entries.shape[1] != 4 or entries.dtype != torch.int64:
        raise ValueError(f"entries must be [E, 4] int64 (table, row, col, value), got {tuple(entries.shape)} "
                         f"{entries.dtype}")
    if not 1 <= len(tables) <= MAX_TABLES:
        raise ValueError(f"tables must hold 1 to {MAX_TABLES} 2-D tensors, got {len(tables)}")
    for i, t in enumerate(tables):
        if t.dim() != 2 or t.stride(1) != 1 or t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"tables[{i}] must be a 2-D int32/int64 tensor contiguous in its last dim, got "
                             f"{tuple(t.shape)} {t.dtype}")
        if t.device != entries.device:
            raise ValueError(f"tables[{i}] is on {t.device}, entries on {entries.device}: one device")
    if not isinstance(span, int) or span < 1:
        raise ValueError(f"span={span!r} is invalid: an int >= 1")


def table_scatter_reference(entries: torch.Tensor, tables: Sequence[torch.Tensor], span: int = 1) -> None:
    """Torch reference (see the module docstring)."""
    _check(entries, tables, span)
    j = torch.arange(span, device=entries.device)
    for i, t in enumerate(tables):
        e = entries[entries[:, 0] == i]
        rows, cols = e[:, 1:2], e[:, 2:3] * span + j
        vals = e[:, 3:4] + j
        ok = (rows >= 0) & (rows < t.shape[0]) & (cols >= 0) & (cols < t.shape[1])
        t[rows.expand_as(cols)[ok], cols[ok]] = vals[ok].to(t.dtype)


@triton.jit
def _scatter_one(t_ptr, stride, n_rows, n_cols, tid, which: tl.constexpr, row, cols, vals, ok):
    m = ok & (tid == which)[:, None] & (row >= 0)[:, None] & (row < n_rows)[:, None] & (cols >= 0) & (cols < n_cols)
    tl.store(t_ptr + row[:, None] * stride + cols, vals, mask=m)


@triton.jit
def _table_scatter_kernel(ent_ptr, E, t0, t1, t2, st0, st1, st2, r0, r1, r2, c0, c1, c2,
                          SPAN: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_S: tl.constexpr):
    e = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    live = e < E
    tid = tl.load(ent_ptr + e * 4, mask=live, other=-1)
    row = tl.load(ent_ptr + e * 4 + 1, mask=live, other=-1)
    col = tl.load(ent_ptr + e * 4 + 2, mask=live, other=-1)
    val = tl.load(ent_ptr + e * 4 + 3, mask=live, other=0)
    j = tl.arange(0, BLOCK_S)[None, :]
    cols = col[:, None] * SPAN + j
    vals = val[:, None] + j
    ok = live[:, None] & (j < SPAN)
    _scatter_one(t0, st0, r0, c0, tid, 0, row, cols, vals, ok)
    _scatter_one(t1, st1, r1, c1, tid, 1, row, cols, vals, ok)
    _scatter_one(t2, st2, r2, c2, tid, 2, row, cols, vals, ok)


def table_scatter_triton(entries: torch.Tensor, tables: Sequence[torch.Tensor], span: int = 1) -> None:
    """Triton launcher (see the module docstring); missing tables alias ``tables[0]`` and
    match no entry."""
    _check(entries, tables, span)
    e = entries.shape[0]
    if e == 0:
        return
    ts = list(tables) + [tables[0]] * (MAX_TABLES - len(tables))
    rows = [t.shape[0] if i < len(tables) else 0 for i, t in enumerate(ts)]  # aliases: no row matches
    block_e = min(128, triton.next_power_of_2(e))
    _table_scatter_kernel[(cdiv(e, block_e),)](
        entries, e, ts[0], ts[1], ts[2], ts[0].stride(0), ts[1].stride(0), ts[2].stride(0),
        rows[0], rows[1], rows[2], ts[0].shape[1], ts[1].shape[1], ts[2].shape[1],
        SPAN=span, BLOCK_E=block_e, BLOCK_S=triton.next_power_of_2(span), num_warps=4,
    )


def table_scatter(entries: torch.Tensor, tables: Sequence[torch.Tensor], span: int = 1) -> None:
    """Write the entries into the tables (see the module docstring): Triton on CUDA, the
    torch reference otherwise."""
    dispatch("table_scatter", entries, table_scatter_triton, table_scatter_reference)(entries, tables, span)
