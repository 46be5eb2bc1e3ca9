"""SparseKVCacheManager: where every request's KV lives and how it moves.

Hierarchical mode: the full KV of every request sits in the host pool (pinned), one host
page per logical page. On the GPU each request keeps, in the model's device pool:
``sink`` pages (the first pages), a ring of ``R`` pages for the recent window (logical page
``p >= sink`` lives in ring slot ``p % R``) and an LRU region of ``S`` pages shared by the
sparse layers (each layer has its own contents and its own LRU state). Dense layers keep
the request's full KV on the GPU in a separate, dense-layers-only pool.

GPU-only mode: every page stays in the device pool; selections map straight to the
request's own pages (no diff, no loads) — the reference the hierarchical mode must match.

The manager holds no selection policy; the coordinator asks it for slots and pages.
"""
from __future__ import annotations

import collections
import dataclasses
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from hicache.device_pool import DeviceKVPool
from sparsehi.config import SparseConfig
from sparsehi.kernels.lru_diff import LruDiffResult, check_lru_diff_values, lru_diff
from sparsehi.lru_buffer import LruState, RequestBuffers

COORDINATOR_MODES = ("hierarchical", "gpu_only")


@dataclass
class RequestKV:
    """KV a finished request hands back to the runtime (which now owns it).

    host_slots:   ``[seq_len] int64`` (CPU) host slot of every position (hierarchical).
    device_slots: ``[seq_len] int64`` (CPU) device slot of every position (gpu_only).
    host_pages / device_pages: the same as whole pages ``[ceil(seq_len / page_size)] int64``.
    """

    seq_len: int
    host_slots: Optional[torch.Tensor] = None
    device_slots: Optional[torch.Tensor] = None
    host_pages: Optional[torch.Tensor] = None
    device_pages: Optional[torch.Tensor] = None


