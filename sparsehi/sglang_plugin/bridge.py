"""The coordinator inside SGLang's model runner: one :class:`SGLangSparseBridge` per model
runner, built when its memory pools are allocated.

Memory. SGLang's KV slots become host-backed (``host_backed_allocator``): the scheduler's
allocator, tree and request rows hold virtual slots whose KV lives in the plugin's pinned
host pool (host slot = virtual slot), and GPU memory (the same bytes SGLang had allotted
to its KV pool, taken over without a second copy: ``pool_view.adopt_kv_pool``) is split
into GPU pages for the virtual pages SGLang's own kernels need (``KVResidency``) and the
sparse requests' buffers. What stays on the GPU, page by page (pins):

- a prompt while it is prefilled (chunk after chunk), and a prefix hit's pages, brought
  back from host before the extend forward that reads them;
- every page of a request SGLang decodes itself (a prompt shorter than
  ``min_sparse_prompt_len``, or no sparse capacity left);
- of a registered (sparse) request, only the page its newest token is written to.

Everything a forward writes is copied to host after it (write-through; FP8 host KV,
``--sparsehi-host-kv-dtype fp8_e4m3``: each page once it is complete, ``bridge_host_kv``),
so a page whose pins drop to zero is demoted: its GPU page is freed, its KV stays in host
memory, where the radix tree keeps finding it. A sparse request's GPU footprint after
registration is its buffer (sink + LRU region + recent ring + a page) and one page.

Forwards. Extend forwards are SGLang's own; around them the bridge pins the rows' pages
(bringing a prefix hit back first), copies the new tokens to host after, and for a prompt
that will decode sparsely builds the algorithm's representations from the keys on the GPU
(so registration does not stall the first decode step). At a row's first decode forward
its prompt is complete: it is registered (``adopt_prompts``: buffers set up from the prompt
still on the GPU) and its prompt pages are demoted after that step; the first step's
misses are read from GPU memory (``set_residency``). Decode steps of registered rows run
the coordinator's layer path (selection, swap-in, adapter attention) in SGLang's decode
CUDA graphs (capture head / tail hooks), as before; SGLang's attention sees our rows as one
token (``sglang_lengths``) and its output for them is replaced.

Request end. ``ReqToTokenPool.free_rows`` (SGLang frees a row after its KV went to the tree
or back to the allocator): the row's pins are dropped, its sparse state ends.
"""
from __future__ import annotations

import logging
from typing import Any, Optional

import numpy as np
import torch

from hicache.residency import KVResidency
from hicache.transfer import KVTransferEngine
from sparsehi.config import SparseConfig
from sparsehi.coordinator import SparseCoordinator
from sparsehi.forward_batch import ForwardBatch as SparseBatch
from sparsehi.sglang_plugin import sglang_api
from sparsehi.sglang_plugin.bridge_attention import DecodeAttention
from sparsehi.sglang_plugin.bridge_host_kv import check_fp8_page_size, host_token_bytes, make_host_pool, write_through
from sparsehi.sglang_plugin.bridge_memory import (host_kv_tokens, representation_bytes, round_up,
                                                  sparse_request_count, table_bytes)
from sparsehi.sglang_plugin.bridge_pages import GpuPagePins
from sparsehi.sglang_plugin.bridge_state import (PROMPT_LENS_ATTR, DecodeState, ExtendState, NoRowsOfOurs,
                                                 host_ints, host_rows)
from sparsehi.sglang_plugin.host_backed_allocator import host_backed_allocator_class
from sparsehi.sglang_plugin.pool_view import adopt_kv_pool, describe_kv_pool, req_to_token_rows
from sparsehi.sglang_plugin.sglang_algorithm import create_plugin_algorithm

logger = logging.getLogger(__name__)

ATTEND_WITH = ("adapter", "sglang_triton")


