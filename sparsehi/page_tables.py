"""PageTables: the device-side page tables of every request row.

One row per ``req_pool_index``. The host part of the sparse path writes them (prefill end,
new pages at page boundaries); the decode step only reads them, so a CUDA graph captures
the step over fixed tensors. Their host-side twins (``RequestTable``) answer host
questions without a read-back.

Sizes are in selection units (pages; tokens when ``page_size == 1``), see
:class:`BufferSizes`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from hicache.triton_support import cdiv
from sparsehi.config import SparseConfig
from sparsehi.kernels.table_scatter import EntryStager, table_scatter

__all__ = ["BufferSizes", "PageTables", "page_entries"]


@dataclass(frozen=True)
class BufferSizes:
    """The sparse path's sizes in selection units (pages; tokens when ``page_size == 1``).

    page_size:  tokens per page.
    top_k:      ids a sparse layer selects per row (``SparseConfig.top_k_units``).
    lru_slots:  pages of a request's LRU region, shared by its sparse layers
                (``SparseConfig.buffer_units``).
    sink:       first pages always attended (``SparseConfig.sink_units``).
    recent:     last pages always attended, the page being written included; the size of
                the recent-window ring (``SparseConfig.recent_units``).
    max_pages:  logical pages of a request of ``max_context_len`` tokens.
    """

    page_size: int
    top_k: int
    lru_slots: int
    sink: int
    recent: int
    max_pages: int

    @classmethod
    def of(cls, config: SparseConfig, max_context_len: int) -> "BufferSizes":
        sizes = cls(config.page_size, config.top_k_units, config.buffer_units, config.sink_units,
                    config.recent_units, cdiv(max_context_len, config.page_size))
        if sizes.top_k > sizes.lru_slots:
            raise ValueError(f"top_k_units={sizes.top_k} > buffer_units={sizes.lru_slots}: device_buffer_size must be "
                             f">= top_k")
        return sizes

    @property
    def buffer_pages(self) -> int:
        """Device pages of one sparse request's GPU buffer: sink + recent ring + LRU region."""
        return self.sink + self.recent + self.lru_slots


def page_entries(table: int, rows: np.ndarray, cols: np.ndarray, values: np.ndarray) -> np.ndarray:
    """``[n, 4] int64`` ``table_scatter`` entries: (table, row, col, value) per new page."""
    return np.stack([np.full(rows.size, table, dtype=np.int64), rows, cols, values.astype(np.int64)], 1)


