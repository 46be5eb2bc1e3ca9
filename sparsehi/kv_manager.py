"""SparseKVCacheManager: where every request's KV lives and how it moves.

Hierarchical mode: the full KV of every request sits in the host pool (pinned), one host
page per logical page. On the GPU each request keeps, in the model's device pool:
``sink`` pages (the first pages), a ring of ``R`` pages for the recent window (logical page
``p >= sink`` lives in ring slot ``p % R``) and an LRU region of ``S`` pages shared by the
sparse layers (each layer has its own contents and its own LRU state). Dense layers keep
the request's full KV on the GPU in a separate, dense-layers-only pool.

GPU-only mode: every page stays in the device pool; selections map straight to the
request's own pages (no diff, no loads) — the reference the hierarchical mode must match.

Host addressing (hierarchical). ``host_addressing="pages"``: the manager allocates each
request's host pages from the host pool and offloads the prompt itself (``finish_prefill``).
``host_addressing="tokens"``: the host pool belongs to an engine that already keeps every
token's KV there (SGLang with the plugin: a token's host slot is its virtual KV id); the
manager allocates no host memory, writes nothing to it, and reads a request's token ``t``
from host slot ``host_token_table[row, t]``, which the engine fills (``adopt_prompt`` for
the prompt, ``record_host_tokens`` each decode step). ``resident = (v2p, page_size)``, when
the engine sets it, names host slots whose KV is still on the GPU: the swap-in reads those
from GPU memory instead.

Dense rows. A request whose prompt is shorter than ``SparseConfig.min_sparse_prompt_len``
is decoded densely in every layer, as SGLang's sparse coordinator does: its whole KV stays
in the device pool (hierarchical mode still backs it up to host, for the radix tree) and
its sparse layers attend all of its pages.

A decode step has a host part and a device part. ``prepare_decode`` (host, outside any
CUDA graph) checks the batch, allocates pages for rows that open a new page (vectorised
over the batch) and advances the step counter; ``begin_step`` (device, fixed shapes, no
host sync) derives the step's write locations and tables from the rows and lengths. The
swap-in of a sparse layer (``sparse_physical``), the backup of the new token
(``backup_token``) and the step's counters (``end_step``) are device-only too, so the whole
decode step can be captured in a CUDA graph.

The manager holds no selection policy; the coordinator asks it for slots and pages.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

from hicache.device_pool import DeviceKVPool
from sparsehi.config import SparseConfig
from sparsehi.decode_step import DecodeStep, StepTables
from sparsehi.kernels.dense_pages import DensePages, dense_pages
from sparsehi.kernels.step_setup import step_setup
from sparsehi.kernels.table_scatter import EntryStager, table_scatter
from sparsehi.lru_buffer import LruState
from sparsehi.prefill_offload import finish_prefill_hierarchical
from sparsehi.request_table import FREE, LIVE, PREFILLED, RequestBuffers, RequestTable
from sparsehi.swap_in import SwapInMixin
from sparsehi.swap_in_stats import StepCounts, SwapInCounters

COORDINATOR_MODES = ("hierarchical", "gpu_only")
HOST_ADDRESSING = ("pages", "tokens")
__all__ = ["COORDINATOR_MODES", "HOST_ADDRESSING", "DecodeStep", "RequestKV", "SparseKVCacheManager"]


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


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _capturing() -> bool:
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


def _entries(table: int, rows: np.ndarray, cols: np.ndarray, values: np.ndarray) -> np.ndarray:
    """``[n, 4] int64`` ``table_scatter`` entries: (table, row, col, value) per new page."""
    return np.stack([np.full(rows.size, table, dtype=np.int64), rows, cols, values.astype(np.int64)], 1)


class SparseKVCacheManager(SwapInMixin):
    """Buffers, host KV and LRU state of every request (see module docstring).

    Sizes in selection units (pages; tokens when ``page_size == 1``): ``K`` top-k width,
    ``S`` LRU slots, ``sink``, ``R`` recent pages, ``M`` max logical pages per request.

    ``validate=True`` checks every selection before it touches a buffer (host syncs): ids
    out of range, padding that is not ``-1`` after ``valid``, or an id named twice in a row
    raise ValueError and leave the state unchanged. ``validate=False`` (timing runs, CUDA
    graphs) checks nothing; the LRU diff then serves a repeated id by its first column's
    slot, loading it once (sparsehi/kernels/lru_diff.py).
    """

    STATS_HISTORY = 4096
    """Closed steps kept individually for ``stats()["per_step"]``; totals cover every step."""

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
        host_addressing: str = "pages",
    ) -> None:
        if mode not in COORDINATOR_MODES:
            raise ValueError(f"mode={mode!r} is invalid: one of {COORDINATOR_MODES}")
        if host_addressing not in HOST_ADDRESSING:
            raise ValueError(f"host_addressing={host_addressing!r} is invalid: one of {HOST_ADDRESSING}")
        if host_addressing == "tokens" and mode != "hierarchical":
            raise ValueError("host_addressing='tokens' needs mode='hierarchical' (the host pool holds the KV)")
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
        self.hier = mode == "hierarchical"
        self.host_tokens = host_addressing == "tokens"
        self.resident: Optional[tuple[torch.Tensor, int]] = None
        """``(v2p, page_size)`` of the engine's GPU residency (host_addressing='tokens'), or None."""
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
        self.table = RequestTable(max_num_reqs, self.M, self.sink, self.R, self.S)
        self.step = 0
        self.step_t = torch.zeros(1, dtype=torch.int32, device=dev)
        # page-boundary table entries: at most three tables per row of a batch
        self._stager = EntryStager(3 * max_num_reqs, dev)
        self.defer_page_entries = False
        """True: ``prepare_decode`` leaves the new pages' device-table entries for the caller
        (``take_page_entries``) to write inside its decode step instead of writing them."""
        self._page_entries: Optional[np.ndarray] = None
        # main-pool pages of a request's whole context: every request (gpu_only), dense rows (hierarchical)
        self.page_table = torch.full((max_num_reqs, self.M), -1, dtype=torch.int32, device=dev)
        self.dense_rows_t = torch.zeros(max_num_reqs, dtype=torch.bool, device=dev)
        self.transfer = None
        self.dense_pool: Optional[DeviceKVPool] = None
        self.dense_pool_table: Optional[torch.Tensor] = None
        self._pending = []  # transfer handles of prefill offloads not yet waited on
        self._diff_step: dict[int, int] = {}  # sparse layer -> step of its last checked LRU diff
        self._open_step: Optional[DecodeStep] = None
        if self.hier:
            if transfer is None:
                from hicache.transfer import KVTransferEngine

                transfer = KVTransferEngine(device_pool, host_pool, io_backend=config.io_backend)
            self.transfer = transfer
            self._host_view = host_pool.paged_view()
            self._dev_view = device_pool.paged_view()
            # the swap-in's own copy kernel reads pinned host memory from the GPU (the
            # ``kernel`` io backend); ``direct`` on CUDA keeps the engine's path
            self._fused_copy = dev.type != "cuda" or getattr(transfer, "io_backend", "kernel") == "kernel"
            if self.host_tokens and not self._fused_copy:
                raise ValueError("host_addressing='tokens' needs io_backend='kernel' (the swap-in's own copy kernel)")
            self.host_page_table = torch.full((max_num_reqs, self.M), -1, dtype=torch.int64, device=dev)
            # token addressing: one extra row absorbs padding rows' writes (record_host_tokens)
            self.host_token_table = (torch.full((max_num_reqs + 1, self.M * self.ps), -1, dtype=torch.int32,
                                                device=dev) if self.host_tokens else None)
            self.buf_pages = torch.zeros(max_num_reqs, self.S, dtype=torch.int32, device=dev)
            self.sink_table = torch.zeros(max_num_reqs, max(self.sink, 1), dtype=torch.int32, device=dev)
            self.ring_table = torch.zeros(max_num_reqs, self.R, dtype=torch.int32, device=dev)
            self.lru = LruState.empty(len(self.sparse_layers), max_num_reqs, self.S, self.M, dev)
            if self.dense_layers:
                spec = dataclasses.replace(device_pool.spec, num_layers=len(self.dense_layers))
                n = dense_pool_tokens if dense_pool_tokens is not None else device_pool.num_slots
                self.dense_pool = DeviceKVPool(spec, n, dev)
                self.dense_pool_table = torch.full((max_num_reqs, self.M), -1, dtype=torch.int32, device=dev)
        self._offsets = torch.arange(self.ps, dtype=torch.int64, device=dev)
        self._colk = torch.arange(self.K, dtype=torch.int32, device=dev)[None, :]  # StepTables.colk
        self._page_bytes = device_pool.spec.page_bytes_per_layer
        self.reset_stats()

    # ------------------------------------------------------------------ requests
    def _check_row(self, row: int) -> None:
        if not isinstance(row, (int, np.integer)) or isinstance(row, bool) or not 0 <= row < self.max_num_reqs:
            raise ValueError(f"req_pool_index={row!r} is invalid: an int in [0, max_num_reqs={self.max_num_reqs})")

    def _req(self, row: int) -> RequestBuffers:
        self._check_row(row)
        if self.table.state[row] == FREE:
            raise ValueError(f"req_pool_index={row} is not a live request (call on_request_begin first); "
                             f"live: {self.table.live_rows()}")
        return RequestBuffers(self.table, int(row), self.ps)

    @property
    def reqs(self) -> dict[int, RequestBuffers]:
        """Live requests by row (read views of the request table)."""
        return {r: RequestBuffers(self.table, r, self.ps) for r in self.table.live_rows()}

    def begin_request(self, row: int) -> None:
        self._check_row(row)
        if self.table.state[row] != FREE:
            raise ValueError(f"req_pool_index={row} is already live (on_request_end it first)")
        self.table.reset(row)
        self.table.state[row] = LIVE
        rows = torch.tensor([row], device=self.device)
        self.page_table[row] = -1
        self.dense_rows_t[row] = False
        if self.hier:
            self.host_page_table[row] = -1
            if self.host_token_table is not None:
                self.host_token_table[row] = -1
            if self.dense_pool_table is not None:
                self.dense_pool_table[row] = -1
            self.lru.reset_rows(rows)

    def end_request(self, row: int) -> RequestKV:
        """Free what the manager owns for ``row`` and hand its KV to the runtime.

        Hierarchical: the returned host slots are complete and visible to CPU readers (tree
        insert, L3 write): decode backups run asynchronously on the current stream (kernel io
        backend), so this waits for that stream once per request before returning."""
        self._req(row)
        self.wait_offloads()
        t = self.table
        n = int(t.seq[row])
        P = _cdiv(n, self.ps)
        out = RequestKV(seq_len=n)
        ar = torch.arange(self.ps)
        if self.hier:
            if not self.host_tokens:  # token addressing: the host copies are the engine's
                self._sync_host_writes()
                hp = (torch.from_numpy(t.host[row, :P].copy()) if P and t.host[row, 0] >= 0
                      else torch.zeros(0, dtype=torch.int64))
                out.host_pages = hp
                out.host_slots = (hp[:, None] * self.ps + ar[None, :]).reshape(-1)[:n]
            alloc = self.device_pool.allocator
            owned = np.concatenate([t.sink[row], t.ring[row], t.lru[row], t.device[row, :P]])
            owned = owned[owned >= 0]
            if owned.size:
                alloc.free_pages(torch.from_numpy(owned))
            if self.dense_pool is not None:
                dp = t.dense_pool[row, :P]
                dp = dp[dp >= 0]
                if dp.size:
                    self.dense_pool.allocator.free_pages(torch.from_numpy(dp.copy()))
        else:
            dp = t.device[row, :P]
            dp = torch.from_numpy(dp[dp >= 0].copy())
            out.device_pages = dp
            out.device_slots = (dp[:, None] * self.ps + ar[None, :]).reshape(-1)[:n]
        t.reset(row)
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
        layer to host in one pass, builds the GPU buffers and releases the prompt's pages
        (dense rows keep theirs: they decode from them).

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
        if self.host_tokens:
            raise ValueError("host_addressing='tokens': the engine keeps the prompt's host copy; register it with "
                             "adopt_prompt instead of finish_prefill")
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
        dense = [seq < self.config.min_sparse_prompt_len for seq in seq_lens]
        if self.mode == "gpu_only":
            for i, r in enumerate(rows):
                P = dev_pages[i].numel()
                self.table.device[r, :P] = dev_pages[i].numpy()
                self._set_prefilled(r, seq_lens[i], dense[i])
                self.page_table[r, :P] = dev_pages[i].to(self.device, torch.int32)
            return
        finish_prefill_hierarchical(self, rows, seq_lens, prefix_lens, ts_cpu, dev_pages, dense, host_slots,
                                    free_device_kv)

    def adopt_prompt(self, rows: list[int], seq_lens: list[int], token_slots: torch.Tensor,
                     host_slots: torch.Tensor) -> None:
        """Token addressing: register prompts whose KV the engine already holds, on the GPU
        (``token_slots [B, max_len] int64``: device slot of each position, ``-1`` where it is
        only in host memory) and in host memory (``host_slots [B, max_len]`` int32/int64:
        host slot of each position). Each row gets its GPU buffer (sink pages and recent ring
        filled from the prompt, an empty LRU region) and, with dense layers, its dense-layer
        pages; nothing is written to the host pool. Rows must be sparse (prompt of at least
        ``min_sparse_prompt_len`` tokens). Every page is taken before anything changes:
        running short leaves the manager as it was. No host sync."""
        if not self.host_tokens:
            raise ValueError("adopt_prompt is for host_addressing='tokens'; use finish_prefill")
        b = len(rows)
        if len(seq_lens) != b or len(set(rows)) != b:
            raise ValueError(f"rows ({list(rows)}) must be distinct and seq_lens ({list(seq_lens)}) one per row")
        for name, t in (("token_slots", token_slots), ("host_slots", host_slots)):
            if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.shape[0] != b or t.shape[1] < max(seq_lens, default=0):
                raise ValueError(f"{name} must be [B={b}, >= max seq_len] integer, got "
                                 f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
        for r, n in zip(rows, seq_lens):
            if self._req(r).prefilled:
                raise ValueError(f"req_pool_index={r} was already registered")
            if not self.config.min_sparse_prompt_len <= n <= self.max_context_len:
                raise ValueError(f"seq_len={n} of req_pool_index={r} must lie in [min_sparse_prompt_len="
                                 f"{self.config.min_sparse_prompt_len}, max_context_len={self.max_context_len}]")
        ps, sink, R, S = self.ps, self.sink, self.R, self.S
        alloc = self.device_pool.allocator
        got_buf: list[torch.Tensor] = []
        got_dense: list[torch.Tensor] = []
        try:
            for r, n in zip(rows, seq_lens):
                pages = alloc.alloc_pages(sink + R + S, on_host=True)
                if pages is None:
                    raise RuntimeError(f"device pool is out of space for the GPU buffer of req_pool_index={r}: need "
                                       f"{sink + R + S} pages, {alloc.num_free_pages()} free")
                got_buf.append(pages)
                if self.dense_pool is not None:
                    dp = self.dense_pool.allocator.alloc_pages(_cdiv(n, ps), on_host=True)
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
        t = self.table
        kv = self.device_pool.kv_data  # [bufs, layers, slots, H, D]
        off = self._offsets
        off_cpu = torch.arange(ps, dtype=torch.int64)  # host-side slot lists: no read-back of ``off``
        for i, (r, n) in enumerate(zip(rows, seq_lens)):
            P = _cdiv(n, ps)
            pages = got_buf[i]
            sink_pages, ring_pages, lru_pages = pages[:sink], pages[sink:sink + R], pages[sink + R:]
            t.sink[r], t.ring[r], t.lru[r] = sink_pages.numpy(), ring_pages.numpy(), lru_pages.numpy()
            if sink:
                self.sink_table[r, :sink] = sink_pages.to(dev, torch.int32)
            self.ring_table[r] = ring_pages.to(dev, torch.int32)
            self.buf_pages[r] = lru_pages.to(dev, torch.int32)
            self.host_token_table[r, :n] = host_slots[i, :n].to(dev, torch.int32)
            # sink pages and the recent window's pages, token by token from where they are
            logical = list(range(min(sink, P))) + list(range(max(sink, P - R), P))
            dst_pages = [int(sink_pages[p]) for p in logical[:min(sink, P)]] + \
                        [int(ring_pages[p % R]) for p in logical[min(sink, P):]]
            pos = (torch.tensor(logical, dtype=torch.int64)[:, None] * ps + off_cpu[None, :]).reshape(-1)
            dst = (torch.tensor(dst_pages, dtype=torch.int64)[:, None] * ps + off_cpu[None, :]).reshape(-1)
            live = pos < n
            pos, dst = pos[live].to(dev), dst[live].to(dev)
            self._fill_from_engine(kv, token_slots[i].to(dev)[pos], host_slots[i].to(dev)[pos], dst, None)
            if self.dense_pool is not None:
                dp = got_dense[i]
                t.dense_pool[r, :P] = dp.numpy()
                self.dense_pool_table[r, :P] = dp.to(dev, torch.int32)
                allpos = torch.arange(n, device=dev)
                dst = (dp.to(dev)[:, None] * ps + off[None, :]).reshape(-1)[:n]
                self._fill_from_engine(kv, token_slots[i].to(dev)[allpos], host_slots[i].to(dev)[allpos], dst,
                                       self.dense_layers)
            self._set_prefilled(r, n, False)

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

    def record_host_tokens(self, rows: torch.Tensor, positions: torch.Tensor, host_slots: torch.Tensor) -> None:
        """Token addressing: ``host_token_table[rows[b], positions[b]] = host_slots[b]`` for the
        live rows (``rows [B] int64``, ``-1`` padding; positions ``[B]``; host slots ``[B]``).
        Fixed shapes, no host sync (a decode step's graph records it)."""
        if self.host_token_table is None:
            raise ValueError("record_host_tokens is for host_addressing='tokens'")
        tab = self.host_token_table
        r = torch.where(rows >= 0, rows, tab.shape[0] - 1)
        p = positions.to(torch.int64).clamp(0, tab.shape[1] - 1)
        tab.index_put_((r, p), host_slots.to(tab.dtype))

    def _set_prefilled(self, row: int, seq_len: int, dense: bool) -> None:
        self.table.seq[row] = seq_len
        self.table.dense[row] = dense
        self.table.state[row] = PREFILLED
        self.dense_rows_t[row] = dense

    def wait_offloads(self) -> None:
        for h in self._pending:
            h.wait()
        self._pending.clear()

    # ------------------------------------------------------------------ decode: host part
    def prepare_decode(self, rows: Sequence[int], seq_lens: Sequence[int]) -> bool:
        """Host part of a decode step (outside CUDA graphs): check the batch, give every row
        that opens a new page its pages (host page, dense-pool page, device page of dense /
        gpu_only rows; vectorised over the batch), record the new lengths and advance the
        step counter. ``seq_lens`` count the new token. Returns whether a row of the batch is
        a dense row (``DecodeStep.dense_rows``). On error nothing has changed."""
        r = np.asarray(rows, dtype=np.int64).reshape(-1)
        s = np.asarray(seq_lens, dtype=np.int64).reshape(-1)
        if r.shape != s.shape:
            raise ValueError(f"req_pool_indices ({r.size} rows) and seq_lens ({s.size}) must have one entry per batch row")
        if np.unique(r).size != r.size:
            raise ValueError(f"req_pool_indices must be distinct within a batch, got {r.tolist()}")
        t = self.table
        bad = (r < 0) | (r >= self.max_num_reqs)
        if bad.any():
            raise ValueError(f"req_pool_index={int(r[bad][0])} is invalid: an int in [0, max_num_reqs={self.max_num_reqs})")
        state = t.state[r]
        if (state == FREE).any():
            raise ValueError(f"req_pool_index={int(r[state == FREE][0])} is not a live request (call on_request_begin "
                             f"first); live: {t.live_rows()}")
        if (state != PREFILLED).any():
            raise ValueError(f"req_pool_index={int(r[state != PREFILLED][0])} has not been prefilled")
        want = t.seq[r] + 1
        if (s != want).any():
            i = int(np.flatnonzero(s != want)[0])
            raise ValueError(f"decode seq_len={int(s[i])} of req_pool_index={int(r[i])} must be its previous length + 1 "
                             f"= {int(want[i])}")
        if (s > self.max_context_len).any():
            i = int(np.flatnonzero(s > self.max_context_len)[0])
            raise ValueError(f"seq_len={int(s[i])} of req_pool_index={int(r[i])} exceeds max_context_len={self.max_context_len}")
        self.wait_offloads()
        if self._open_step is not None:  # a step left open (no end_step) still counts
            self.end_step()
        pos = s - 1
        opens = pos % self.ps == 0
        if opens.any():
            self._open_pages(r[opens], pos[opens] // self.ps)
        t.seq[r] = s
        self.step += 1
        self.step_t.fill_(self.step)
        return self.has_dense_rows(r)

    def has_dense_rows(self, rows: Sequence[int]) -> bool:
        """Whether any of ``rows`` decodes densely (what ``prepare_decode`` returns; no effect)."""
        return bool(self.table.dense[np.asarray(rows, dtype=np.int64)].any())

    def _open_pages(self, rows: np.ndarray, pages: np.ndarray) -> None:
        """Pages for logical page ``pages[i]`` of ``rows[i]``: all taken before any table
        changes, so running out of one pool leaves the manager as it was. The device tables
        are updated from one host->device copy of every new entry."""
        n = rows.size
        t = self.table
        dev_mask = np.ones(n, dtype=bool) if not self.hier else t.dense[rows]
        n_dev = int(dev_mask.sum())
        got: list[tuple] = []  # (allocator, pages) to give back on failure
        try:
            new_dev = new_host = new_dense = None
            if n_dev:
                new_dev = self.device_pool.allocator.alloc_pages(n_dev, on_host=True)
                if new_dev is None:
                    raise RuntimeError(f"device pool is out of space for {n_dev} new decode pages")
                got.append((self.device_pool.allocator, new_dev))
            if self.hier and not self.host_tokens:
                new_host = self.host_pool.allocator.alloc_pages(n, on_host=True)
                if new_host is None:
                    raise RuntimeError(f"host pool is out of space for {n} new decode pages")
                got.append((self.host_pool.allocator, new_host))
            if self.hier and self.dense_pool is not None:
                new_dense = self.dense_pool.allocator.alloc_pages(n, on_host=True)
                if new_dense is None:
                    raise RuntimeError(f"dense-layer pool is out of space for {n} new decode pages")
                got.append((self.dense_pool.allocator, new_dense))
        except Exception:
            for alloc, p in got:
                alloc.free_pages(p)
            raise
        # host tables, then the device tables' entries in one staged copy and one launch
        ents = []
        if new_host is not None:
            t.host[rows, pages] = new_host.numpy()
            ents.append(_entries(0, rows, pages, new_host.numpy()))
        if new_dense is not None:
            t.dense_pool[rows, pages] = new_dense.numpy()
            ents.append(_entries(1, rows, pages, new_dense.numpy()))
        if new_dev is not None:
            t.device[rows[dev_mask], pages[dev_mask]] = new_dev.numpy()
            ents.append(_entries(2, rows[dev_mask], pages[dev_mask], new_dev.numpy()))
        if not ents:
            return
        ents = np.concatenate(ents)
        if self.defer_page_entries:  # the decode step writes them (take_page_entries)
            self._page_entries = ents if self._page_entries is None else np.concatenate([self._page_entries, ents])
        else:
            table_scatter(self._stager.stage(ents), self.page_entry_tables())

    def page_entry_tables(self) -> list[torch.Tensor]:
        """The device tables page entries name, by table index: host pages (hierarchical),
        dense-pool pages, device pages (``table_scatter`` format)."""
        return [self.host_page_table if self.hier else self.page_table,
                self.dense_pool_table if self.dense_pool_table is not None else self.page_table, self.page_table]

    def take_page_entries(self) -> Optional[np.ndarray]:
        """With ``defer_page_entries``: ``[E, 4] int64`` entries of the pages the last
        ``prepare_decode`` opened (None: none), for a caller that writes them inside its
        decode step (a CUDA graph's inputs); cleared by the call."""
        ents, self._page_entries = self._page_entries, None
        return ents

    # ------------------------------------------------------------------ decode: device part
    def begin_step(self, rows: torch.Tensor, seq_lens: torch.Tensor, has_dense_rows: bool = False,
                   checked: Optional[bool] = None) -> DecodeStep:
        """Device part of a decode step (CUDA-graph safe): the step's tables from
        ``rows [B] int64`` (``-1`` padding) and ``seq_lens [B] int32`` (new token
        included) after ``prepare_decode`` ran for the live rows."""
        dev = self.device
        rows = rows.to(dev, torch.int64)
        seq = seq_lens.to(dev, torch.int32)
        n_sparse, B = len(self.sparse_layers), int(rows.shape[0])
        counts = StepCounts.uninitialized(n_sparse, B, dev)
        hier = dict(sink_table=self.sink_table, ring_table=self.ring_table, host_page_table=self.host_page_table,
                    dense_pool_table=self.dense_pool_table) if self.hier else {}
        # one launch: write locations, page counts, the sparse selection's candidate tables,
        # and the zeroed counters
        s = step_setup(rows, seq, self.page_table, page_size=self.ps, top_k=self.K, sink=self.sink, recent=self.R,
                       dense_rows_t=self.dense_rows_t if has_dense_rows else None,
                       zero_cols=counts.table.view(2 * n_sparse, B) if n_sparse else None, **hier)
        step = DecodeStep(rows=rows, safe_rows=s.safe_rows, live=s.live, seq_lens=seq, num_pages=s.num_pages,
                          out_loc=s.out_loc, dense_loc=s.dense_loc, host_loc=s.host_loc, dense_rows=s.dense_rows,
                          step=self.step, checked=(self.validate if checked is None else checked) and not _capturing())
        step.memo["sparse_tables"] = StepTables(cs=s.cs, ce=s.ce, ncand=s.ncand, all_ids=s.all_ids,
                                                sparse_mask=s.sparse_mask, use=s.use, colk=self._colk)
        step.memo["counts"] = counts
        self._open_step = step
        return step

    def begin_decode(self, rows: list[int], seq_lens: list[int], seq_lens_t: torch.Tensor) -> DecodeStep:
        """``prepare_decode`` then ``begin_step`` (eager callers)."""
        if seq_lens_t.numel() != len(rows) or len(seq_lens) != len(rows):
            raise ValueError(f"req_pool_indices ({len(rows)} rows), seq_lens ({len(seq_lens)}) and the seq_lens tensor "
                             f"({seq_lens_t.numel()}) must have one entry per batch row")
        has_dense = self.prepare_decode(rows, seq_lens)
        return self.begin_step(torch.tensor(list(rows), dtype=torch.int64, device=self.device), seq_lens_t,
                               has_dense)

    def layer_cache(self, layer: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor, torch.Tensor]:
        """``(buffers, key_buffer, value_buffer)`` the plan of ``layer`` attends over."""
        if self.hier and layer in self.dense_index:
            pool, li = self.dense_pool, self.dense_index[layer]
        else:
            pool, li = self.device_pool, layer
        return pool.layer_buffers(li), pool.get_key_buffer(li), pool.get_value_buffer(li)

    def write_loc(self, layer: int, step: DecodeStep) -> torch.Tensor:
        """``[B] int64`` slot in ``layer_cache(layer)`` where the new token goes."""
        if self.hier and layer in self.dense_index:
            return step.dense_loc
        return step.out_loc

    def own_physical(self, layer: int, step: DecodeStep, logical: torch.Tensor) -> torch.Tensor:
        """Physical pages ``[B, N] int32`` of ids of requests whose whole context is on the
        GPU: dense layers (hierarchical: the dense-layer pool), gpu_only, dense rows.
        ``logical`` ``[B, N] int32``, -1 padded (-> -1)."""
        table = self.dense_pool_table if (self.hier and layer in self.dense_index) else self.page_table
        lid = logical.long().clamp(min=0)
        phys = table[step.safe_rows[:, None], lid]
        return torch.where(logical >= 0, phys, -1).to(torch.int32)

    def own_pages(self, layer: int, step: DecodeStep, with_table: bool = False) -> DensePages:
        """Every page of every row, in one launch: ``logical [B, M] int32`` (``c`` for
        ``c < num_pages``, else -1) and ``physical``, what ``own_physical(layer, step,
        logical)`` returns; ``with_table``: also an attention backend's ``page_table`` and
        ``attended`` tokens (sparsehi/kernels/step_setup.py)."""
        table = self.dense_pool_table if (self.hier and layer in self.dense_index) else self.page_table
        if with_table:
            return dense_pages(step.num_pages, step.safe_rows, table, step.seq_lens, self.ps)
        return dense_pages(step.num_pages, step.safe_rows, table)

    def fixed_physical(self, layer: int, step: DecodeStep, logical: torch.Tensor) -> torch.Tensor:
        """Physical pages ``[B, N] int32`` of ids that are always on the GPU: sink and
        recent ids (hierarchical sparse layers), any id (dense layers, gpu_only).
        ``logical`` ``[B, N] int32``, -1 padded (-> -1)."""
        if not self.hier or layer in self.dense_index:
            return self.own_physical(layer, step, logical)
        lid = logical.long().clamp(min=0)
        rows = step.safe_rows[:, None]
        sink_phys = self.sink_table[rows, lid.clamp(max=max(self.sink, 1) - 1)]
        ring_phys = self.ring_table[rows, lid % self.R]
        phys = torch.where(lid < self.sink, sink_phys, ring_phys)
        return torch.where(logical >= 0, phys, -1).to(torch.int32)

    def backup_token(self, layer: int, step: DecodeStep, k: torch.Tensor, v: Optional[torch.Tensor]) -> None:
        """Hierarchical: copy the new token of ``layer`` to its host slot (per layer, so the
        page is complete on host before it leaves the recent window). Graph-safe."""
        if not self.hier or self.host_tokens:  # token addressing: the engine writes its host copy
            return
        if layer in self.dense_index:
            # The model wrote it into the dense-layer pool, which the transfer engine does not
            # address: the engine backs it up from k / v themselves (one launch for both).
            self.transfer.backup_tokens_from(layer, step.host_loc, *(k, v)[: self.device_pool.spec.num_buffers])
            return
        self.transfer.backup_layer_now(layer, step.out_loc, step.host_loc)

    # ------------------------------------------------------------------ counters
    def reset_stats(self) -> None:
        """Zero the counters in place (captured decode graphs keep counting into them); a
        changed ``STATS_HISTORY`` takes new counters, so capture graphs after that."""
        c = getattr(self, "counters", None)
        if c is not None and c.history == self.STATS_HISTORY:
            c.reset()
            return
        self.counters = SwapInCounters(self.device_pool.spec.num_layers, self.sparse_layers, self.device,
                                       history=self.STATS_HISTORY)

    def end_step(self) -> None:
        """Close the open decode step: fold its per-layer hits/misses (no host sync)."""
        step = self._open_step
        if step is None:
            return
        self._open_step = None
        self.counters.close_step(step.memo["counts"], self.step_t, step.live)

    def stats(self) -> dict:
        """Counters (syncs with the device): totals and per-layer hit rates over every
        closed decode step since ``reset_stats``; ``per_step`` holds the last
        ``STATS_HISTORY`` steps only."""
        steps, lh, lm, kept = self.counters.read()
        per_step = []
        for step, h, m in kept:
            sh, sm = sum(h), sum(m)
            per_step.append({"step": step, "hits": h, "misses": m,
                             "bytes_loaded": [x * self._page_bytes for x in m],
                             "hit_rate": sh / (sh + sm) if sh + sm else 1.0})
        tot_h, tot_m = sum(lh), sum(lm)
        return {
            "steps": steps, "hits": tot_h, "misses": tot_m, "bytes_loaded": tot_m * self._page_bytes,
            "hit_rate": tot_h / (tot_h + tot_m) if tot_h + tot_m else 1.0,
            "per_layer_hit_rate": [h / (h + m) if h + m else 1.0 for h, m in zip(lh, lm)],
            "per_step": per_step,
        }

    def nbytes(self) -> dict:
        """GPU bytes of the manager's own state (LRU tables, page tables)."""
        out = {"page_table": self.page_table.numel() * 4}
        if self.hier:
            out["lru_state"] = self.lru.nbytes()
            out["host_page_table"] = self.host_page_table.numel() * 8
            if self.dense_pool is not None:
                out["dense_pool"] = self.dense_pool.nbytes()
        return out