def _check_options(config: SparseConfig, attend_with: str, sglang_page_size: int) -> None:
    check_fp8_page_size(config, sglang_page_size)
    if config.algorithm == "dsa":
        raise ValueError("--sparsehi-algorithm dsa needs the DeepSeek indexer's queries and keys, which SGLang's "
                         "RadixAttention does not hand the plugin: use quest, oracle or package.module:ClassName")
    if attend_with not in ATTEND_WITH:
        raise ValueError(f"attend_with must be one of {ATTEND_WITH}, got {attend_with!r}")
    if attend_with == "sglang_triton" and config.backend != "triton":
        raise ValueError(f"attend_with='sglang_triton' reads Triton metadata: needs --sparsehi-backend triton, "
                         f"got {config.backend!r}")


class SGLangSparseBridge(GpuPagePins, DecodeAttention):
    """The plugin inside one SGLang model runner (see the module docstring).

    config: the parsed ``--sparsehi-*`` options. runner: SGLang's ``ModelRunner`` right
    after ``alloc_memory_pool`` (``req_to_token_pool``, ``token_to_kv_pool``,
    ``token_to_kv_pool_allocator``, ``max_running_requests``, ``kv_index_translator``);
    the bridge replaces its allocator and KV buffers and switches its translator.
    adapter_impl: the adapter's kernel choice (``auto``: Triton on CUDA, torch reference on
    CPU). attend_with: ``adapter`` or ``sglang_triton`` (``--sparsehi-backend triton``
    only: SGLang's Triton decode kernel over our ``kv_indptr`` / ``kv_indices``).
    validate: the coordinator's host-side value checks (syncs; tests only).
    """

    def __init__(self, config: SparseConfig, runner: Any, *, adapter_impl: str = "auto",
                 attend_with: str = "adapter", validate: bool = False) -> None:
        req_pool, kv_pool, sgl_alloc = sglang_api.runner_pools(runner)
        lay = describe_kv_pool(kv_pool)
        _check_options(config, attend_with, lay.page_size)
        self.attend_with = attend_with
        self.config = config
        self.req_to_token_pool, self.kv_pool = req_pool, kv_pool
        rows, max_ctx = req_to_token_rows(req_pool)
        self.num_rows = rows
        self.sgl_ps = lay.page_size
        ps = config.page_size
        max_ctx = round_up(max_ctx, ps)
        max_running = int(getattr(runner, "max_running_requests", None) or rows - 1)
        sgl_tokens = int(kv_pool.size)
        per_req = (config.sink_units + config.recent_units + config.buffer_units + 1) * ps
        dev = kv_pool.device if isinstance(kv_pool.device, torch.device) else torch.device(kv_pool.device)

        # the algorithm first: its representations come out of SGLang's KV memory too
        self.algorithm = create_plugin_algorithm(config, dev)
        spec = lay.spec()
        token_bytes = spec.token_bytes
        rep_per_req = representation_bytes(config, kv_pool.device, spec, max_ctx)
        budget = sgl_tokens * token_bytes
        self.max_sparse = sparse_request_count(config, budget, per_req, token_bytes, rep_per_req, max_running)
        extra = self.max_sparse * rep_per_req + table_bytes(config, self.max_sparse, kv_pool.size, max_ctx,
                                                            spec.num_layers)
        self.device_pool, res_rows = adopt_kv_pool(kv_pool, sel_page_size=ps, reserve_tokens=self.max_sparse * per_req,
                                                   extra_bytes=extra)
        self.physical_pages = res_rows // self.sgl_ps - 1
        self._make_host_tier(runner, sgl_alloc, sgl_tokens, spec, dev)
        adapter = self._make_coordinator(spec, adapter_impl, max_ctx, validate)
        self._make_row_state(rows)
        self._make_step_buffers(rows, dev)
        logger.info("sparsehi: SGLang's %s KV memory (%d tokens) as %d GPU tokens for SGLang's kernels + buffers of %d "
                    "sparse requests; %d host-backed KV slots (%.1f GB pinned); algorithm %s, adapter %s",
                    self.kv_kind.upper(), sgl_tokens, self.physical_pages * self.sgl_ps, self.max_sparse,
                    self.virtual_tokens, self.host_pool.nbytes() / 1e9, type(self.algorithm).__name__, adapter.name)

    # ------------------------------------------------------------------ set-up
    def _make_host_tier(self, runner: Any, sgl_alloc: Any, sgl_tokens: int, spec: Any, dev: torch.device) -> None:
        """The pinned host pool, its transfer engine, the GPU page residency and the
        host-backed allocator installed in SGLang's runner."""
        ps = self.config.page_size
        # host pool: one slot per virtual KV slot (SGLang's allocator hands out 1..V), at
        # most HOST_SHARE of the machine's memory per TP rank (the same on every rank: their
        # schedulers must decide alike)
        unit = max(ps, self.sgl_ps)
        tp = max(1, int(getattr(runner, "tp_size", 1) or 1))
        host_tokens = host_kv_tokens(self.config, sgl_tokens, unit, host_token_bytes(self.config, self.device_pool), tp)
        self.virtual_tokens = host_tokens - self.sgl_ps
        ratio = (host_tokens + ps) / self.device_pool.num_slots
        self.host_pool = make_host_pool(self.config, self.device_pool, max(ratio, 1.0 + 1e-9))
        self.transfer = KVTransferEngine(self.device_pool, self.host_pool, io_backend="kernel", validate=False)
        self.residency = KVResidency(self.virtual_tokens // self.sgl_ps, self.physical_pages, dev)
        self.forwards = 0
        self.allocator = self._make_allocator(sgl_alloc)
        sglang_api.install_allocator(runner, self.allocator, self.virtual_tokens)
        translator = getattr(runner, "kv_index_translator", None)
        if translator is not None:
            sglang_api.make_translating(translator, self.allocator)

    def _make_coordinator(self, spec: Any, adapter_impl: str, max_ctx: int, validate: bool) -> Any:
        """The coordinator over compact request slots [0, max_sparse); returns its adapter."""
        from sparsehi.adapters import create_adapter

        config, ps = self.config, self.config.page_size
        self.kv_kind = spec.attention
        if self.kv_kind == "mla":
            adapter = create_adapter("dsa", kv_lora_rank=spec.kv_lora_rank, impl=adapter_impl)
        else:
            if config.backend == "dsa":
                raise ValueError("--sparsehi-backend=dsa needs an MLA model; this model has an MHA cache: use "
                                 "'flashattention' or 'triton'")
            adapter = create_adapter(config.backend, impl=adapter_impl)
        dense_layers = [layer for layer in range(spec.num_layers) if not self.algorithm.is_sparse_layer(layer)]
        self.coord = SparseCoordinator(
            config, self.algorithm, self.device_pool, mode="hierarchical", host_pool=self.host_pool,
            transfer=self.transfer, adapter=adapter, max_num_reqs=self.max_sparse, max_context_len=max_ctx,
            validate=validate, host_addressing="tokens",
            dense_pool_tokens=(self.max_sparse * (max_ctx + ps) + 2 * ps) if dense_layers else None,
        )
        self.coord.set_residency(self.residency.v2p, self.sgl_ps)
        return adapter

    def _make_row_state(self, rows: int) -> None:
        """Host-side state per SGLang row."""
        self.slot_of_row = np.full(rows, -1, dtype=np.int64)
        self.row_of_slot = np.full(self.max_sparse, -1, dtype=np.int64)
        self.free_slots = list(range(self.max_sparse - 1, -1, -1))
        self.registered = np.zeros(rows, dtype=bool)
        self.declined = np.zeros(rows, dtype=bool)
        """Rows SGLang decodes itself (short prompt, or no sparse slot left) until freed."""
        self.pinned_len = np.zeros(rows, dtype=np.int64)
        """Tokens of a row whose pages the row pins (prefilling rows, rows SGLang decodes)."""
        self.open_pos = np.full(rows, -1, dtype=np.int64)
        """Registered rows: position whose page the row pins (its newest token's)."""
        self.prompt_len = np.zeros(rows, dtype=np.int64)
        self.registrations = 0

    def _make_step_buffers(self, rows: int, dev: torch.device) -> None:
        """Ordering events and the static per-step row buffers."""
        self._wt_event = torch.cuda.Event() if dev.type == "cuda" else None  # last extend write-through
        self._fwd_event = torch.cuda.Event() if dev.type == "cuda" else None  # end of the last forward
        # static per-step buffers over SGLang's batch positions (never reallocated; the
        # layer hooks and recorded graphs read views of them), filled from two pinned host
        # slots used in turn
        self._packed = torch.empty(4, rows, dtype=torch.int64, device=dev)  # slots, sgl rows, lengths, ours
        self._slots, self._sgl_rows = self._packed[0], self._packed[1]
        self._seq = torch.ones(rows, dtype=torch.int32, device=dev)
        self._ours = torch.zeros(rows, dtype=torch.bool, device=dev)
        pin = dev.type == "cuda"
        self._host_slots = [torch.empty(4, rows, dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        self._copied = [torch.cuda.Event() if pin else None for _ in range(2)]
        self._turn = 0
        self._staged = rows
        empty = np.zeros(0, dtype=np.int64)
        self._stage(empty, empty, empty, np.zeros(0, dtype=bool))

    def _make_allocator(self, sgl_alloc: Any) -> Any:
        cls, args, kwargs = sglang_api.allocator_class_args(sgl_alloc, self.virtual_tokens)
        alloc = host_backed_allocator_class(cls)(*args, **kwargs)
        alloc.bind_residency(self.residency, settle_tag=lambda: self.forwards - 1)
        return alloc

    # ------------------------------------------------------------------ ordering helpers
    def _after_forwards(self) -> None:
        """Make the current stream wait for the last forward and the last extend's
        write-through (before demoting pages they may read or write)."""
        for ev in (self._fwd_event, self._wt_event):
            if ev is not None:
                torch.cuda.current_stream().wait_event(ev)

    # ------------------------------------------------------------------ forwards
    def begin_forward(self, fb: Any) -> Any:
        """Host part before SGLang's forward: an ``ExtendState`` / ``DecodeState`` for the
        forward's end, or None (nothing of ours runs in it)."""
        self.forwards += 1
        mode = fb.forward_mode
        state: Any = None
        if mode.is_decode():
            state = self._begin_decode(fb)
        elif mode.is_mixed():
            rows = host_rows(fb)
            if self.registered[rows].any():
                raise ValueError("sparsehi does not run mixed chunked-prefill/decode batches: leave "
                                 "--enable-mixed-chunk off")
            state = self._begin_extend(fb)
        elif mode.is_extend():
            state = self._begin_extend(fb)
        self.residency.ready()
        return state

    def _begin_extend(self, fb: Any) -> ExtendState:
        rows = host_rows(fb)
        seq = host_ints("seq_lens", getattr(fb, "seq_lens_cpu", None), fb.seq_lens)
        pre = np.asarray(getattr(fb, "extend_prefix_lens_cpu", None) or [0] * len(rows), dtype=np.int64)
        prompt = getattr(fb, PROMPT_LENS_ATTR, None)
        prompt = np.asarray(prompt if prompt is not None else seq, dtype=np.int64)
        new = self.pinned_len[rows] == 0
        for r in rows[new & self.registered[rows]]:  # a row extended again (a resumed request)
            self.release_rows([int(r)])
        fresh = new & (pre > 0)
        if fresh.any():
            self._bring_back(rows[fresh], pre[fresh])
        prev = self.pinned_len[rows].copy()
        self._pin(rows, prev, seq)
        self.pinned_len[rows] = np.maximum(self.pinned_len[rows], seq)
        self.prompt_len[rows] = prompt
        want = (self.slot_of_row[rows] < 0) & ~self.declined[rows] & (prompt >= self.config.min_sparse_prompt_len)
        got = []
        for r in rows[want]:
            if not self.free_slots:
                break
            slot = self.free_slots.pop()
            self.coord.on_request_begin(slot)
            self.slot_of_row[r], self.row_of_slot[slot] = slot, r
            got.append(int(r))
        return ExtendState(fb, rows, seq, self.slot_of_row[rows] >= 0, prev, got)

    def _write_through(self, fb: Any) -> Any:
        """The forward's new tokens to host (``bridge_host_kv.write_through``): the backup's
        handle, or None (FP8 pages, stored on the current stream; nothing written)."""
        virt = getattr(fb, "out_cache_loc_virtual", None)
        if virt is None:
            virt = fb.out_cache_loc  # an untranslated batch (tests): virtual = GPU slots
        if fb.out_cache_loc is None or not fb.out_cache_loc.numel():
            return None
        return write_through(self.transfer, fb.out_cache_loc, virt)

    def _end_extend(self, state: ExtendState) -> None:
        if not self.transfer.fp8:  # the backup first: it overlaps the representations' build
            if self._write_through(state.fb) is not None and self._wt_event is not None:
                with torch.cuda.stream(self.transfer.stream):
                    self._wt_event.record()
        if state.sparse.any():
            self._build_representations(state)
        if self.transfer.fp8:  # after the build: bounds from the keys before rounding, as the runtime's prefill
            self._write_through(state.fb)

    def _build_representations(self, state: ExtendState) -> None:
        """The algorithm's representations of the rows that will decode sparsely, from their
        keys on the GPU. FP8: a prompt's pages before its last chunk were rounded when they
        were stored, so they keep the representations built from the keys before rounding
        (``represented_lens``: its earlier chunks' whole pages) where the algorithm takes them."""
        rows, seq = state.rows[state.sparse], state.seq[state.sparse]
        r, p = self._row_positions(rows, np.zeros_like(seq), seq, every_token=True)
        width = int(seq.max())
        with self.residency.ordered():
            phys = self.residency.physical_slots(self._vids(r, p), self.sgl_ps)
        tab = torch.full((len(rows), width), -1, dtype=torch.int64, device=phys.device)
        row_idx = np.repeat(np.arange(len(rows)), seq)
        tab[torch.from_numpy(row_idx).to(phys.device), torch.from_numpy(p).to(phys.device)] = phys
        slots = torch.from_numpy(self.slot_of_row[rows])
        batch = SparseBatch.prefill(slots, torch.from_numpy(seq.astype(np.int32)), tab,
                                    prefix_lens=torch.zeros(len(rows), dtype=torch.int32),
                                    seq_lens_cpu=[int(x) for x in seq], prefix_lens_cpu=[0] * len(rows))
        kw = {}
        if self.transfer.fp8 and getattr(self.algorithm, "supports_chunked_prefill", False):
            ps = self.config.page_size
            done = np.where(np.isin(rows, state.new_slots), 0, state.prev_pinned[state.sparse] // ps * ps)
            kw["represented_lens"] = torch.from_numpy(done.astype(np.int32))
        for layer in range(self.coord.num_layers):
            self.coord.attention_end(layer, batch, **kw)

    def _begin_decode(self, fb: Any) -> Optional[DecodeState]:
        rows = host_rows(fb)
        seq = host_ints("seq_lens", getattr(fb, "seq_lens_cpu", None), fb.seq_lens)
        b = len(rows)
        if b > self._slots.shape[0]:
            raise ValueError(f"decode batch of {b} rows exceeds the ReqToTokenPool's {self._slots.shape[0]} rows")
        first = ~(self.registered[rows] | self.declined[rows])
        reg = first & (self.slot_of_row[rows] >= 0)
        if reg.any():
            self._register(rows[reg], seq[reg] - 1)
        self.declined[rows[first & ~reg]] = True
        dense = self.declined[rows]
        if dense.any():  # SGLang decodes them: their new token's page stays on the GPU
            d = rows[dense]
            self._pin(d, self.pinned_len[d], seq[dense])
            self.pinned_len[d] = np.maximum(self.pinned_len[d], seq[dense])
        ours = self.registered[rows]
        slots = self.slot_of_row[rows]
        self.coord.prepare_decode(slots[ours], seq[ours])
        self._stage(slots, rows, seq, ours)
        now = reg & self.registered[rows]  # those whose registration went through
        state = DecodeState(self._slots[:b], self._sgl_rows[:b], self._seq[:b], self._ours[:b], bool(ours.all()),
                            fb=fb, host_rows=rows, host_ours=ours, host_seq=seq,
                            registered_now=rows[now] if now.any() else None)
        return state if ours.any() else NoRowsOfOurs(state)

    def _register(self, rows: np.ndarray, lens: np.ndarray) -> None:
        """Rows whose prompts of ``lens`` tokens are complete (their first decode forward):
        the coordinator adopts them from SGLang's KV (on the GPU where still pinned, else
        host). On error nothing is registered (the rows decode on SGLang's path)."""
        r, p = self._row_positions(rows, np.zeros_like(lens), lens, every_token=True)
        width = int(lens.max())
        with self.residency.ordered():
            vids = self._vids(r, p)
            phys = self.residency.physical_slots(vids, self.sgl_ps)
        dev = vids.device
        i = torch.from_numpy(np.repeat(np.arange(len(rows)), lens)).to(dev)
        pos = torch.from_numpy(p).to(dev)
        host = torch.full((len(rows), width), -1, dtype=torch.int64, device=dev)
        gpu = torch.full((len(rows), width), -1, dtype=torch.int64, device=dev)
        host[i, pos] = vids
        gpu[i, pos] = phys
        slots = [int(s) for s in self.slot_of_row[rows]]
        try:
            self.coord.adopt_prompts(slots, [int(n) for n in lens], gpu, host)
        except Exception:
            logger.exception("sparsehi: registering rows %s failed; they decode on SGLang's own path", list(rows))
            for r_ in rows:
                self._end_slot(int(r_))
            self.declined[rows] = True
            return
        self.registered[rows] = True
        self.registrations += len(rows)

    def _stage(self, slots: np.ndarray, rows: np.ndarray, seq: np.ndarray, ours: np.ndarray) -> None:
        """The step's rows into the static buffers (one non-blocking copy from a pinned slot);
        rows past the step's batch up to the last step's size become padding (a graph of a
        larger batch bucket reads them)."""
        b = len(rows)
        n = max(b, self._staged)
        i, self._turn = self._turn, self._turn ^ 1
        host, done = self._host_slots[i], self._copied[i]
        if done is not None:
            done.synchronize()  # the copy out of this slot two steps ago
        h = host.numpy()
        h[0, :n], h[1, :n], h[2, :n], h[3, :n] = -1, 0, 1, 0
        h[0, :b] = np.where(ours, slots, -1)
        h[1, :b] = np.where(ours, rows, 0)
        h[2, :b] = np.where(ours, seq, 1)
        h[3, :b] = ours
        self._packed[:, :n].copy_(host[:, :n], non_blocking=True)
        if done is not None:
            done.record()
        self._seq[:n].copy_(self._packed[2, :n])
        self._ours[:n].copy_(self._packed[3, :n])
        self._staged = b

    def sglang_lengths(self, fb: Any, state: DecodeState) -> dict[str, Any]:
        """SGLang's decode lengths with ours cut to one token, for its attention backend
        (new objects: SGLang's own are shared with its scheduler). Its output for our rows
        is replaced, so it need not read their context."""
        out: dict[str, Any] = {"seq_lens": torch.where(state.ours, torch.ones_like(fb.seq_lens), fb.seq_lens)}
        ours_cpu = torch.from_numpy(state.host_ours)
        cpu = getattr(fb, "seq_lens_cpu", None)
        if cpu is not None:
            cpu = torch.where(ours_cpu, torch.ones_like(cpu), cpu)
            out["seq_lens_cpu"] = cpu
            out["seq_lens_sum"] = int(cpu.sum())
        elif getattr(fb, "seq_lens_sum", None) is not None:
            out["seq_lens_sum"] = int(np.where(state.host_ours, 1, state.host_seq).sum())
        return out

    def end_forward(self, state: Any) -> None:
        """After SGLang's forward (or a capture's tail hook): write its tokens through to
        host, close the decode step, demote what no longer needs the GPU."""
        if isinstance(state, ExtendState):
            self._end_extend(state)
        elif isinstance(state, (DecodeState, NoRowsOfOurs)):
            self._end_decode(state)
        if self._fwd_event is not None and not (isinstance(state, DecodeState) and state.recorded):
            self._fwd_event.record()
        if not (isinstance(state, DecodeState) and state.recorded):
            self.residency.snapshot(self.forwards)

    def _end_decode(self, state: Any) -> None:
        inner = state.state if isinstance(state, NoRowsOfOurs) else state
        if inner.batch is not None:
            batch, inner.batch = inner.batch, None
            self.coord.forward_end(batch)
        if inner.recorded or inner.fb is None:
            return
        handle = self._write_through(inner.fb)
        if handle is not None:
            handle.wait()
        rows, seq, ours = inner.host_rows, inner.host_seq, inner.host_ours
        self._after_forwards()
        if ours.any():
            # a registered row pins only the page its newest token is written to
            r, s = rows[ours], seq[ours]
            newest = s - 1
            prev = self.open_pos[r]
            opens = (prev < 0) | (newest // self.sgl_ps != np.maximum(prev, 0) // self.sgl_ps)
            if opens.any():
                start = self._page_start(newest[opens])
                self._pin(r[opens], start, start + 1)
                old = opens & (prev >= 0)
                if old.any():
                    start = self._page_start(prev[old])
                    self._pin(r[old], start, start + 1, delta=-1)
            self.open_pos[r] = newest
        if inner.registered_now is not None:
            # the prompt's prefill pins go (after the newest page's pin: they may share a page)
            reg = inner.registered_now
            self._pin(reg, np.zeros_like(reg), self.pinned_len[reg], delta=-1, counted=True)
            self.pinned_len[reg] = 0

    # ------------------------------------------------------------------ CUDA-graph capture
    def begin_capture(self, fb: Any) -> DecodeState:
        """A decode CUDA-graph capture's forward (SGLang's capture head hook): the layer
        path is recorded over the static buffers, whatever rows are ours at replay."""
        mode = fb.forward_mode
        if not mode.is_decode():
            raise NotImplementedError(f"sparsehi: CUDA graphs of {mode} forwards (speculative decoding) are not "
                                      f"supported; allowed: decode")
        b = int(fb.batch_size)
        if b > self._slots.shape[0]:
            raise ValueError(f"captured batch of {b} rows exceeds the ReqToTokenPool's {self._slots.shape[0]} rows")
        if not (torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()):
            empty = np.zeros(0, dtype=np.int64)
            self._stage(empty, empty, empty, np.zeros(0, dtype=bool))
        return DecodeState(self._slots[:b], self._sgl_rows[:b], self._seq[:b], self._ours[:b], all_ours=False,
                           recorded=True)

    def abort_forward(self, state: Any) -> None:
        """SGLang's forward raised part-way. An extend forward's pins and new coordinator
        slots are undone (its retry redoes them). A decode step's rows of ours may be
        half-advanced in the coordinator, so they leave it and decode on SGLang's path from
        now on (their KV is whole: in host memory, and SGLang's slots name it)."""
        if isinstance(state, ExtendState):
            for r in state.new_slots:
                self._end_slot(r)
            self._pin(state.rows, state.prev_pinned, state.seq, delta=-1)
            self.pinned_len[state.rows] = state.prev_pinned
            return
        inner = state.state if isinstance(state, NoRowsOfOurs) else state
        try:
            if isinstance(inner, DecodeState) and inner.batch is not None:
                batch, inner.batch = inner.batch, None
                self.coord.forward_end(batch)
        finally:
            if isinstance(inner, DecodeState) and inner.host_rows is not None:
                ours = inner.host_ours
                rows = [int(r) for r in inner.host_rows[ours]]
                for r, seq in zip(rows, inner.host_seq[ours]):
                    # pinned whole before the slot's pin on its newest page goes: that page
                    # may have no host record yet (FP8 pages are stored once complete), so it
                    # must not leave the GPU in between
                    self._repin_whole(r, int(seq))
                    self._end_slot(r)
                    self.declined[r] = True
                if rows:
                    logger.warning("sparsehi: a decode forward raised; rows %s leave the sparse path and decode "
                                   "on SGLang's own attention", rows)

    def _repin_whole(self, row: int, seq: int) -> None:
        """A row that goes back to SGLang's path needs its whole context on the GPU again
        (the pages still there stay; its slot, if any, is ended by the caller)."""
        self._bring_back(np.array([row]), np.array([seq]))
        self._pin(np.array([row]), np.array([0]), np.array([seq]))
        self.pinned_len[row] = seq

    # ------------------------------------------------------------------ requests
    def _end_slot(self, row: int) -> None:
        slot = int(self.slot_of_row[row])
        if slot < 0:
            return
        if self.registered[row] and self.open_pos[row] >= 0:
            start = self._page_start(self.open_pos[row:row + 1])
            self._pin(np.array([row]), start, start + 1, delta=-1)
        self.coord.on_request_end(slot)
        self.slot_of_row[row], self.row_of_slot[slot] = -1, -1
        self.free_slots.append(slot)
        self.registered[row] = False
        self.open_pos[row] = -1

    def release_rows(self, rows: list[int]) -> None:
        """SGLang frees these ``ReqToTokenPool`` rows: their pins go (pages no one else pins
        leave the GPU once the forwards in flight are done with them), their sparse state ends."""
        rows = [int(r) for r in rows if 0 <= int(r) < self.num_rows]
        if not rows:
            return
        self._after_forwards()
        for r in rows:
            self._end_slot(r)
            if self.pinned_len[r] > 0:
                self._pin(np.array([r]), np.array([0]), self.pinned_len[r:r + 1], delta=-1, counted=True)
            self.pinned_len[r] = 0
            self.declined[r] = False
            self.prompt_len[r] = 0
        # frees wait for the forward in flight: settled once two more forwards have run
        self.residency.snapshot(self.forwards + 1)

    def decodes_sparsely(self, row: int) -> bool:
        """Whether SGLang row ``row`` decodes on the sparse path (registered, or about to be
        at its first decode: a coordinator slot for a long prompt)."""
        return 0 <= row < self.num_rows and bool(self.registered[row] or self.slot_of_row[row] >= 0)

    def gpu_frees_pending(self) -> bool:
        """Whether GPU pages were given back (a registered prompt, a finished request's
        pins, SGLang's own frees) that the host's count of free GPU pages does not hold
        yet: SGLang's admission, shut while a request did not fit, may try again."""
        return self.residency.frees_pending()

    def release_all(self) -> None:
        self.release_rows([int(r) for r in np.flatnonzero((self.pinned_len > 0) | (self.slot_of_row >= 0))])
        self.declined[:] = False

