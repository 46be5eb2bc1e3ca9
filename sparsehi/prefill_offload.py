"""The end of a prefill in hierarchical mode: the prompt's KV to host, the GPU buffers up.

One all-layer offload for the whole batch; then per request its GPU buffer (sink pages,
recent-window ring, LRU region; all layers share the page ids) filled from the prompt's
device pages, the dense layers' KV copied into the dense-layer pool, and the prompt's own
device pages released. Dense rows (prompt shorter than ``min_sparse_prompt_len``) get no
buffer: they keep their device pages and decode from them (pages the caller keeps, a
reused prefix, are copied into pages of the row's own).

Every page the batch needs is taken before anything moves or any request changes: running
out of one pool part-way through gives everything back and leaves the manager as it was.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

from hicache.triton_support import cdiv

if TYPE_CHECKING:
    from sparsehi.kv_manager import SparseKVCacheManager


def _slots(pages: torch.Tensor, ps: int) -> torch.Tensor:
    return (pages.long()[:, None] * ps + torch.arange(ps)[None, :]).reshape(-1)


def finish_prefill_hierarchical(mgr: "SparseKVCacheManager", rows: list[int], seq_lens: list[int],
                                prefix_lens: list[int], ts_cpu: torch.Tensor, dev_pages: list[torch.Tensor],
                                dense: list[bool], host_slots: Optional[list[torch.Tensor]],
                                free_device_kv: bool) -> None:
    """See the module docstring. ``ts_cpu [B, max_len] int64`` device slot of every
    position; ``dev_pages[i]`` the device page of each of row i's logical pages."""
    ps, sink, R, S = mgr.ps, mgr.sink, mgr.R, mgr.S
    alloc = mgr.device_pool.allocator
    host_lists, src_all, dst_all = [], [], []
    got_host: list[torch.Tensor] = []
    got_buf: list[Optional[torch.Tensor]] = []
    got_dense: list[torch.Tensor] = []
    try:
        for i, seq in enumerate(seq_lens):
            P = cdiv(seq, ps)
            if host_slots is not None:
                hs = host_slots[i].detach().to("cpu", torch.int64)
                if hs.numel() < seq:
                    raise ValueError(f"host_slots[{i}] has {hs.numel()} slots < seq_len={seq}")
                hp = hs[: P * ps: ps] // ps
                if mgr.validate and not torch.equal(hs[:seq], _slots(hp, ps)[:seq]):
                    raise ValueError(f"host_slots[{i}] must be page aligned (page p's positions in one host page)")
                start = prefix_lens[i]
            else:
                got = mgr.host_pool.alloc(P * ps)
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
        for i, r in enumerate(rows):
            P = cdiv(seq_lens[i], ps)
            # a sparse row's buffer; a dense row's copies of the pages the caller keeps
            # (its prefix, or every page when the caller keeps the device KV)
            n_copy = cdiv(prefix_lens[i], ps) if free_device_kv else P
            need = n_copy if dense[i] else sink + R + S
            pages = alloc.alloc_pages(need)
            if pages is None:
                raise RuntimeError(f"device pool is out of space for the GPU pages of req_pool_index={r}: "
                                   f"need {need} pages, {alloc.num_free_pages()} free "
                                   f"(prefill of req_pool_indices={list(rows)} rolled back)")
            got_buf.append(pages.cpu())
            if mgr.dense_pool is not None:
                dp = mgr.dense_pool.allocator.alloc_pages(P)
                if dp is None:
                    raise RuntimeError(f"dense-layer pool is out of space for req_pool_index={r}: need {P} pages, "
                                       f"{mgr.dense_pool.allocator.num_free_pages()} free "
                                       f"(prefill of req_pool_indices={list(rows)} rolled back)")
                got_dense.append(dp.cpu())
    except Exception:
        for got in got_host:
            mgr.host_pool.free(got)
        for pages in got_buf:
            alloc.free_pages(pages)
        for dp in got_dense:
            mgr.dense_pool.allocator.free_pages(dp)
        raise
    # one all-layer offload for the whole batch
    src = torch.cat(src_all).to(mgr.device)
    dst = torch.cat(dst_all)
    handle = mgr.transfer.backup(src, dst, None) if src.numel() else None
    kv = mgr.device_pool.kv_data  # [bufs, layers, slots, H, D]
    dl = torch.tensor(mgr.dense_layers, dtype=torch.int64, device=mgr.device)
    t = mgr.table
    for i, r in enumerate(rows):
        seq = seq_lens[i]
        P = cdiv(seq, ps)
        pages = got_buf[i]
        t.host[r, :P] = host_lists[i].numpy()
        mgr.host_page_table[r, :P] = host_lists[i].to(mgr.device)
        src_p, dst_p = [], []
        if dense[i]:
            # the caller keeps these pages: the row's own copies replace them
            n_pre = pages.numel()
            own = torch.cat([pages, dev_pages[i][n_pre:]])
            src_p, dst_p = dev_pages[i][:n_pre].tolist(), pages.tolist()
            t.device[r, :P] = own.numpy()
            mgr.page_table[r, :P] = own.to(mgr.device, torch.int32)
        else:
            sink_pages, ring_pages, lru_pages = pages[:sink], pages[sink:sink + R], pages[sink + R:]
            t.sink[r], t.ring[r], t.lru[r] = sink_pages.numpy(), ring_pages.numpy(), lru_pages.numpy()
            if sink:
                mgr.sink_table[r, :sink] = sink_pages.to(mgr.device, torch.int32)
            mgr.ring_table[r] = ring_pages.to(mgr.device, torch.int32)
            mgr.buf_pages[r] = lru_pages.to(mgr.device, torch.int32)
            # sink pages [0, min(sink, P)) and recent pages [max(sink, P - R), P) copied d2d
            for p in range(min(sink, P)):
                src_p.append(int(dev_pages[i][p])), dst_p.append(int(sink_pages[p]))
            for p in range(max(sink, P - R), P):
                src_p.append(int(dev_pages[i][p])), dst_p.append(int(ring_pages[p % R]))
        if src_p:
            s_sl = _slots(torch.tensor(src_p), ps).to(mgr.device)
            d_sl = _slots(torch.tensor(dst_p), ps).to(mgr.device)
            kv[:, :, d_sl] = kv[:, :, s_sl]
        # dense layers: the whole context into the dense pool. Index layers and the
        # request's slots together so only [bufs, dense layers, its slots] is gathered
        # (``kv[:, dl]`` would copy every slot of the pool for the dense layers).
        if mgr.dense_pool is not None:
            dp = got_dense[i]
            t.dense_pool[r, :P] = dp.numpy()
            mgr.dense_pool_table[r, :P] = dp.to(mgr.device, torch.int32)
            s_sl = _slots(dev_pages[i], ps).to(mgr.device)
            d_sl = _slots(dp, ps).to(mgr.device)
            mgr.dense_pool.kv_data[:, :, d_sl] = kv[:, dl[:, None], s_sl[None, :]]
        mgr._set_prefilled(r, seq, dense[i])
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
