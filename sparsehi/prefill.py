"""The end of a prefill in hierarchical mode: the prompt's KV to host, the GPU buffers up.

``HostPrefill.offload`` (host pages owned here, ``host_addressing='pages'``): one all-layer
offload for the whole batch; then per request its GPU buffer (sink pages, recent-window
ring, LRU region; all layers share the page ids) filled from the prompt's device pages,
the dense layers' KV copied into the dense-layer pool, and the prompt's own device pages
released. A prompt may arrive in chunks (chunked prefill): each chunk's KV is offloaded,
its pages of the sink and of the recent window so far are copied into the buffer (taken at
the first chunk) and its dense layers into the dense-layer pool, and its device pages are
released, so the GPU never holds more of the prompt than one chunk; after the last chunk
the row is where a prefill of the whole prompt leaves it. Dense rows (prompt shorter than ``min_sparse_prompt_len``) get no buffer: they
keep their device pages and decode from them (pages the caller keeps, a reused prefix, are
copied into pages of the row's own).

``HostPrefill.adopt`` (``host_addressing='tokens'``): the engine already holds every
token's host copy; each row gets its GPU buffer filled from wherever the engine holds the
prompt's KV, and nothing is written to the host pool.

Every page a batch needs is taken before anything moves or any request changes: running
out of one pool part-way through gives everything back and leaves every table as it was.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from hicache.device_pool import DeviceKVPool
from hicache.triton_support import cdiv
from sparsehi.page_tables import BufferSizes, PageTables
from sparsehi.request_table import RequestTable


def _slots(pages: torch.Tensor, ps: int) -> torch.Tensor:
    return (pages.long()[:, None] * ps + torch.arange(ps)[None, :]).reshape(-1)


@dataclass
class PrefillRow:
    """One row of a prefill forward's end (``HostPrefill.offload``).

    row:        its ``req_pool_index``.
    seq:        tokens in context after the forward.
    prefix:     tokens whose KV the caller had before the forward, device and host (a
                reused prefix; ``>= start``): the host write starts there.
    start:      tokens an earlier chunk of the prompt placed (0: none; whole pages): their
                host copy, GPU buffer and dense-pool pages exist and their device copies
                are gone (``dev_pages`` holds -1 there).
    more:       the prompt goes on in a later chunk (the row stays CHUNKED).
    dense:      decoded densely (a prompt below ``min_sparse_prompt_len``, never chunked).
    dev_pages:  ``[P] int64`` device page of each logical page (-1 below ``start``).
    Filled by the offload: ``host_pages [P] int64``; ``write_from`` (first position written
    to host); ``buffer`` (device pages: a sparse row's sink + ring + LRU region, a dense
    row's own copies) and ``new_buffer`` (taken by this forward); ``dense_pool`` (its
    dense-layer pool pages of logical pages ``[start / page_size, P)``).
    """

    row: int
    seq: int
    prefix: int
    start: int
    more: bool
    dense: bool
    dev_pages: torch.Tensor
    host_pages: Optional[torch.Tensor] = None
    write_from: int = 0
    buffer: Optional[torch.Tensor] = None
    new_buffer: bool = False
    dense_pool: Optional[torch.Tensor] = None


class HostPrefill:
    """Moves prompts into the hierarchical layout; writes the request and page tables it
    is given (their owner, the KV manager, hands them over) and nothing else."""

    def __init__(self, sizes: BufferSizes, device_pool: DeviceKVPool, host_pool, transfer,
                 dense_pool: Optional[DeviceKVPool], dense_layers: tuple[int, ...], requests: RequestTable,
                 tables: PageTables, validate: bool) -> None:
        self.sizes = sizes
        self.device_pool = device_pool
        self.host_pool = host_pool
        self.transfer = transfer
        self.dense_pool = dense_pool
        self.dense_layers = dense_layers
        self.requests = requests
        self.tables = tables
        self.validate = validate
        self.device = device_pool.device

    def _mark_prefilled(self, row: int, seq_len: int, dense: bool) -> None:
        self.requests.mark_prefilled(row, seq_len, dense)
        self.tables.dense_rows[row] = dense

    def offload(self, batch: list["PrefillRow"], ts_cpu: torch.Tensor, host_slots: Optional[list[torch.Tensor]],
                free_device_kv: bool) -> None:
        """See the module docstring. ``batch``: one :class:`PrefillRow` per row (filled
        here); ``ts_cpu [B, max_len] int64`` device slot of every position (-1 below a
        row's ``start``)."""
        ps = self.sizes.page_size
        alloc = self.device_pool.allocator
        got_host: list[torch.Tensor] = []
        try:
            src, dst = self._host_pages(batch, ts_cpu, host_slots, got_host)
            self._device_pages(batch, free_device_kv)
        except Exception:
            for got in got_host:
                self.host_pool.free(got)
            for x in batch:
                if x.new_buffer and x.buffer is not None:
                    alloc.free_pages(x.buffer)
                if x.dense_pool is not None:
                    self.dense_pool.allocator.free_pages(x.dense_pool)
            raise
        # one all-layer offload for the whole batch
        if getattr(self.transfer, "fp8", False):
            # FP8 host pages: the prompts' complete pages, quantised, their device rows rounded
            # before the sink / recent copies below read them (same stream); a last partial
            # page is stored when decode completes it
            self._store_complete_pages(batch)
            handle = None
        else:
            handle = self.transfer.backup(src.to(self.device), dst, None) if src.numel() else None
        dl = torch.tensor(self.dense_layers, dtype=torch.int64, device=self.device)
        for x in batch:
            self._place_row(x, dl)
        # release the new tokens' device pages once the offload has read them (dense rows
        # keep theirs: they decode from them)
        if handle is not None:
            handle.wait()
        if free_device_kv:
            for x in batch:
                own = x.dev_pages[cdiv(x.prefix, ps):]
                if not x.dense and own.numel():
                    alloc.free_pages(own)

    def _store_complete_pages(self, batch: list["PrefillRow"]) -> None:
        """FP8 host pool: each row's complete pages from ``write_from`` on (a reused prefix or
        an earlier chunk, whole pages, is on host already) to their host pages, every layer."""
        ps = self.sizes.page_size
        dev_sel, host_sel = [], []
        for x in batch:
            if x.write_from % ps:
                raise ValueError(f"prefix_lens must be whole pages with FP8 host KV (page_size={ps}), got {x.prefix}")
            dev_sel.append(x.dev_pages[x.write_from // ps: x.seq // ps])
            host_sel.append(x.host_pages[x.write_from // ps: x.seq // ps])
        dev_all, host_all = torch.cat(dev_sel), torch.cat(host_sel)
        if dev_all.numel():
            self.transfer.store_pages(dev_all.to(self.device), host_all.to(self.device))

    def _host_pages(self, batch: list["PrefillRow"], ts_cpu: torch.Tensor, host_slots: Optional[list[torch.Tensor]],
                    got_host: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's host pages (``host_pages``: the caller's ``host_slots``, or an earlier
        chunk's and new ones allocated here and appended to ``got_host``) and where its host
        write starts (``write_from``); returns the offload's slot lists ``(device slots [N],
        host slots [N])`` of the positions to write."""
        ps = self.sizes.page_size
        src_all, dst_all = [], []
        for i, x in enumerate(batch):
            P = cdiv(x.seq, ps)
            if host_slots is not None:
                hs = host_slots[i].detach().to("cpu", torch.int64)
                if hs.numel() < x.seq:
                    raise ValueError(f"host_slots[{i}] has {hs.numel()} slots < seq_len={x.seq}")
                hp = hs[: P * ps: ps] // ps
                if self.validate and not torch.equal(hs[:x.seq], _slots(hp, ps)[:x.seq]):
                    raise ValueError(f"host_slots[{i}] must be page aligned (page p's positions in one host page)")
                x.write_from = x.prefix
            else:
                p0 = x.start // ps  # an earlier chunk's pages are the row's already
                got = self.host_pool.alloc((P - p0) * ps)
                if got is None:
                    raise RuntimeError(f"host pool is out of space: need {P - p0} pages for req_pool_index={x.row} "
                                       f"(prefill of req_pool_indices={[y.row for y in batch]} rolled back)")
                got_host.append(got)
                hp = torch.cat([torch.from_numpy(self.requests.host[x.row, :p0].copy()), got[::ps].cpu() // ps])
                x.write_from = x.start
            x.host_pages = hp
            pos = torch.arange(x.write_from, x.seq)
            src_all.append(ts_cpu[i, x.write_from:x.seq])
            dst_all.append(hp[pos // ps] * ps + pos % ps)
        return torch.cat(src_all), torch.cat(dst_all)

    def _device_pages(self, batch: list["PrefillRow"], free_device_kv: bool) -> None:
        """Each row's device pages: ``buffer`` (a sparse row's GPU buffer, taken at its first
        chunk and kept by later ones; a dense row's copies of the pages the caller keeps:
        its prefix, or every page when the caller keeps the device KV) and ``dense_pool``
        (its dense-layer pool pages from ``start`` on)."""
        ps = self.sizes.page_size
        alloc = self.device_pool.allocator
        t = self.requests
        names = [x.row for x in batch]
        for x in batch:
            P, p0 = cdiv(x.seq, ps), x.start // ps
            if x.start and not x.dense:
                x.buffer = torch.from_numpy(np.concatenate([t.sink[x.row], t.ring[x.row], t.lru[x.row]]))
            else:
                need = (cdiv(x.prefix, ps) if free_device_kv else P) if x.dense else self.sizes.buffer_pages
                pages = alloc.alloc_pages(need)
                if pages is None:
                    raise RuntimeError(f"device pool is out of space for the GPU pages of req_pool_index={x.row}: "
                                       f"need {need} pages, {alloc.num_free_pages()} free "
                                       f"(prefill of req_pool_indices={names} rolled back)")
                x.buffer, x.new_buffer = pages.cpu(), True
            if self.dense_pool is not None:
                dp = self.dense_pool.allocator.alloc_pages(P - p0)
                if dp is None:
                    raise RuntimeError(f"dense-layer pool is out of space for req_pool_index={x.row}: need {P - p0} "
                                       f"pages, {self.dense_pool.allocator.num_free_pages()} free "
                                       f"(prefill of req_pool_indices={names} rolled back)")
                x.dense_pool = dp.cpu()

    def _place_row(self, x: "PrefillRow", dl: torch.Tensor) -> None:
        """Row ``x.row``'s tables and GPU copies: its host pages; a dense row's own copies of
        the pages the caller keeps, a sparse row's buffer (its sink and recent pages among
        this forward's copied device to device); the dense layers' KV of this forward's
        pages into the dense-layer pool. Then the row is prefilled, or CHUNKED when more
        chunks follow."""
        z = self.sizes
        ps, sink, recent = z.page_size, z.sink, z.recent
        r, P, p0 = x.row, cdiv(x.seq, ps), x.start // ps
        t = self.requests
        kv = self.device_pool.kv_data  # [bufs, layers, slots, H, D]
        t.host[r, :P] = x.host_pages.numpy()
        self.tables.host_pages[r, :P] = x.host_pages.to(self.device)
        src_p, dst_p = [], []
        if x.dense:
            # the caller keeps these pages: the row's own copies replace them
            n_pre = x.buffer.numel()
            own = torch.cat([x.buffer, x.dev_pages[n_pre:]])
            src_p, dst_p = x.dev_pages[:n_pre].tolist(), x.buffer.tolist()
            t.device[r, :P] = own.numpy()
            self.tables.context_pages[r, :P] = own.to(self.device, torch.int32)
        else:
            pages = x.buffer
            sink_pages, ring_pages, lru_pages = pages[:sink], pages[sink:sink + recent], pages[sink + recent:]
            if x.new_buffer:
                t.sink[r], t.ring[r], t.lru[r] = sink_pages.numpy(), ring_pages.numpy(), lru_pages.numpy()
                self.tables.set_buffer(r, sink_pages, ring_pages, lru_pages)
            # sink pages [p0, min(sink, P)) and recent pages [max(sink, P - recent, p0), P) copied
            # d2d: an earlier chunk copied those before p0 (a page of the final recent window
            # that an earlier chunk holds was in that chunk's recent window too)
            for p in range(p0, min(sink, P)):
                src_p.append(int(x.dev_pages[p])), dst_p.append(int(sink_pages[p]))
            for p in range(max(sink, P - recent, p0), P):
                src_p.append(int(x.dev_pages[p])), dst_p.append(int(ring_pages[p % recent]))
        if src_p:
            s_sl = _slots(torch.tensor(src_p), ps).to(self.device)
            d_sl = _slots(torch.tensor(dst_p), ps).to(self.device)
            kv[:, :, d_sl] = kv[:, :, s_sl]
        # dense layers: this forward's pages into the dense pool. Index layers and the
        # request's slots together so only [bufs, dense layers, its slots] is gathered
        # (``kv[:, dl]`` would copy every slot of the pool for the dense layers).
        if x.dense_pool is not None:
            dp = x.dense_pool
            t.dense_pool[r, p0:P] = dp.numpy()
            self.tables.dense_pool_pages[r, p0:P] = dp.to(self.device, torch.int32)
            s_sl = _slots(x.dev_pages[p0:], ps).to(self.device)
            d_sl = _slots(dp, ps).to(self.device)
            self.dense_pool.kv_data[:, :, d_sl] = kv[:, dl[:, None], s_sl[None, :]]
        if x.more:
            t.mark_chunk(r, x.seq)
        else:
            self._mark_prefilled(r, x.seq, x.dense)

    def adopt(self, rows: list[int], seq_lens: list[int], token_slots: torch.Tensor, host_slots: torch.Tensor) -> None:
        """Token addressing: give each (checked) row its GPU buffer filled from the engine's
        copies of the prompt (``token_slots [B, max_len]``: device slot of each position, -1
        where only in host memory; ``host_slots [B, max_len]``: host slot of each position)
        and, with dense layers, its dense-layer pages. No host sync."""
        z = self.sizes
        ps, sink, recent = z.page_size, z.sink, z.recent
        alloc = self.device_pool.allocator
        got_buf: list[torch.Tensor] = []
        got_dense: list[torch.Tensor] = []
        try:
            for r, n in zip(rows, seq_lens):
                pages = alloc.alloc_pages(z.buffer_pages, on_host=True)
                if pages is None:
                    raise RuntimeError(f"device pool is out of space for the GPU buffer of req_pool_index={r}: need "
                                       f"{z.buffer_pages} pages, {alloc.num_free_pages()} free")
                got_buf.append(pages)
                if self.dense_pool is not None:
                    dp = self.dense_pool.allocator.alloc_pages(cdiv(n, ps), on_host=True)
                    if dp is None:
                        raise RuntimeError(f"dense-layer pool is out of space for req_pool_index={r}")
                    got_dense.append(dp)
        except Exception:
            for pages in got_buf:
                alloc.free_pages(pages)
            for dp in got_dense:
                self.dense_pool.allocator.free_pages(dp)
            raise
        dev = self.device
        t = self.requests
        kv = self.device_pool.kv_data  # [bufs, layers, slots, H, D]
        off = torch.arange(ps, dtype=torch.int64, device=dev)
        off_cpu = torch.arange(ps, dtype=torch.int64)  # host-side slot lists: no read-back of ``off``
        for i, (r, n) in enumerate(zip(rows, seq_lens)):
            P = cdiv(n, ps)
            pages = got_buf[i]
            sink_pages, ring_pages, lru_pages = pages[:sink], pages[sink:sink + recent], pages[sink + recent:]
            t.sink[r], t.ring[r], t.lru[r] = sink_pages.numpy(), ring_pages.numpy(), lru_pages.numpy()
            self.tables.set_buffer(r, sink_pages, ring_pages, lru_pages)
            self.tables.host_token_slots[r, :n] = host_slots[i, :n].to(dev, torch.int32)
            self.tables.host_pages_from_tokens(r, 0, n)
            # sink pages and the recent window's pages, token by token from where they are
            logical = list(range(min(sink, P))) + list(range(max(sink, P - recent), P))
            dst_pages = [int(sink_pages[p]) for p in logical[:min(sink, P)]] + \
                        [int(ring_pages[p % recent]) for p in logical[min(sink, P):]]
            pos = (torch.tensor(logical, dtype=torch.int64)[:, None] * ps + off_cpu[None, :]).reshape(-1)
            dst = (torch.tensor(dst_pages, dtype=torch.int64)[:, None] * ps + off_cpu[None, :]).reshape(-1)
            live = pos < n
            pos, dst = pos[live].to(dev), dst[live].to(dev)
            self._fill_from_engine(kv, token_slots[i].to(dev)[pos], host_slots[i].to(dev)[pos], dst, None)
            if self.dense_pool is not None:
                dp = got_dense[i]
                t.dense_pool[r, :P] = dp.numpy()
                self.tables.dense_pool_pages[r, :P] = dp.to(dev, torch.int32)
                allpos = torch.arange(n, device=dev)
                dst = (dp.to(dev)[:, None] * ps + off[None, :]).reshape(-1)[:n]
                self._fill_from_engine(kv, token_slots[i].to(dev)[allpos], host_slots[i].to(dev)[allpos], dst,
                                       self.dense_layers)
            self._mark_prefilled(r, n, False)

    def _fill_from_engine(self, kv: torch.Tensor, src_dev: torch.Tensor, src_host: torch.Tensor, dst: torch.Tensor,
                          dense_layers: Optional[tuple[int, ...]]) -> None:
        """Copy tokens into device slots ``dst``. Main pool (``dense_layers`` None), every
        layer: from device slots ``src_dev`` where they are ``>= 0``, else from host slots
        ``src_host``. Dense-layer pool (its layers): from ``src_dev`` only (the engine
        registers a prompt while it is on the GPU). Fixed shapes, no host sync."""
        on_gpu = src_dev >= 0
        s = src_dev.clamp(min=0)
        if dense_layers is None:
            kv[:, :, dst] = kv[:, :, s]
            self.transfer.load(torch.where(on_gpu, -1, src_host.long()), dst, allow_padding=True).wait()
            return
        dl = torch.tensor(dense_layers, dtype=torch.int64, device=kv.device)
        self.dense_pool.kv_data[:, :, dst] = kv[:, dl[:, None], s[None, :]]

