"""Host-side bookkeeping of the KV manager's requests, one row per ``req_pool_index``.

Kept in NumPy arrays rather than per-request Python lists so that the host part of a
decode step (new pages at page boundaries, length checks) is a handful of vectorised
operations over the batch, whatever its size (the device part runs in a CUDA graph).
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

FREE, LIVE, PREFILLED, CHUNKED = 0, 1, 2, 3
"""Row states: FREE (no request), LIVE (begun, nothing prefilled), PREFILLED (prompt in
place, decoding), CHUNKED (part of the prompt prefilled, ``seq`` tokens so far; more
prefill chunks follow)."""


class RequestTable:
    """Per-row state: ``state`` (FREE / LIVE / PREFILLED / CHUNKED), ``seq`` tokens in context
    (CHUNKED: the prompt's tokens prefilled so far),
    ``dense`` (decoded densely: prompt shorter than ``min_sparse_prompt_len``), and the
    pages of each logical page ``[rows, max_pages] int64`` (-1 none): ``host`` (host pool),
    ``dense_pool`` (hierarchical dense-layer pool), ``device`` (main device pool: gpu_only,
    and hierarchical dense rows). Buffer pages of hierarchical sparse rows: ``sink``,
    ``ring``, ``lru`` (``-1`` rows when the request holds none)."""

    def __init__(self, num_rows: int, max_pages: int, sink: int, ring: int, lru: int) -> None:
        self.num_rows, self.max_pages = num_rows, max_pages
        self.state = np.zeros(num_rows, dtype=np.int8)
        self.seq = np.zeros(num_rows, dtype=np.int64)
        self.dense = np.zeros(num_rows, dtype=bool)
        self.host = np.full((num_rows, max_pages), -1, dtype=np.int64)
        self.dense_pool = np.full((num_rows, max_pages), -1, dtype=np.int64)
        self.device = np.full((num_rows, max_pages), -1, dtype=np.int64)
        self.sink = np.full((num_rows, sink), -1, dtype=np.int64)
        self.ring = np.full((num_rows, ring), -1, dtype=np.int64)
        self.lru = np.full((num_rows, lru), -1, dtype=np.int64)

    def reset(self, row: int) -> None:
        for t in (self.host, self.dense_pool, self.device, self.sink, self.ring, self.lru):
            t[row] = -1
        self.seq[row], self.dense[row], self.state[row] = 0, False, FREE

    def mark_prefilled(self, row: int, seq_len: int, dense: bool) -> None:
        """``row``'s prompt is in place: ``seq_len`` tokens, decoded densely or not."""
        self.seq[row], self.dense[row], self.state[row] = seq_len, dense, PREFILLED

    def mark_chunk(self, row: int, seq_len: int) -> None:
        """``row``'s prompt is prefilled up to ``seq_len`` tokens; more chunks follow."""
        self.seq[row], self.state[row] = seq_len, CHUNKED

    def num_pages(self, row: int, page_size: int) -> int:
        return -(-int(self.seq[row]) // page_size)

    def live_rows(self) -> list[int]:
        return [int(r) for r in np.flatnonzero(self.state != FREE)]


def _pages(a: np.ndarray) -> Optional[torch.Tensor]:
    """A row's buffer pages as an int64 CPU tensor, None when it holds none."""
    return None if a.size == 0 or a[0] < 0 else torch.from_numpy(a.copy())


class RequestBuffers:
    """Read view of one row of a :class:`RequestTable` (what tests and callers inspect).

    seq_len / prefilled / chunked; host_pages, dense_pages, device_pages: ``list[int]`` of the
    request's logical pages; sink_pages / ring_pages / lru_pages: ``int64`` (CPU) device
    pages of its GPU buffer (hierarchical sparse rows), None when it holds none.
    """

    def __init__(self, table: RequestTable, row: int, page_size: int) -> None:
        self._t, self._row, self._ps = table, row, page_size

    @property
    def seq_len(self) -> int:
        return int(self._t.seq[self._row])

    @property
    def prefilled(self) -> bool:
        return bool(self._t.state[self._row] == PREFILLED)

    @property
    def chunked(self) -> bool:
        """Part of the prompt is prefilled (``seq_len`` tokens); more chunks follow."""
        return bool(self._t.state[self._row] == CHUNKED)

    @property
    def dense(self) -> bool:
        return bool(self._t.dense[self._row])

    def _list(self, table: np.ndarray) -> list[int]:
        n = self._t.num_pages(self._row, self._ps)
        row = table[self._row, :n]
        return [int(x) for x in row] if n and row[0] >= 0 else []

    @property
    def host_pages(self) -> list[int]:
        return self._list(self._t.host)

    @property
    def dense_pages(self) -> list[int]:
        return self._list(self._t.dense_pool)

    @property
    def device_pages(self) -> list[int]:
        return self._list(self._t.device)

    @property
    def sink_pages(self) -> Optional[torch.Tensor]:
        return _pages(self._t.sink[self._row]) if self._t.ring[self._row, 0] >= 0 else None

    @property
    def ring_pages(self) -> Optional[torch.Tensor]:
        return _pages(self._t.ring[self._row])

    @property
    def lru_pages(self) -> Optional[torch.Tensor]:
        return _pages(self._t.lru[self._row])