@dataclass
class DecodeStep:
    """Per-step tables shared by every layer of one decode forward.

    rows:       ``[B] int64`` request rows (device); rows_cpu: the same as a list.
    seq_lens:   ``[B] int32`` (device); seq_lens_cpu: list.
    num_pages:  ``[B] int32`` logical pages in context, the one being written included.
    out_loc:    ``[B] int64`` main-pool slot of the new token (hierarchical: sink page or
                recent ring; gpu_only: the request's page).
    dense_loc:  ``[B] int64`` dense-layer pool slot of the new token (hierarchical), or None.
    host_loc:   ``[B] int64`` host slot of the new token (hierarchical, on the transfer
                engine's index device), or None.
    """

    rows: torch.Tensor
    rows_cpu: list[int]
    seq_lens: torch.Tensor
    seq_lens_cpu: list[int]
    num_pages: torch.Tensor
    max_pages: int
    out_loc: torch.Tensor
    dense_loc: Optional[torch.Tensor] = None
    host_loc: Optional[torch.Tensor] = None
    memo: dict = dataclasses.field(default_factory=dict)
    """Per-step values every layer shares (the coordinator's selection tables, the LRU
    diff's output buffers); built by the first layer that needs them."""


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class SparseKVCacheManager:
    """Buffers, host KV and LRU state of every request (see module docstring).

    Sizes in selection units (pages; tokens when ``page_size == 1``): ``K`` top-k width,
    ``S`` LRU slots, ``sink``, ``R`` recent pages, ``M`` max logical pages per request.

    ``validate=True`` checks every selection before it touches a buffer (host syncs): ids
    out of range, padding that is not ``-1`` after ``valid``, or an id named twice in a row
    raise ValueError and leave the state unchanged. ``validate=False`` (timing runs, CUDA
    graphs) checks nothing; the LRU diff then serves a repeated id by its first column's
    slot, loading it once (sparsehi/kernels/lru_diff.py).
    """

    def __init__(
        self,
        config: SparseConfig,
        device_pool: DeviceKVPool,
        *,
        mode: str = "hierarchical",
        host_pool=None,
        transfer=None,
        sparse_layers: Sequence[int],
        max_num_reqs: int,
        max_context_len: int,
        dense_pool_tokens: Optional[int] = None,
        validate: bool = True,
    ) -> None:
        if mode not in COORDINATOR_MODES:
            raise ValueError(f"mode={mode!r} is invalid: one of {COORDINATOR_MODES}")
        if device_pool.page_size != config.page_size:
            raise ValueError(f"SparseConfig.page_size={config.page_size} must equal device_pool.page_size={device_pool.page_size}")
        if not isinstance(max_num_reqs, int) or max_num_reqs < 1:
            raise ValueError(f"max_num_reqs={max_num_reqs!r} is invalid: an integer >= 1")
        if not isinstance(max_context_len, int) or max_context_len < 1:
            raise ValueError(f"max_context_len={max_context_len!r} is invalid: an integer >= 1")
        if mode == "hierarchical" and host_pool is None:
            raise ValueError("mode='hierarchical' needs host_pool (a hicache.host_pool.HostKVPool)")
        if host_pool is not None and host_pool.page_size != device_pool.page_size:
            raise ValueError(f"host_pool.page_size={host_pool.page_size} must equal device_pool.page_size={device_pool.page_size}")
        num_layers = device_pool.spec.num_layers
        self.sparse_layers = tuple(sorted(set(int(x) for x in sparse_layers)))
        if any(not 0 <= x < num_layers for x in self.sparse_layers):
            raise ValueError(f"sparse_layers={self.sparse_layers} must lie in [0, {num_layers})")
        self.dense_layers = tuple(x for x in range(num_layers) if x not in self.sparse_layers)
        self.config = config
        self.mode = mode
        self.device_pool = device_pool
        self.host_pool = host_pool
        self.device = device_pool.device
        self.validate = validate
        self.ps = config.page_size
        self.K = config.top_k_units
        self.S = config.buffer_units
        self.sink = config.sink_units
        self.R = config.recent_units
        self.max_num_reqs = max_num_reqs
        self.max_context_len = max_context_len
        self.M = _cdiv(max_context_len, self.ps)
        if self.K > self.S:
            raise ValueError(f"top_k_units={self.K} > buffer_units={self.S}: device_buffer_size must be >= top_k")
        self.layer_index = {layer: i for i, layer in enumerate(self.sparse_layers)}
        self.dense_index = {layer: i for i, layer in enumerate(self.dense_layers)}
        dev = self.device
        self.reqs: dict[int, RequestBuffers] = {}
        self.step = 0
        self.step_t = torch.zeros(1, dtype=torch.int32, device=dev)
        # page_table: gpu_only -> the request's device pages; hierarchical -> dense-pool pages.
        self.page_table = torch.full((max_num_reqs, self.M), -1, dtype=torch.int32, device=dev)
        self.transfer = None
        self.dense_pool: Optional[DeviceKVPool] = None
        self._pending = []  # transfer handles of prefill offloads not yet waited on
        self._diff_step: dict[int, int] = {}  # sparse layer -> step of its last LRU diff (host int, no sync)
        if mode == "hierarchical":
            self.transfer = transfer if transfer is not None else _default_transfer(device_pool, host_pool, config.io_backend)
            self.host_page_table = torch.full((max_num_reqs, self.M), -1, dtype=torch.int64, device=dev)
            self.buf_pages = torch.zeros(max_num_reqs, self.S, dtype=torch.int32, device=dev)
            self.sink_table = torch.zeros(max_num_reqs, max(self.sink, 1), dtype=torch.int32, device=dev)
            self.ring_table = torch.zeros(max_num_reqs, self.R, dtype=torch.int32, device=dev)
            self.lru = LruState.empty(len(self.sparse_layers), max_num_reqs, self.S, self.M, dev)
            if self.dense_layers:
                spec = dataclasses.replace(device_pool.spec, num_layers=len(self.dense_layers))
                n = dense_pool_tokens if dense_pool_tokens is not None else device_pool.num_slots
                self.dense_pool = DeviceKVPool(spec, n, dev)
        self._offsets = torch.arange(self.ps, dtype=torch.int64, device=dev)
        self._page_bytes = device_pool.spec.page_bytes_per_layer
        self.reset_stats()

    # ------------------------------------------------------------------ requests
    def _req(self, row: int) -> RequestBuffers:
        req = self.reqs.get(int(row))
        if req is None:
            raise ValueError(f"req_pool_index={row} is not a live request (call on_request_begin first); live: {sorted(self.reqs)}")
        return req

    def begin_request(self, row: int) -> None:
        if not isinstance(row, int) or not 0 <= row < self.max_num_reqs:
            raise ValueError(f"req_pool_index={row!r} is invalid: an int in [0, max_num_reqs={self.max_num_reqs})")
        if row in self.reqs:
            raise ValueError(f"req_pool_index={row} is already live (on_request_end it first)")
        self.reqs[row] = RequestBuffers()
        rows = torch.tensor([row], device=self.device)
        self.page_table[row] = -1
        if self.mode == "hierarchical":
            self.host_page_table[row] = -1
            self.lru.reset_rows(rows)

    def end_request(self, row: int) -> RequestKV:
        """Free what the manager owns for ``row`` and hand its KV to the runtime.

        Hierarchical: the returned host slots are complete and visible to CPU readers (tree
        insert, L3 write): decode backups run asynchronously on the current stream (kernel io
        backend), so this waits for that stream once per request before returning."""
        req = self._req(row)
        self.wait_offloads()
        n = req.seq_len
        out = RequestKV(seq_len=n)
        if self.mode == "hierarchical":
            self._sync_host_writes()
            hp = torch.tensor(req.host_pages, dtype=torch.int64)
            out.host_pages = hp
            out.host_slots = (hp[:, None] * self.ps + torch.arange(self.ps)[None, :]).reshape(-1)[:n]
            alloc = self.device_pool.allocator
            for pages in (req.sink_pages, req.ring_pages, req.lru_pages):
                if pages is not None and pages.numel():
                    alloc.free_pages(pages)
            if req.dense_pages and self.dense_pool is not None:
                self.dense_pool.allocator.free_pages(torch.tensor(req.dense_pages, dtype=torch.int64))
        else:
            dp = torch.tensor(req.device_pages, dtype=torch.int64)
            out.device_pages = dp
            out.device_slots = (dp[:, None] * self.ps + torch.arange(self.ps)[None, :]).reshape(-1)[:n]
        del self.reqs[row]
        return out

    def _sync_host_writes(self) -> None:
        """Block the host until every device->host write queued so far on the current stream
        has landed (no-op on CPU, where copies are synchronous)."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    # ------------------------------------------------------------------ prefill
    def finish_prefill(self, rows: list[int], seq_lens: list[int], prefix_lens: list[int], token_slots: torch.Tensor,
                       host_slots: Optional[list[torch.Tensor]] = None, free_device_kv: bool = True) -> None:
        """After a dense prefill forward: record pages; hierarchical mode offloads every
        layer to host in one pass, builds the GPU buffers and releases the prompt's pages.

        token_slots: ``[B, max_len] int64`` device slot of every position.
        host_slots:  per row ``[>= seq_len] int64`` host slots (tree-owned, page aligned);
                     only ``[prefix_len, seq_len)`` is written. None: allocate, write all.
        """
        ps = self.ps
        b = len(rows)
        if len(seq_lens) != b or len(prefix_lens) != b:
            raise ValueError(f"req_pool_indices ({b} rows), seq_lens ({len(seq_lens)}) and prefix_lens "
                             f"({len(prefix_lens)}) must have one entry per batch row")
        if len(set(rows)) != b:
            raise ValueError(f"req_pool_indices must be distinct within a batch, got {list(rows)}")
        if token_slots.dim() != 2 or token_slots.shape[0] != b:
            raise ValueError(f"token_slots must be [B={b}, max_len] int64, got {tuple(token_slots.shape)}")
        if host_slots is not None and len(host_slots) != b:
            raise ValueError(f"host_slots must hold one tensor per batch row ({b}), got {len(host_slots)}")
        reqs = [self._req(r) for r in rows]
        for r, req in zip(rows, reqs):
            if req.prefilled:
                raise ValueError(f"req_pool_index={r} was already prefilled (chunked prefill is not supported)")
        ts_cpu = token_slots.detach().to("cpu", torch.int64)
        dev_pages: list[torch.Tensor] = []
        for i, (seq, req_row) in enumerate(zip(seq_lens, rows)):
            if seq > self.max_context_len:
                raise ValueError(f"seq_len={seq} of req_pool_index={req_row} exceeds max_context_len={self.max_context_len}")
            pos = ts_cpu[i, :seq]
            pages = pos[::ps] // ps
            if self.validate:
                want = (pages[:, None] * ps + torch.arange(ps)[None, :]).reshape(-1)[:seq]
                if not torch.equal(pos, want):
                    raise ValueError("token_slots must be page aligned: position p*page_size starts a device page and a "
                                     "page's positions use its consecutive slots")
            dev_pages.append(pages)
        if self.mode == "gpu_only":
            for i, (r, req) in enumerate(zip(rows, reqs)):
                req.device_pages = dev_pages[i].tolist()
                req.seq_len, req.prefilled = seq_lens[i], True
                self.page_table[r, : len(req.device_pages)] = dev_pages[i].to(self.device, torch.int32)
            return
        self._finish_prefill_hier(rows, reqs, seq_lens, prefix_lens, ts_cpu, dev_pages, host_slots, free_device_kv)

    def _finish_prefill_hier(self, rows, reqs, seq_lens, prefix_lens, ts_cpu, dev_pages, host_slots, free_device_kv) -> None:
        ps, sink, R, S = self.ps, self.sink, self.R, self.S
        alloc = self.device_pool.allocator
        need = sink + R + S
        # 1. Every page the batch needs (host, sparse buffer, dense pool) is taken before
        # anything moves or any request changes: running out of one pool part-way through
        # gives everything back and leaves the manager as it was.
        host_lists, src_all, dst_all = [], [], []
        got_host: list[torch.Tensor] = []
        got_buf: list[torch.Tensor] = []
        got_dense: list[torch.Tensor] = []
        try:
            for i, seq in enumerate(seq_lens):
                P = _cdiv(seq, ps)
                if host_slots is not None:
                    hs = host_slots[i].detach().to("cpu", torch.int64)
                    if hs.numel() < seq:
                        raise ValueError(f"host_slots[{i}] has {hs.numel()} slots < seq_len={seq}")
                    hp = hs[: P * ps : ps] // ps
                    if self.validate:
                        want = (hp[:, None] * ps + torch.arange(ps)[None, :]).reshape(-1)[:seq]
                        if not torch.equal(hs[:seq], want):
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
            for i, r in enumerate(rows):
                pages = alloc.alloc_pages(need)
                if pages is None:
                    raise RuntimeError(f"device pool is out of space for the sparse buffer of req_pool_index={r}: "
                                       f"need {need} pages, {alloc.num_free_pages()} free "
                                       f"(prefill of req_pool_indices={list(rows)} rolled back)")
                got_buf.append(pages.cpu())
                if self.dense_pool is not None:
                    P = _cdiv(seq_lens[i], ps)
                    dp = self.dense_pool.allocator.alloc_pages(P)
                    if dp is None:
                        raise RuntimeError(f"dense-layer pool is out of space for req_pool_index={r}: need {P} pages, "
                                           f"{self.dense_pool.allocator.num_free_pages()} free "
                                           f"(prefill of req_pool_indices={list(rows)} rolled back)")
                    got_dense.append(dp.cpu())
        except Exception:
            for got in got_host:
                self.host_pool.free(got)
            for pages in got_buf:
                alloc.free_pages(pages)
            for dp in got_dense:
                self.dense_pool.allocator.free_pages(dp)
            raise
        # 2. one all-layer offload for the whole batch.
        src = torch.cat(src_all).to(self.device)
        dst = torch.cat(dst_all)
        handle = self.transfer.backup(src, dst, None) if src.numel() else None
        # 3. GPU buffers: sink + ring + LRU pages per request (all layers share the page ids).
        kv = self.device_pool.kv_data  # [bufs, layers, slots, H, D]
        dl = torch.tensor(self.dense_layers, dtype=torch.int64, device=self.device)
        for i, (r, req) in enumerate(zip(rows, reqs)):
            seq = seq_lens[i]
            P = _cdiv(seq, ps)
            pages = got_buf[i]
            req.sink_pages, req.ring_pages, req.lru_pages = pages[:sink], pages[sink:sink + R], pages[sink + R:]
            req.host_pages = host_lists[i].tolist()
            self.host_page_table[r, :P] = host_lists[i].to(self.device)
            if sink:
                self.sink_table[r, :sink] = req.sink_pages.to(self.device, torch.int32)
            self.ring_table[r] = req.ring_pages.to(self.device, torch.int32)
            self.buf_pages[r] = req.lru_pages.to(self.device, torch.int32)
            # sink pages [0, min(sink, P)) and recent pages [max(sink, P - R), P) copied d2d.
            src_p, dst_p = [], []
            for p in range(min(sink, P)):
                src_p.append(int(dev_pages[i][p])), dst_p.append(int(req.sink_pages[p]))
            for p in range(max(sink, P - R), P):
                src_p.append(int(dev_pages[i][p])), dst_p.append(int(req.ring_pages[p % R]))
            if src_p:
                s_sl = (torch.tensor(src_p)[:, None] * ps + torch.arange(ps)[None, :]).reshape(-1).to(self.device)
                d_sl = (torch.tensor(dst_p)[:, None] * ps + torch.arange(ps)[None, :]).reshape(-1).to(self.device)
                kv[:, :, d_sl] = kv[:, :, s_sl]
            # dense layers: the whole context into the dense pool. Index layers and the
            # request's slots together so only [bufs, dense layers, its slots] is gathered
            # (``kv[:, dl]`` would copy every slot of the pool for the dense layers).
            if self.dense_pool is not None:
                dp = got_dense[i]
                req.dense_pages = dp.tolist()
                self.page_table[r, :P] = dp.to(self.device, torch.int32)
                s_sl = (dev_pages[i][:, None] * ps + torch.arange(ps)[None, :]).reshape(-1).to(self.device)
                d_sl = (dp[:, None] * ps + torch.arange(ps)[None, :]).reshape(-1).to(self.device)
                dkv = self.dense_pool.kv_data
                dkv[:, :, d_sl] = kv[:, dl[:, None], s_sl[None, :]]
            req.seq_len, req.prefilled = seq, True
        # 4. release the new tokens' device pages once the offload has read them.
        if handle is not None:
            handle.wait()
        if free_device_kv:
            for i, seq in enumerate(seq_lens):
                first = _cdiv(prefix_lens[i], ps)
                own = dev_pages[i][first:]
                if own.numel():
                    alloc.free_pages(own)

    def wait_offloads(self) -> None:
        for h in self._pending:
            h.wait()
        self._pending.clear()

    # ------------------------------------------------------------------ decode
    def begin_decode(self, rows: list[int], seq_lens: list[int], seq_lens_t: torch.Tensor) -> DecodeStep:
        """Place each row's new token: pick its slots (allocating host / dense / gpu_only
        pages when it opens a page) and advance the step counter."""
        if len(seq_lens) != len(rows):
            raise ValueError(f"req_pool_indices ({len(rows)} rows) and seq_lens ({len(seq_lens)}) must have one "
                             f"entry per batch row")
        if seq_lens_t.numel() != len(rows):
            raise ValueError(f"seq_lens tensor has {seq_lens_t.numel()} entries, req_pool_indices {len(rows)}")
        if len(set(rows)) != len(rows):
            raise ValueError(f"req_pool_indices must be distinct within a batch, got {list(rows)}")
        self.wait_offloads()
        self._fold_step_counts()  # a step left open (no end_step) still counts
        ps, sink, R = self.ps, self.sink, self.R
        reqs = [self._req(r) for r in rows]
        for r, req, seq in zip(rows, reqs, seq_lens):
            if not req.prefilled:
                raise ValueError(f"req_pool_index={r} has not been prefilled")
            if seq != req.seq_len + 1:
                raise ValueError(f"decode seq_len={seq} of req_pool_index={r} must be its previous length + 1 = {req.seq_len + 1}")
            if seq > self.max_context_len:
                raise ValueError(f"seq_len={seq} of req_pool_index={r} exceeds max_context_len={self.max_context_len}")
        new_pages = [(i, r, req, (seq - 1) // ps) for i, (r, req, seq) in enumerate(zip(rows, reqs, seq_lens))
                     if (seq - 1) % ps == 0]
        n_new = len(new_pages)
        if n_new:
            if self.mode == "hierarchical":
                hs = self.host_pool.alloc(n_new * ps)
                if hs is None:
                    raise RuntimeError(f"host pool is out of space for {n_new} new decode pages")
                hps = (hs[::ps] // ps).tolist()
                dps = None
                if self.dense_pool is not None:
                    d = self.dense_pool.allocator.alloc_pages(n_new)
                    if d is None:
                        self.host_pool.free(hs)
                        raise RuntimeError(f"dense-layer pool is out of space for {n_new} new decode pages")
                    dps = d.cpu().tolist()
                for j, (i, r, req, p) in enumerate(new_pages):
                    req.host_pages.append(hps[j])
                    if dps is not None:
                        req.dense_pages.append(dps[j])
                idx_r = torch.tensor([x[1] for x in new_pages], device=self.device)
                idx_p = torch.tensor([x[3] for x in new_pages], device=self.device)
                self.host_page_table[idx_r, idx_p] = torch.tensor(hps, dtype=torch.int64, device=self.device)
                if dps is not None:
                    self.page_table[idx_r, idx_p] = torch.tensor(dps, dtype=torch.int32, device=self.device)
            else:
                d = self.device_pool.allocator.alloc_pages(n_new)
                if d is None:
                    raise RuntimeError(f"device pool is out of space for {n_new} new decode pages")
                dps = d.cpu().tolist()
                for j, (i, r, req, p) in enumerate(new_pages):
                    req.device_pages.append(dps[j])
                idx_r = torch.tensor([x[1] for x in new_pages], device=self.device)
                idx_p = torch.tensor([x[3] for x in new_pages], device=self.device)
                self.page_table[idx_r, idx_p] = torch.tensor(dps, dtype=torch.int32, device=self.device)
        out_loc, dense_loc, host_loc = [], [], []
        for r, req, seq in zip(rows, reqs, seq_lens):
            t = seq - 1
            p, off = t // ps, t % ps
            if self.mode == "hierarchical":
                page = int(req.sink_pages[p]) if p < sink else int(req.ring_pages[p % R])
                host_loc.append(req.host_pages[p] * ps + off)
                if self.dense_pool is not None:
                    dense_loc.append(req.dense_pages[p] * ps + off)
            else:
                page = req.device_pages[p]
            out_loc.append(page * ps + off)
            req.seq_len = seq
        self.step += 1
        self.step_t += 1
        dev = self.device
        step = DecodeStep(
            rows=torch.tensor(rows, dtype=torch.int64, device=dev), rows_cpu=list(rows),
            seq_lens=seq_lens_t.to(dev, torch.int32), seq_lens_cpu=list(seq_lens),
            num_pages=torch.tensor([_cdiv(s, ps) for s in seq_lens], dtype=torch.int32, device=dev),
            max_pages=max(_cdiv(s, ps) for s in seq_lens) if seq_lens else 0,
            out_loc=torch.tensor(out_loc, dtype=torch.int64, device=dev),
        )
        if self.mode == "hierarchical":
            step.host_loc = torch.tensor(host_loc, dtype=torch.int64, device=dev)
            if self.dense_pool is not None:
                step.dense_loc = torch.tensor(dense_loc, dtype=torch.int64, device=dev)
        return step

    def layer_cache(self, layer: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor, torch.Tensor]:
        """``(buffers, key_buffer, value_buffer)`` the plan of ``layer`` attends over."""
        if self.mode == "hierarchical" and layer in self.dense_index:
            pool, li = self.dense_pool, self.dense_index[layer]
        else:
            pool, li = self.device_pool, layer
        return pool.layer_buffers(li), pool.get_key_buffer(li), pool.get_value_buffer(li)

    def write_loc(self, layer: int, step: DecodeStep) -> torch.Tensor:
        """``[B] int64`` slot in ``layer_cache(layer)`` where the new token goes."""
        if self.mode == "hierarchical" and layer in self.dense_index:
            return step.dense_loc
        return step.out_loc

    def fixed_physical(self, layer: int, step: DecodeStep, logical: torch.Tensor) -> torch.Tensor:
        """Physical pages ``[B, N] int32`` of ids that are always on the GPU: sink and
        recent ids (hierarchical sparse layers), any id (dense layers, gpu_only).
        ``logical`` ``[B, N] int32``, -1 padded (-> -1)."""
        valid = logical >= 0
        lid = logical.long().clamp(min=0)
        rows = step.rows[:, None]
        if self.mode == "gpu_only" or layer in self.dense_index:
            phys = self.page_table[rows, lid]
        else:
            sink_phys = self.sink_table[rows, lid.clamp(max=max(self.sink, 1) - 1)]
            ring_phys = self.ring_table[rows, lid % self.R]
            phys = torch.where(lid < self.sink, sink_phys, ring_phys)
        return torch.where(valid, phys, torch.full_like(phys, -1)).to(torch.int32)

    def sparse_physical(self, layer: int, step: DecodeStep, topk: torch.Tensor, valid: torch.Tensor,
                        candidate_end: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Physical pages ``[B, K] int32`` of the top-k ids of a sparse layer.

        Hierarchical: LRU diff (one launch), host->device load of the misses, counters.
        gpu_only: the request's own pages. ``topk`` ``[B, K] int32`` -1 padded.
        """
        if topk.shape[1] > self.S:
            raise ValueError(f"topk width K={topk.shape[1]} exceeds buffer slots S={self.S}: K must be <= S")
        if self.mode == "gpu_only":
            if self.validate:
                lim = candidate_end if candidate_end is not None else step.num_pages
                check_lru_diff_values(topk, valid, lim.to(topk.device))
            return self.fixed_physical(layer, step, topk)
        li = self.layer_index.get(layer)
        if li is None:
            raise ValueError(f"layer_id={layer} is not a sparse layer (sparse layers: {self.sparse_layers})")
        if self.validate:
            lim = candidate_end if candidate_end is not None else step.num_pages
            check_lru_diff_values(topk, valid, lim.to(topk.device), rows=step.rows, num_rows=self.max_num_reqs)
        if self._diff_step.get(layer) == self.step:
            # A second diff with the same step would see its own hits as "used this step"
            # and corrupt the LRU state (and read stale load slots).
            raise ValueError(f"layer_id={layer} already ran its LRU diff in decode step {self.step}: each sparse "
                             f"layer runs once per step (begin_decode starts the next step)")
        res, lu, so = self.lru.layer(li)
        B, K = topk.shape
        t = step.memo.get("lru_tables")
        if t is None or t[0].shape[1:] != (B, K):
            t = self._lru_step_tables(step, B, K, topk.device)
            step.memo["lru_tables"] = t
        out3, idx3, pages2, loads, host_pt, buf_pt, buf_pt32 = t
        r = lru_diff(topk, valid, res, lu, so, self.step_t, rows=step.rows,
                     out=LruDiffResult(out3[0], out3[1], out3[2], loads[li]))
        self._diff_step[layer] = self.step
        step.memo["valid"][li] = valid
        self._step_counts = (loads, step.memo["valid"])
        # The step's tables carry a -1 column in front, so ``id + 1`` indexes them with
        # -1 (no load / no slot) landing on it: one add and three gathers, no masks.
        torch.add(out3, 1, out=idx3)
        torch.gather(host_pt, 1, idx3[1], out=pages2[0])
        torch.gather(buf_pt, 1, idx3[2], out=pages2[1])
        # page -1 gives slots in [-ps, -1]: clamp them to the -1 the transfer engine skips
        slots = (pages2[..., None] * self.ps + self._offsets).clamp_(min=-1).view(2, -1)
        self._load_layer(layer, slots[0], slots[1])
        return buf_pt32.gather(1, idx3[0])

    def _lru_step_tables(self, step: DecodeStep, B: int, K: int, dev: torch.device) -> tuple:
        """Per-step buffers and row tables of ``sparse_physical`` (shared by its layers):
        LRU diff outputs ``[3, B, K] int32`` (each layer consumes its own before the next
        diff is queued on the stream), their ``+1`` indices ``[3, B, K] int64``, the load
        pages ``[2, B, K] int64``, per-layer load counts ``[n_sparse, B] int32`` and the
        batch rows of the host page table / buffer pages with a leading -1 column."""
        rows = step.rows
        pad = torch.full((B, 1), -1, dtype=torch.int64, device=dev)
        host_pt = torch.cat([pad, self.host_page_table.index_select(0, rows)], 1)
        buf_pt = torch.cat([pad, self.buf_pages.index_select(0, rows).long()], 1)
        step.memo["valid"] = {}
        return (torch.empty(3, B, K, dtype=torch.int32, device=dev), torch.empty(3, B, K, dtype=torch.int64, device=dev),
                torch.empty(2, B, K, dtype=torch.int64, device=dev),
                torch.zeros(len(self.sparse_layers), B, dtype=torch.int32, device=dev),
                host_pt, buf_pt, buf_pt.to(torch.int32))

    def backup_token(self, layer: int, step: DecodeStep, k: torch.Tensor, v: Optional[torch.Tensor]) -> None:
        """Hierarchical: copy the new token of ``layer`` to its host slot (per layer, so the
        page is complete on host before it leaves the recent window)."""
        if self.mode != "hierarchical":
            return
        if layer in self.dense_index:
            # The model wrote it into the dense pool; stage it in the request's ring/sink slot
            # of the main pool (unused by dense layers) so the transfer engine can back it up.
            self.device_pool.set_kv(layer, step.out_loc, k, v)
        self.transfer.backup_layer_now(layer, step.out_loc, step.host_loc)

    def _load_layer(self, layer: int, host_slots: torch.Tensor, device_slots: torch.Tensor) -> None:
        self.transfer.load_layer_now(layer, host_slots, device_slots)

    # ------------------------------------------------------------------ counters
    STATS_HISTORY = 4096
    """Closed steps kept individually for ``stats()["per_step"]``; totals cover every step."""

    def reset_stats(self) -> None:
        L = self.device_pool.spec.num_layers
        self._hits = torch.zeros(L, dtype=torch.int64, device=self.device)
        self._misses = torch.zeros(L, dtype=torch.int64, device=self.device)
        # Running per-layer totals (device, no sync) and a bounded ring of the last
        # STATS_HISTORY steps: memory stays flat however long the server runs.
        self._tot_hits = torch.zeros(L, dtype=torch.int64, device=self.device)
        self._tot_misses = torch.zeros(L, dtype=torch.int64, device=self.device)
        self._steps_closed = 0
        self._step_counts = None  # (loads [n_sparse, B], {sparse layer index: valid [B]}) of the open step
        self._history: collections.deque[tuple[int, torch.Tensor]] = collections.deque(maxlen=self.STATS_HISTORY)

    def _fold_step_counts(self) -> None:
        """Add the step's LRU-diff counts (kept per sparse layer by ``sparse_physical``,
        summed here once instead of per layer) to ``_hits`` / ``_misses``."""
        if self._step_counts is None:
            return
        loads, valid = self._step_counts
        self._step_counts = None
        if not valid:
            return
        lis = sorted(valid)
        idx = torch.tensor([self.sparse_layers[i] for i in lis], dtype=torch.int64, device=self.device)
        v = torch.stack([valid[i] for i in lis]).long().sum(1)
        nl = (loads if len(lis) == loads.shape[0] else loads[lis]).long().sum(1)
        self._hits.index_add_(0, idx, v - nl)
        self._misses.index_add_(0, idx, nl)

    def end_step(self) -> None:
        """Close a decode step: keep its per-layer hits/misses (no host sync)."""
        self._fold_step_counts()
        self._tot_hits += self._hits
        self._tot_misses += self._misses
        self._steps_closed += 1
        self._history.append((self.step, torch.stack([self._hits, self._misses])))
        self._hits = torch.zeros_like(self._hits)
        self._misses = torch.zeros_like(self._misses)

    def stats(self) -> dict:
        """Counters (syncs with the device): totals and per-layer hit rates over every
        closed decode step since ``reset_stats``; ``per_step`` holds the last
        ``STATS_HISTORY`` steps only."""
        per_step = []
        for step, hm in self._history:
            h, m = hm[0].tolist(), hm[1].tolist()
            sh, sm = sum(h), sum(m)
            per_step.append({"step": step, "hits": h, "misses": m,
                             "bytes_loaded": [x * self._page_bytes for x in m],
                             "hit_rate": sh / (sh + sm) if sh + sm else 1.0})
        lh, lm = self._tot_hits.tolist(), self._tot_misses.tolist()
        tot_h, tot_m = sum(lh), sum(lm)
        return {
            "steps": self._steps_closed, "hits": tot_h, "misses": tot_m, "bytes_loaded": tot_m * self._page_bytes,
            "hit_rate": tot_h / (tot_h + tot_m) if tot_h + tot_m else 1.0,
            "per_layer_hit_rate": [h / (h + m) if h + m else 1.0 for h, m in zip(lh, lm)],
            "per_step": per_step,
        }

    def nbytes(self) -> dict:
        """GPU bytes of the manager's own state (LRU tables, page tables)."""
        out = {"page_table": self.page_table.numel() * 4}
        if self.mode == "hierarchical":
            out["lru_state"] = self.lru.nbytes()
            out["host_page_table"] = self.host_page_table.numel() * 8
            if self.dense_pool is not None:
                out["dense_pool"] = self.dense_pool.nbytes()
        return out


