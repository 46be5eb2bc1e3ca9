"""The end of a prefill in hierarchical mode: the prompt's KV to host, the GPU buffers up.

``HostPrefill.offload`` (host pages owned here, ``host_addressing='pages'``): one all-layer
offload for the whole batch; then per request its GPU buffer (sink pages, recent-window
ring, LRU region; all layers share the page ids) filled from the prompt's device pages,
the dense layers' KV copied into the dense-layer pool, and the prompt's own device pages
released. Dense rows (prompt shorter than ``min_sparse_prompt_len``) get no buffer: they
keep their device pages and decode from them (pages the caller keeps, a reused prefix, are
copied into pages of the row's own).

``HostPrefill.adopt`` (``host_addressing='tokens'``): the engine already holds every
token's host copy; each row gets its GPU buffer filled from wherever the engine holds the
prompt's KV, and nothing is written to the host pool.

Every page a batch needs is taken before anything moves or any request changes: running
out of one pool part-way through gives everything back and leaves every table as it was.
"""
from __future__ import annotations

from typing import Optional

import torch

from hicache.device_pool import DeviceKVPool
from hicache.triton_support import cdiv
from sparsehi.page_tables import BufferSizes, PageTables
from sparsehi.request_table import RequestTable


def _slots(pages: torch.Tensor, ps: int) -> torch.Tensor:
    return (pages.long()[:, None] * ps + torch.arange(ps)[None, :]).reshape(-1)


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

    def offload(self, rows: list[int], seq_lens: list[int], prefix_lens: list[int], ts_cpu: torch.Tensor,
                dev_pages: list[torch.Tensor], dense: list[bool], host_slots: Optional[list[torch.Tensor]],
                free_device_kv: bool) -> None:
        """See the module docstring. ``ts_cpu [B, max_len] int64`` device slot of every
        position; ``dev_pages[i]`` the device page of each of row i's logical pages."""
        ps = self.sizes.page_size
        alloc = self.device_pool.allocator
        got_host: list[torch.Tensor] = []
        got_buf: list[torch.Tensor] = []
        got_dense: list[torch.Tensor] = []
        try:
            host_lists, src, dst = self._host_pages(rows, seq_lens, prefix_lens, ts_cpu, host_slots, got_host)
            self._device_pages(rows, seq_lens, prefix_lens, dense, free_device_kv, got_buf, got_dense)
        except Exception:
            for got in got_host:
                self.host_pool.free(got)
            for pages in got_buf:
                alloc.free_pages(pages)
            for dp in got_dense:
                self.dense_pool.allocator.free_pages(dp)
            raise
        # one all-layer offload for the whole batch
        if getattr(self.transfer, "fp8", False):
            # FP8 host pages: the prompts' complete pages, quantised, their device rows rounded
            # before the sink / recent copies below read them (same stream); a last partial
            # page is stored when decode completes it
            self._store_complete_pages(seq_lens, prefix_lens, dev_pages, host_lists)
            handle = None
        else:
            handle = self.transfer.backup(src.to(self.device), dst, None) if src.numel() else None
        dl = torch.tensor(self.dense_layers, dtype=torch.int64, device=self.device)
        for i, r in enumerate(rows):
            self._place_row(r, seq_lens[i], host_lists[i], dev_pages[i], got_buf[i], dense[i],
                            got_dense[i] if self.dense_pool is not None else None, dl)
        # release the new tokens' device pages once the offload has read them (dense rows
        # keep theirs: they decode from them)
        if handle is not None:
            handle.wait()
        if free_device_kv:
            for i in range(len(rows)):
                if dense[i]:
                    continue
                own = dev_pages[i][cdiv(prefix_lens[i], ps):]
                if own.numel():
                    alloc.free_pages(own)

    def _store_complete_pages(self, seq_lens: list[int], prefix_lens: list[int], dev_pages: list[torch.Tensor],
                              host_lists: list[torch.Tensor]) -> None:
        """FP8 host pool: each row's complete pages from ``prefix_lens[i]`` on (a reused
        prefix, whole pages, is on host already) to their host pages, every layer."""
        ps = self.sizes.page_size
        dev_sel, host_sel = [], []
        for seq, pre, dp, hp in zip(seq_lens, prefix_lens, dev_pages, host_lists):
            if pre % ps:
                raise ValueError(f"prefix_lens must be whole pages with FP8 host KV (page_size={ps}), got {pre}")
            dev_sel.append(dp[pre // ps: seq // ps])
            host_sel.append(hp[pre // ps: seq // ps])
        dev_all, host_all = torch.cat(dev_sel), torch.cat(host_sel)
        if dev_all.numel():
            self.transfer.store_pages(dev_all.to(self.device), host_all.to(self.device))

    def _host_pages(self, rows: list[int], seq_lens: list[int], prefix_lens: list[int], ts_cpu: torch.Tensor,
                    host_slots: Optional[list[torch.Tensor]],
                    got_host: list[torch.Tensor]) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
        """Each row's host pages (the caller's ``host_slots``, or allocated here and appended
        to ``got_host``) and the offload's slot lists: ``(host pages per row, device slots
        [N], host slots [N])`` of the positions to write."""
        ps = self.sizes.page_size
        host_lists, src_all, dst_all = [], [], []
        for i, seq in enumerate(seq_lens):
            P = cdiv(seq, ps)
            if host_slots is not None:
                hs = host_slots[i].detach().to("cpu", torch.int64)
                if hs.numel() < seq:
                    raise ValueError(f"host_slots[{i}] has {hs.numel()} slots < seq_len={seq}")
                hp = hs[: P * ps: ps] // ps
                if self.validate and not torch.equal(hs[:seq], _slots(hp, ps)[:seq]):
                    raise ValueError(f"host_slots[{i}] must be page aligned (page p's positions in one host page)")
                start = prefix_lens[i]
            else:
                got = self.host_pool.alloc(P * ps)
                if got is None:
                    raise RuntimeError(f"host pool is out of space: need {P} pages for req_pool_index={rows[i]} "
                                       f"(prefill of req_pool_indices={list(rows)} rolled back)")
                got_host.append(got)
                hp = got[::ps] // ps
                start = 0
            host_lists.append(hp)
            pos = torch.arange(start, seq)
            src_all.append(ts_cpu[i, start:seq])
            dst_all.append(hp[pos // ps] * ps + pos % ps)
        return host_lists, torch.cat(src_all), torch.cat(dst_all)

    def _device_pages(self, rows: list[int], seq_lens: list[int], prefix_lens: list[int], dense: list[bool],
                      free_device_kv: bool, got_buf: list[torch.Tensor], got_dense: list[torch.Tensor]) -> None:
        """Each row's device pages, appended to ``got_buf`` (a sparse row's GPU buffer; a
        dense row's copies of the pages the caller keeps: its prefix, or every page when the
        caller keeps the device KV) and ``got_dense`` (its dense-layer pool pages)."""
        ps = self.sizes.page_size
        alloc = self.device_pool.allocator
        for i, r in enumerate(rows):
            P = cdiv(seq_lens[i], ps)
            n_copy = cdiv(prefix_lens[i], ps) if free_device_kv else P
            need = n_copy if dense[i] else self.sizes.buffer_pages
            pages = alloc.alloc_pages(need)
            if pages is None:
                raise RuntimeError(f"device pool is out of space for the GPU pages of req_pool_index={r}: "
                                   f"need {need} pages, {alloc.num_free_pages()} free "
                                   f"(prefill of req_pool_indices={list(rows)} rolled back)")
            got_buf.append(pages.cpu())
            if self.dense_pool is not None:
                dp = self.dense_pool.allocator.alloc_pages(P)
                if dp is None:
                    raise RuntimeError(f"dense-layer pool is out of space for req_pool_index={r}: need {P} pages, "
                                       f"{self.dense_pool.allocator.num_free_pages()} free "
                                       f"(prefill of req_pool_indices={list(rows)} rolled back)")
                got_dense.append(dp.cpu())

    def _place_row(self, r: int, seq: int, host_pages: torch.Tensor, dev_pages: torch.Tensor, pages: torch.Tensor,
                   dense: bool, dense_pool_pages: Optional[torch.Tensor], dl: torch.Tensor) -> None:
        """Row ``r``'s tables and GPU copies: its host pages; a dense row's own copies of the
        pages the caller keeps, a sparse row's buffer (sink and recent pages copied device
        to device); the dense layers' whole context into the dense-layer pool."""
        z = self.sizes
        ps, sink, recent = z.page_size, z.sink, z.recent
        P = cdiv(seq, ps)
        t = self.requests
        kv = self.device_pool.kv_data  # [bufs, layers, slots, H, D]
        t.host[r, :P] = host_pages.numpy()
        self.tables.host_pages[r, :P] = host_pages.to(self.device)
        src_p, dst_p = [], []
        if dense:
            # the caller keeps these pages: the row's own copies replace them
            n_pre = pages.numel()
            own = torch.cat([pages, dev_pages[n_pre:]])
            src_p, dst_p = dev_pages[:n_pre].tolist(), pages.tolist()
            t.device[r, :P] = own.numpy()
            self.tables.context_pages[r, :P] = own.to(self.device, torch.int32)
        else:
            sink_pages, ring_pages, lru_pages = pages[:sink], pages[sink:sink + recent], pages[sink + recent:]
            t.sink[r], t.ring[r], t.lru[r] = sink_pages.numpy(), ring_pages.numpy(), lru_pages.numpy()
            self.tables.set_buffer(r, sink_pages, ring_pages, lru_pages)
            # sink pages [0, min(sink, P)) and recent pages [max(sink, P - recent), P) copied d2d
            for p in range(min(sink, P)):
                src_p.append(int(dev_pages[p])), dst_p.append(int(sink_pages[p]))
            for p in range(max(sink, P - recent), P):
                src_p.append(int(dev_pages[p])), dst_p.append(int(ring_pages[p % recent]))
        if src_p:
            s_sl = _slots(torch.tensor(src_p), ps).to(self.device)
            d_sl = _slots(torch.tensor(dst_p), ps).to(self.device)
            kv[:, :, d_sl] = kv[:, :, s_sl]
        # dense layers: the whole context into the dense pool. Index layers and the
        # request's slots together so only [bufs, dense layers, its slots] is gathered
        # (``kv[:, dl]`` would copy every slot of the pool for the dense layers).
        if dense_pool_pages is not None:
            dp = dense_pool_pages
            t.dense_pool[r, :P] = dp.numpy()
            self.tables.dense_pool_pages[r, :P] = dp.to(self.device, torch.int32)
            s_sl = _slots(dev_pages, ps).to(self.device)
            d_sl = _slots(dp, ps).to(self.device)
            self.dense_pool.kv_data[:, :, d_sl] = kv[:, dl[:, None], s_sl[None, :]]
        self._mark_prefilled(r, seq, dense)

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