class PageTables:
    """Device page tables (``R = max_num_reqs`` rows, ``M = max_pages``):

    context_pages:    ``[R, M] int32`` main-pool page of each logical page of requests
                      whose whole context is on the GPU (gpu_only; hierarchical dense rows).
    dense_rows:       ``[R] bool`` rows decoded densely (prompt below ``min_sparse_prompt_len``).
    Hierarchical only (None otherwise):
    host_pages:       ``[R, M] int64`` host page of each logical page.
    host_token_slots: ``[R + 1, M * page_size] int32`` host slot of each token (engine-held
                      host KV, ``host_addressing='tokens'``); the last row absorbs padding
                      rows' writes. None with page addressing. With ``pages_from_tokens``
                      (FP8 host pages, whose tokens the engine keeps on one host page in
                      order) ``host_pages`` follows it: a page's host page is its first
                      token's host slot // page_size.
    sink_pages:       ``[R, max(sink, 1)] int32`` device page of each sink page.
    ring_pages:       ``[R, recent] int32`` device page of each recent-ring slot (logical
                      page ``p >= sink`` lives in slot ``p % recent``).
    lru_pages:        ``[R, lru_slots] int32`` device page of each LRU slot.
    dense_pool_pages: ``[R, M] int32`` dense-layer pool page of each logical page (None
                      without dense layers).

    New pages opened by a decode step's host part become ``table_scatter`` entries
    (``write_entries``): written at once, or, with ``defer_entries``, kept for the caller
    (``take_entries``), which writes them inside its captured step.
    """

    def __init__(self, sizes: BufferSizes, max_num_reqs: int, device: torch.device, *, hierarchical: bool,
                 dense_pool: bool, host_tokens: bool, pages_from_tokens: bool = False) -> None:
        R, M, dev = max_num_reqs, sizes.max_pages, device
        self.sizes = sizes
        self.context_pages = torch.full((R, M), -1, dtype=torch.int32, device=dev)
        self.dense_rows = torch.zeros(R, dtype=torch.bool, device=dev)
        self.host_pages = self.host_token_slots = self.dense_pool_pages = None
        self.sink_pages = self.ring_pages = self.lru_pages = None
        self.pages_from_tokens = bool(pages_from_tokens and hierarchical and host_tokens)
        self._host_pages_padded: Optional[torch.Tensor] = None
        if hierarchical:
            # token addressing's host pages get a padding row too (decode steps write them)
            self._host_pages_padded = torch.full((R + int(self.pages_from_tokens), M), -1, dtype=torch.int64,
                                                 device=dev)
            self.host_pages = self._host_pages_padded[:R]
            if host_tokens:
                self.host_token_slots = torch.full((R + 1, M * sizes.page_size), -1, dtype=torch.int32, device=dev)
            self.lru_pages = torch.zeros(R, sizes.lru_slots, dtype=torch.int32, device=dev)
            self.sink_pages = torch.zeros(R, max(sizes.sink, 1), dtype=torch.int32, device=dev)
            self.ring_pages = torch.zeros(R, sizes.recent, dtype=torch.int32, device=dev)
            if dense_pool:
                self.dense_pool_pages = torch.full((R, M), -1, dtype=torch.int32, device=dev)
        # page-boundary entries: at most three tables per row of a batch
        self._stager = EntryStager(3 * max_num_reqs, dev)
        self.defer_entries = False
        """True: ``write_entries`` keeps the entries for ``take_entries`` instead of writing them."""
        self._entries: Optional[np.ndarray] = None

    def reset_row(self, row: int) -> None:
        """A new request in ``row``: no pages, not dense."""
        self.context_pages[row] = -1
        self.dense_rows[row] = False
        for t in (self.host_pages, self.host_token_slots, self.dense_pool_pages):
            if t is not None:
                t[row] = -1

    def set_buffer(self, row: int, sink: torch.Tensor, ring: torch.Tensor, lru: torch.Tensor) -> None:
        """The device pages of ``row``'s GPU buffer (int64 CPU tensors of ``sink``,
        ``recent`` and ``lru_slots`` pages)."""
        dev = self.context_pages.device
        if sink.numel():
            self.sink_pages[row, :sink.numel()] = sink.to(dev, torch.int32)
        self.ring_pages[row] = ring.to(dev, torch.int32)
        self.lru_pages[row] = lru.to(dev, torch.int32)

    def record_host_tokens(self, rows: torch.Tensor, positions: torch.Tensor, host_slots: torch.Tensor) -> None:
        """Token addressing: ``host_token_slots[rows[b], positions[b]] = host_slots[b]`` for
        the live rows (``rows [B] int64``, ``-1`` padding; positions ``[B]``; host slots
        ``[B]``). Fixed shapes, no host sync (a decode step's graph records it)."""
        tab = self.host_token_slots
        if tab is None:
            raise ValueError("record_host_tokens is for host_addressing='tokens'")
        r = torch.where(rows >= 0, rows, tab.shape[0] - 1)
        p = positions.to(torch.int64).clamp(0, tab.shape[1] - 1)
        tab.index_put_((r, p), host_slots.to(tab.dtype))
        if self.pages_from_tokens:
            ps = self.sizes.page_size
            self._host_pages_padded.index_put_((r, p // ps), torch.div(host_slots.to(torch.int64), ps,
                                                                       rounding_mode="floor"))

    def host_pages_from_tokens(self, row: int, start: int, end: int) -> None:
        """With ``pages_from_tokens``: ``host_pages`` of the pages holding positions ``[start,
        end)`` of ``row`` from ``host_token_slots`` (after the engine wrote or rewrote them;
        -1 where a page's first token has no host slot). No host sync."""
        if not self.pages_from_tokens or end <= start:
            return
        ps = self.sizes.page_size
        first, last = start // ps, -(-end // ps)
        firsts = self.host_token_slots[row, first * ps:last * ps:ps].to(torch.int64)
        self.host_pages[row, first:last] = torch.div(firsts, ps, rounding_mode="floor")

    # ------------------------------------------------------------------ page-boundary entries
    def entry_tables(self) -> list[torch.Tensor]:
        """The tables entries name, by table index (``table_scatter`` format): 0 host pages
        (hierarchical; else the context pages), 1 dense-pool pages (else the context pages),
        2 context pages."""
        return [self.host_pages if self.host_pages is not None else self.context_pages,
                self.dense_pool_pages if self.dense_pool_pages is not None else self.context_pages,
                self.context_pages]

    def write_entries(self, entries: np.ndarray) -> None:
        """Write ``[E, 4] int64`` entries now (one staged copy, one launch), or keep them for
        ``take_entries`` when ``defer_entries``."""
        if self.defer_entries:
            self._entries = entries if self._entries is None else np.concatenate([self._entries, entries])
        else:
            table_scatter(self._stager.stage(entries), self.entry_tables())

    def take_entries(self) -> Optional[np.ndarray]:
        """With ``defer_entries``: the entries kept since the last call (None: none)."""
        ents, self._entries = self._entries, None
        return ents
