"""SparseKVCacheManager: where every request's KV lives, and the request lifecycle.

Hierarchical mode: the full KV of every request sits in the host pool (pinned), one host
page per logical page. On the GPU each request keeps, in the model's device pool:
``sink`` pages (the first pages), a ring of ``recent`` pages for the recent window
(logical page ``p >= sink`` lives in ring slot ``p % recent``) and an LRU region of
``lru_slots`` pages shared by the sparse layers (each layer has its own contents and its
own LRU state, kept by ``sparsehi.decode.SparseDecoder``). Dense layers keep the
request's full KV on the GPU in a separate, dense-layers-only pool.

GPU-only mode: every page stays in the device pool; selections map straight to the
request's own pages (no diff, no loads) — the reference the hierarchical mode must match.

Host addressing (hierarchical). ``host_addressing="pages"``: the manager allocates each
request's host pages from the host pool and offloads the prompt itself (``finish_prefill``).
``host_addressing="tokens"``: the host pool belongs to an engine that already keeps every
token's KV there (SGLang with the plugin: a token's host slot is its virtual KV id); the
manager allocates no host memory, writes nothing to it, and the decode step reads a
request's token ``t`` from host slot ``tables.host_token_slots[row, t]``, which the engine
fills (``adopt_prompt`` for the prompt, ``PageTables.record_host_tokens`` each decode step).
FP8 host KV with token addressing: the engine keeps a page's tokens on one host page, in
order, and stores each page's FP8 record once it is complete (before a step may miss it);
the decoder reads misses by host page (``tables.host_pages``, derived from the token
table) and rounds the GPU copies it writes (ring, dense-layer pool) when a page completes.

Chunked prefill (hierarchical, as SGLang's: each chunk an extend whose ``prefix_lens``
are the tokens done). ``finish_prefill(..., more_chunks=...)`` ends a chunk after which the
prompt goes on: the chunk's KV is offloaded and its part of the GPU buffer (sink pages,
recent window so far) and of the dense-layer pool placed, its device pages released; the
row is CHUNKED (``chunk_starts`` gives the tokens done, the algorithm builds only the
later positions' representations). The last chunk leaves the row as a prefill of the
whole prompt would.

Dense rows. A request whose prompt is shorter than ``SparseConfig.min_sparse_prompt_len``
is decoded densely in every layer, as SGLang's sparse coordinator does: its whole KV stays
in the device pool (hierarchical mode still backs it up to host, for the radix tree) and
its sparse layers attend all of its pages.

The manager owns the request table (host side, ``RequestTable``), the device page tables
(``PageTables``), the dense-layer pool and the step counter. It runs the host part of a
decode step (``prepare_decode``: checks, new pages at page boundaries, vectorised over the
batch); the device part is ``sparsehi.decode``. It holds no selection policy.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

from hicache.device_pool import DeviceKVPool
from hicache.triton_support import cdiv
from sparsehi.config import SparseConfig
from sparsehi.fp8_pages import round_pages
from sparsehi.page_tables import BufferSizes, PageTables, page_entries
from sparsehi.prefill import HostPrefill, PrefillRow
from sparsehi.request_table import CHUNKED, FREE, LIVE, PREFILLED, RequestBuffers, RequestTable

COORDINATOR_MODES = ("hierarchical", "gpu_only")
HOST_ADDRESSING = ("pages", "tokens")
__all__ = ["COORDINATOR_MODES", "HOST_ADDRESSING", "RequestKV", "SparseKVCacheManager"]


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


class SparseKVCacheManager:
    """Requests, their pages and page tables (see the module docstring).

    ``sizes`` (selection units: pages; tokens when ``page_size == 1``): ``top_k``,
    ``lru_slots``, ``sink``, ``recent``, ``max_pages`` per request.

    ``validate=True`` checks prefill slot lists (host reads).
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
        if config.kv_cache_dtype != device_pool.spec.kv_cache_dtype:
            raise ValueError(f"SparseConfig.kv_cache_dtype={config.kv_cache_dtype!r} but the device pool holds "
                             f"kv_cache_dtype={device_pool.spec.kv_cache_dtype!r} rows (KVCacheSpec.mla_fp8 builds "
                             f"the FP8 latent pool)")
        num_layers = device_pool.spec.num_layers
        self.sparse_layers = tuple(sorted(set(int(x) for x in sparse_layers)))
        if any(not 0 <= x < num_layers for x in self.sparse_layers):
            raise ValueError(f"sparse_layers={self.sparse_layers} must lie in [0, {num_layers})")
        self.dense_layers = tuple(x for x in range(num_layers) if x not in self.sparse_layers)
        self.config = config
        self.mode = mode
        self.hierarchical = mode == "hierarchical"
        self.host_tokens = host_addressing == "tokens"
        self.device_pool = device_pool
        self.host_pool = host_pool
        self.device = dev = device_pool.device
        self.validate = validate
        self.max_num_reqs = max_num_reqs
        self.max_context_len = max_context_len
        self.sizes = z = BufferSizes.of(config, max_context_len)
        self.requests = RequestTable(max_num_reqs, z.max_pages, z.sink, z.recent, z.lru_slots)
        self.step = 0
        self.step_counter = torch.zeros(1, dtype=torch.int32, device=dev)
        """``[1] int32`` ``step`` on the device (the decode step's LRU clock)."""
        self.transfer = None
        self.dense_pool: Optional[DeviceKVPool] = None
        if self.hierarchical:
            if transfer is None:
                from hicache.transfer import KVTransferEngine

                transfer = KVTransferEngine(device_pool, host_pool, io_backend=config.io_backend)
            self.transfer = transfer
            if self.dense_layers:
                spec = dataclasses.replace(device_pool.spec, num_layers=len(self.dense_layers))
                n = dense_pool_tokens if dense_pool_tokens is not None else device_pool.num_slots
                self.dense_pool = DeviceKVPool(spec, n, dev)
        self.tables = PageTables(z, max_num_reqs, dev, hierarchical=self.hierarchical,
                                 dense_pool=self.dense_pool is not None, host_tokens=self.host_tokens,
                                 pages_from_tokens=config.host_kv_dtype == "fp8_e4m3")
        self._host_prefill = HostPrefill(z, device_pool, host_pool, self.transfer, self.dense_pool, self.dense_layers,
                                         self.requests, self.tables, validate) if self.hierarchical else None

    # ------------------------------------------------------------------ requests
    def _check_row(self, row: int) -> None:
        if not isinstance(row, (int, np.integer)) or isinstance(row, bool) or not 0 <= row < self.max_num_reqs:
            raise ValueError(f"req_pool_index={row!r} is invalid: an int in [0, max_num_reqs={self.max_num_reqs})")

    def _req(self, row: int) -> RequestBuffers:
        self._check_row(row)
        if self.requests.state[row] == FREE:
            raise ValueError(f"req_pool_index={row} is not a live request (call on_request_begin first); "
                             f"live: {self.requests.live_rows()}")
        return RequestBuffers(self.requests, int(row), self.sizes.page_size)

    @property
    def reqs(self) -> dict[int, RequestBuffers]:
        """Live requests by row (read views of the request table)."""
        return {r: RequestBuffers(self.requests, r, self.sizes.page_size) for r in self.requests.live_rows()}

    def begin_request(self, row: int) -> None:
        self._check_row(row)
        if self.requests.state[row] != FREE:
            raise ValueError(f"req_pool_index={row} is already live (on_request_end it first)")
        self.requests.reset(row)
        self.requests.state[row] = LIVE
        self.tables.reset_row(row)

    def end_request(self, row: int) -> RequestKV:
        """Free what the manager owns for ``row`` and hand its KV to the runtime.

        Hierarchical: the returned host slots are complete and visible to CPU readers (tree
        insert, L3 write): decode backups run asynchronously on the current stream (kernel io
        backend), so this waits for that stream once per request before returning."""
        self._req(row)
        ps = self.sizes.page_size
        t = self.requests
        n = int(t.seq[row])
        P = cdiv(n, ps)
        out = RequestKV(seq_len=n)
        ar = torch.arange(ps)
        if self.hierarchical:
            if not self.host_tokens:  # token addressing: the host copies are the engine's
                self._sync_host_writes()
                hp = (torch.from_numpy(t.host[row, :P].copy()) if P and t.host[row, 0] >= 0
                      else torch.zeros(0, dtype=torch.int64))
                out.host_pages = hp
                out.host_slots = (hp[:, None] * ps + ar[None, :]).reshape(-1)[:n]
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
            out.device_slots = (dp[:, None] * ps + ar[None, :]).reshape(-1)[:n]
        t.reset(row)
        return out

    def _sync_host_writes(self) -> None:
        """Block the host until every device->host write queued so far on the current stream
        has landed (no-op on CPU, where copies are synchronous)."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    # ------------------------------------------------------------------ prefill
    def finish_prefill(self, rows: list[int], seq_lens: list[int], prefix_lens: list[int], token_slots: torch.Tensor,
                       host_slots: Optional[list[torch.Tensor]] = None, free_device_kv: bool = True,
                       more_chunks: Optional[Sequence[bool]] = None) -> None:
        """After a dense prefill forward: record pages; hierarchical mode offloads every
        layer to host in one pass, builds the GPU buffers and releases the prompt's pages
        (dense rows keep theirs: they decode from them).

        token_slots: ``[B, max_len] int64`` device slot of every position (hierarchical:
                     from the row's chunk start on, see ``chunk_starts``; ``-1`` may stand
                     before it).
        host_slots:  per row ``[>= seq_len] int64`` host slots (tree-owned, page aligned);
                     only ``[prefix_len, seq_len)`` is written. None: allocate, write all
                     (from the row's chunk start).
        more_chunks: per row, whether its prompt goes on in a later prefill chunk (chunked
                     prefill, see ``chunk_starts``); such a chunk ends on a page boundary,
                     and its row stays CHUNKED until its last chunk. None: no row does.
        """
        ps = self.sizes.page_size
        b = len(rows)
        more = [False] * b if more_chunks is None else [bool(x) for x in more_chunks]
        if len(seq_lens) != b or len(prefix_lens) != b or len(more) != b:
            raise ValueError(f"req_pool_indices ({b} rows), seq_lens ({len(seq_lens)}), prefix_lens "
                             f"({len(prefix_lens)}) and more_chunks ({len(more)}) must have one entry per batch row")
        if len(set(rows)) != b:
            raise ValueError(f"req_pool_indices must be distinct within a batch, got {list(rows)}")
        if token_slots.dim() != 2 or token_slots.shape[0] != b:
            raise ValueError(f"token_slots must be [B={b}, max_len] int64, got {tuple(token_slots.shape)}")
        if host_slots is not None and len(host_slots) != b:
            raise ValueError(f"host_slots must hold one tensor per batch row ({b}), got {len(host_slots)}")
        if self.host_tokens:
            raise ValueError("host_addressing='tokens': the engine keeps the prompt's host copy; register it with "
                             "adopt_prompt instead of finish_prefill")
        starts = self._chunk_checks(rows, seq_lens, prefix_lens, more)
        ts_cpu = token_slots.detach().to("cpu", torch.int64)
        dev_pages: list[torch.Tensor] = []
        for i, (seq, req_row) in enumerate(zip(seq_lens, rows)):
            if seq > self.max_context_len:
                raise ValueError(f"seq_len={seq} of req_pool_index={req_row} exceeds max_context_len={self.max_context_len}")
            pos = ts_cpu[i, :seq]
            pages = pos[::ps] // ps
            first = starts[i] if self.hierarchical else 0  # gpu_only keeps (and names) every chunk's KV
            if self.validate:
                want = (pages[:, None] * ps + torch.arange(ps)[None, :]).reshape(-1)[:seq]
                if not torch.equal(pos[first:], want[first:]):
                    raise ValueError("token_slots must be page aligned: position p*page_size starts a device page and a "
                                     "page's positions use its consecutive slots")
            dev_pages.append(torch.where(torch.arange(pages.numel()) * ps < first, -1, pages))
        dense = [seq < self.config.min_sparse_prompt_len and not (st or mo)
                 for seq, st, mo in zip(seq_lens, starts, more)]
        if self.mode == "gpu_only":
            self._record_device_pages(rows, seq_lens, starts, more, dev_pages, dense)
            return
        self._host_prefill.offload([PrefillRow(r, seq_lens[i], prefix_lens[i], starts[i], more[i], dense[i],
                                               dev_pages[i]) for i, r in enumerate(rows)],
                                   ts_cpu, host_slots, free_device_kv)

    def _chunk_checks(self, rows: list[int], seq_lens: list[int], prefix_lens: list[int],
                      more: list[bool]) -> list[int]:
        """Each row's chunk start (the tokens its earlier chunks placed) after checking that
        the forward may end its chunk: a live row not yet prefilled, continuing where its
        last chunk ended, a chunk with more to come ending on a page boundary, a chunked
        prompt long enough to decode sparsely. ValueError otherwise, nothing changed."""
        ps = self.sizes.page_size
        starts = []
        for r, seq, pre, mo in zip(rows, seq_lens, prefix_lens, more):
            req = self._req(r)
            if req.prefilled:
                raise ValueError(f"req_pool_index={r} was already prefilled")
            start = req.seq_len if req.chunked else 0
            if pre < start:
                raise ValueError(f"req_pool_index={r} continues its prompt after the {start} tokens of its earlier "
                                 f"chunks: prefix_lens must be >= {start}, got {pre}")
            if mo and seq % ps:
                raise ValueError(f"seq_len={seq} of req_pool_index={r} must be a multiple of page_size={ps}: a prefill "
                                 "chunk with more_chunks ends on a page boundary")
            if start and not mo and seq < self.config.min_sparse_prompt_len:
                raise ValueError(f"req_pool_index={r}: a prompt prefilled in chunks decodes sparsely; its seq_len={seq} "
                                 f"is below min_sparse_prompt_len={self.config.min_sparse_prompt_len}")
            starts.append(start)
        return starts

    def has_chunked_rows(self) -> bool:
        """Whether a live row is part-way through its prompt (chunked prefill)."""
        return bool((self.requests.state == CHUNKED).any())

    def chunk_starts(self, rows: Sequence[int]) -> Optional[list[int]]:
        """Per row, the prompt tokens its earlier prefill chunks placed (0: none), or None
        when no row of ``rows`` is part-way through its prompt (no host read otherwise)."""
        t = self.requests
        if not self.has_chunked_rows():
            return None
        out = [int(t.seq[r]) if t.state[r] == CHUNKED else 0 for r in rows]
        return out if any(out) else None

    def _record_device_pages(self, rows: list[int], seq_lens: list[int], starts: list[int], more: list[bool],
                             dev_pages: list[torch.Tensor], dense: list[bool]) -> None:
        """gpu_only: a row's page table from its last chunk's ``token_slots`` (the caller
        keeps every chunk's KV on the device); a chunk with more to come only counts its
        tokens. FP8 host KV: the chunk's complete pages rounded."""
        for i, r in enumerate(rows):
            if more[i]:
                self.requests.mark_chunk(r, seq_lens[i])
                continue
            P = dev_pages[i].numel()
            self.requests.device[r, :P] = dev_pages[i].numpy()
            self._mark_prefilled(r, seq_lens[i], dense[i])
            self.tables.context_pages[r, :P] = dev_pages[i].to(self.device, torch.int32)
        if self.config.host_kv_dtype == "fp8_e4m3":
            self._round_complete_pages(seq_lens, starts, dev_pages)

    def _round_complete_pages(self, seq_lens: list[int], starts: list[int], dev_pages: list[torch.Tensor]) -> None:
        """gpu_only with FP8 host KV (the exact reference of sparse-hier's): every complete
        prompt page from ``starts`` (an earlier chunk rounded those before) rounded in place,
        every layer, as FP8 host pages would store it."""
        ps = self.sizes.page_size
        pages = torch.cat([dp[st // ps: seq // ps] for seq, st, dp in zip(seq_lens, starts, dev_pages)]).to(self.device)
        if pages.numel():
            round_pages(self.device_pool.paged_view(), pages, ps, torch.ones_like(pages, dtype=torch.bool))

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
        if self.validate and self.tables.pages_from_tokens:
            self._check_host_pages_aligned(seq_lens, host_slots)
        self._host_prefill.adopt(list(rows), list(seq_lens), token_slots, host_slots)

    def _check_host_pages_aligned(self, seq_lens: list[int], host_slots: torch.Tensor) -> None:
        """FP8 host pages with token addressing: position ``p * page_size + t`` of a prompt
        must live at host slot ``h * page_size + t`` of one host page ``h`` (host reads)."""
        ps = self.sizes.page_size
        for i, n in enumerate(seq_lens):
            h = host_slots[i, :n].to("cpu", torch.int64)
            want = torch.div(h[::ps], ps, rounding_mode="floor").repeat_interleave(ps)[:n] * ps + torch.arange(n) % ps
            if not torch.equal(h, want):
                raise ValueError("host_kv_dtype='fp8_e4m3' with host_addressing='tokens' needs each page's tokens on "
                                 "one host page in order (host slot = host page * page_size + position % page_size)")

    def _mark_prefilled(self, row: int, seq_len: int, dense: bool) -> None:
        self.requests.mark_prefilled(row, seq_len, dense)
        self.tables.dense_rows[row] = dense

    # ------------------------------------------------------------------ decode: host part
    def prepare_decode(self, rows: Sequence[int], seq_lens: Sequence[int]) -> bool:
        """Host part of a decode step (outside CUDA graphs): ``check_decode``, then
        ``advance_decode``. Returns whether a row of the batch is a dense row."""
        return self.advance_decode(*self.check_decode(rows, seq_lens))

    def check_decode(self, rows: Sequence[int], seq_lens: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """The batch's ``(rows, seq_lens)`` as ``int64`` arrays once checked: distinct live
        prefilled rows, each one token longer than before and within ``max_context_len``.
        ValueError otherwise; changes nothing."""
        r = np.asarray(rows, dtype=np.int64).reshape(-1)
        s = np.asarray(seq_lens, dtype=np.int64).reshape(-1)
        if r.shape != s.shape:
            raise ValueError(f"req_pool_indices ({r.size} rows) and seq_lens ({s.size}) must have one entry per batch row")
        if np.unique(r).size != r.size:
            raise ValueError(f"req_pool_indices must be distinct within a batch, got {r.tolist()}")
        t = self.requests
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
        return r, s

    def advance_decode(self, r: np.ndarray, s: np.ndarray) -> bool:
        """After ``check_decode``: give every row that opens a new page its pages (host
        page, dense-pool page, device page of dense / gpu_only rows; vectorised over the
        batch), record the new lengths and advance the step counter. ``s`` counts the new
        token. Returns whether a row of the batch is a dense row. Running out of a pool
        raises RuntimeError with nothing changed."""
        ps = self.sizes.page_size
        pos = s - 1
        opens = pos % ps == 0
        if opens.any():
            self._open_pages(r[opens], pos[opens] // ps)
        self.requests.seq[r] = s
        self.step += 1
        self.step_counter.fill_(self.step)
        return self.has_dense_rows(r)

    def has_dense_rows(self, rows: Sequence[int]) -> bool:
        """Whether any of ``rows`` decodes densely (what ``prepare_decode`` returns; no effect)."""
        return bool(self.requests.dense[np.asarray(rows, dtype=np.int64)].any())

    def _open_pages(self, rows: np.ndarray, pages: np.ndarray) -> None:
        """Pages for logical page ``pages[i]`` of ``rows[i]``: all taken before any table
        changes, so running out of one pool leaves the manager as it was. The device tables
        are updated from one host->device copy of every new entry."""
        n = rows.size
        t = self.requests
        dev_mask = np.ones(n, dtype=bool) if not self.hierarchical else t.dense[rows]
        n_dev = int(dev_mask.sum())
        got: list[tuple] = []  # (allocator, pages) to give back on failure
        try:
            new_dev = new_host = new_dense = None
            if n_dev:
                new_dev = self.device_pool.allocator.alloc_pages(n_dev, on_host=True)
                if new_dev is None:
                    raise RuntimeError(f"device pool is out of space for {n_dev} new decode pages")
                got.append((self.device_pool.allocator, new_dev))
            if self.hierarchical and not self.host_tokens:
                new_host = self.host_pool.allocator.alloc_pages(n, on_host=True)
                if new_host is None:
                    raise RuntimeError(f"host pool is out of space for {n} new decode pages")
                got.append((self.host_pool.allocator, new_host))
            if self.hierarchical and self.dense_pool is not None:
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
            ents.append(page_entries(0, rows, pages, new_host.numpy()))
        if new_dense is not None:
            t.dense_pool[rows, pages] = new_dense.numpy()
            ents.append(page_entries(1, rows, pages, new_dense.numpy()))
        if new_dev is not None:
            t.device[rows[dev_mask], pages[dev_mask]] = new_dev.numpy()
            ents.append(page_entries(2, rows[dev_mask], pages[dev_mask], new_dev.numpy()))
        if ents:
            self.tables.write_entries(np.concatenate(ents))