class _PoolTransfer:
    """Torch fallback used only while ``hicache.transfer`` is unavailable: plain indexing
    through the pools' own read/write APIs (synchronous, correct, slow)."""

    class _Done:
        def wait(self) -> None: ...
        def wait_layer(self, layer: int) -> None: ...
        def done(self) -> bool:
            return True

    def __init__(self, device_pool, host_pool) -> None:
        self.device_pool, self.host_pool = device_pool, host_pool

    def load_layer_now(self, layer, host_slots, device_slots) -> None:
        m = host_slots >= 0
        hs, ds = host_slots[m].cpu(), device_slots[m]
        if hs.numel():
            bufs = self.host_pool.read_tokens(layer, hs)
            self.device_pool.set_kv(layer, ds, *bufs)

    def backup_layer_now(self, layer, device_slots, host_slots) -> None:
        m = device_slots >= 0
        ds, hs = device_slots[m], host_slots[m].cpu()
        if ds.numel():
            bufs = tuple(b[ds.to(b.device)] for b in self.device_pool.layer_buffers(layer))
            self.host_pool.write_tokens(layer, hs, *bufs)

    def backup(self, device_slots, host_slots, layers=None, **kw):
        for layer in (range(self.device_pool.spec.num_layers) if layers is None else layers):
            self.backup_layer_now(layer, device_slots, host_slots)
        return self._Done()


def _default_transfer(device_pool, host_pool, io_backend: str):
    try:
        from hicache.transfer import KVTransferEngine
    except ImportError:
        return _PoolTransfer(device_pool, host_pool)
    return KVTransferEngine(device_pool, host_pool, io_backend=io_backend)
