"""The device part of a sparse decode step, layer by layer (see docs/coordinator.md).

Once per step ``begin_step`` derives the step's write locations and the sparse layers'
candidate tables (one launch). Then, per sparse layer (``plan_layer``):

1. **select**: the algorithm's Top-k among the candidates (``retrieve_topk``), checked on
   eager checked steps and put in ascending order when the algorithm does not promise it;
2. **swap_in**: hierarchical only, the LRU diff (one launch) makes the selection resident
   in the layer's GPU buffer and yields the misses to load from host;
3. **build_table**: the misses' copy and the selection table (sink + selected + recent
   ids, their device pages, the attention backend's page table) in one launch;
4. **attend**: the returned :class:`LayerPlan` writes the new token and runs the adapter
   (or the torch fallback ``gathered_attention``);
5. **backup / update** (``finish_layer``): the new token to host, then the algorithm's
   representations.

``end_step`` folds the step's hit / miss counts. Everything here is CUDA-graph safe: fixed
shapes, no host sync, no allocation outside the graph's pool, unless the step is
``checked`` (eager, validation on), which adds host-side value checks.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from hicache.kernels.kv_copy import word_rows
from hicache.triton_support import INT32_MAX
from sparsehi.algorithms.base import check_selection
from sparsehi.config import SparseConfig
from sparsehi.decode.load_ahead import LoadAhead
from sparsehi.decode.state import CandidateTables, DecodeState
from sparsehi.fp8_pages import round_pages
from sparsehi.kernels.dense_pages import DensePages, dense_pages
from sparsehi.kernels.lru_diff import LruDiffResult, check_lru_diff_values, lru_diff
from sparsehi.kernels.selection_table import SelectionTable, selection_table
from sparsehi.kernels.step_setup import step_setup
from sparsehi.kernels.store_kv import store_kv
from sparsehi.kernels.swap_in_copy import swap_in_copy
from sparsehi.kernels.swap_in_fp8 import swap_in_fp8_copy
from sparsehi.kernels.swap_in_fp8_fused import swap_in_fp8_copy_and_table
from sparsehi.kernels.swap_in_fused import swap_in_copy_and_table
from sparsehi.lru_buffer import LruState
from sparsehi.page_tables import BufferSizes, PageTables
from sparsehi.row_choice import RowChoice
from sparsehi.selection import SparseMode, SparseSelection
from sparsehi.swap_in_stats import StepCounts, SwapInCounters

__all__ = ["SparseDecoder", "LayerPlan", "gathered_attention"]

def _capturing() -> bool:
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


def _pad_cols(x: torch.Tensor, width: int) -> torch.Tensor:
    """``x [B, N]`` padded with -1 columns to ``[B, width]``."""
    if x.shape[1] == width:
        return x
    return torch.nn.functional.pad(x, (0, width - x.shape[1]), value=-1)


def gathered_attention(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, selection: SparseSelection,
                       sm_scale: float) -> torch.Tensor:
    """Torch decode attention over the selected pages (fallback while no adapter is given;
    also the reference adapters are tested against).

    q: ``[B, Hq, D]``; k_buffer ``[slots, Hkv, D]``; v_buffer ``[slots, Hkv, Dv]``.
    Returns ``[B, Hq, Dv]`` in q's dtype; softmax in float32.
    """
    ps = selection.page_size
    b, hq, d = q.shape
    hkv = k_buffer.shape[1]
    if hq % hkv:
        raise ValueError(f"q heads Hq={hq} must be a multiple of the cache's kv heads {hkv}")
    off = torch.arange(ps, device=q.device)
    phys = selection.physical_ids.long().to(q.device)
    logical = selection.logical_ids.long().to(q.device)
    slots = (phys.clamp(min=0)[..., None] * ps + off).reshape(b, -1)
    pos = (logical[..., None] * ps + off).reshape(b, -1)
    ok = ((phys >= 0)[..., None].expand(-1, -1, ps).reshape(b, -1)) & (pos < selection.seq_lens.long().to(q.device)[:, None])
    keys = k_buffer[slots].float()  # [B, T, Hkv, D]
    vals = v_buffer[slots].float()
    qg = q.float().view(b, hkv, hq // hkv, d)
    logits = torch.einsum("bgrd,btgd->bgrt", qg, keys) * sm_scale
    logits = logits.masked_fill(~ok[:, None, None, :], float("-inf"))
    p = torch.softmax(logits, dim=-1)
    p = torch.nan_to_num(p, nan=0.0)  # rows with nothing selected (padding rows)
    o = torch.einsum("bgrt,btgd->bgrd", p, vals)
    return o.reshape(b, hq, -1).to(q.dtype)


@dataclass
class LayerPlan:
    """What one decode layer writes and attends (see docs/coordinator.md)."""

    layer_id: int
    layer_cache: tuple[torch.Tensor, ...]
    k_buffer: torch.Tensor
    v_buffer: torch.Tensor
    out_cache_loc: torch.Tensor
    selection: SparseSelection
    metadata: Any
    is_sparse: bool
    adapter: Any = None

    def write_kv(self, k: torch.Tensor, v: Optional[torch.Tensor] = None) -> None:
        """Write the new token: MHA ``k, v [B, Hkv, D]``; MLA ``k [B, 1, C]`` (v None).
        No host sync (graph-safe)."""
        bufs = self.layer_cache
        if len(bufs) == 2 and v is None:
            raise ValueError("v is required for an MHA cache (layer_cache holds k and v)")
        if len(bufs) == 1 and v is not None:
            raise ValueError("v must be None for an MLA cache (pass the whole latent kv as k)")
        vals = (k, v)[: len(bufs)]
        for buf, t, name in zip(bufs, vals, ("k", "v")):
            if t.shape[0] != self.out_cache_loc.shape[0] or tuple(t.shape[1:]) != tuple(buf.shape[1:]):
                raise ValueError(f"{name} must be [B={self.out_cache_loc.shape[0]}, {', '.join(map(str, buf.shape[1:]))}], got {tuple(t.shape)}")
        store_kv(bufs, self.out_cache_loc, vals)  # k and v in one launch

    def attend(self, q: torch.Tensor, sm_scale: float) -> torch.Tensor:
        """``[B, Hq, Dv]`` decode attention over the selection."""
        if self.adapter is not None:
            return self.adapter.forward_decode(q, self.layer_cache, self.metadata, sm_scale=sm_scale)
        return gathered_attention(q, self.k_buffer, self.v_buffer, self.selection, sm_scale)


class SparseDecoder:
    """The decode path of every layer (see the module docstring). Owns the LRU buffers'
    state and the hit / miss counters; reads the page tables and pools it is given.

    ``hierarchical=False`` (gpu_only): selections map to the request's own pages; no diff,
    no loads, no backups. ``host_pool`` and ``transfer`` are for the hierarchical mode.
    ``algorithm`` may be None for callers that drive ``swap_in`` themselves (tests,
    benchmarks) rather than ``plan_layer``.
    """

    STATS_HISTORY = 4096
    """Closed steps kept individually for ``stats()["per_step"]``; totals cover every step."""

    def __init__(self, config: SparseConfig, algorithm, adapter, *, sizes: BufferSizes, tables: PageTables,
                 device_pool, dense_pool, host_pool, transfer, sparse_layers: tuple[int, ...],
                 step_counter: torch.Tensor, hierarchical: bool, host_tokens: bool, max_num_reqs: int,
                 validate: bool) -> None:
        self.config = config
        self.algorithm = algorithm
        self.adapter = adapter
        self.sizes = sizes
        self.tables = tables
        self.device_pool = device_pool
        self.transfer = transfer
        self.hierarchical = hierarchical
        self.host_tokens = host_tokens
        self.max_num_reqs = max_num_reqs
        self.validate = validate
        self.step_counter = step_counter
        """``[1] int32`` the host part's step number on the device (the LRU diff's clock)."""
        self.device = device = device_pool.device
        self.sparse_layers = sparse_layers
        num_layers = device_pool.spec.num_layers
        self.dense_layers = tuple(x for x in range(num_layers) if x not in sparse_layers)
        self.sparse_index = {layer: i for i, layer in enumerate(sparse_layers)}
        """Sparse layer id -> its plane in the LRU state and the step's counts."""
        self.selection_mode = SparseMode.TOKEN_WISE if sizes.page_size == 1 else SparseMode.PAGE_WISE
        self.fp8 = config.host_kv_dtype == "fp8_e4m3"
        """FP8 host KV: complete pages are quantised to host (hierarchical) or rounded in
        place (gpu_only; token addressing: the engine stores them) after their last token's
        layer (``fp8_pages``); misses load through the dequantising copy that also builds
        the selection table (``swap_in_fp8_fused``, by ``tables.host_pages``)."""
        self._dense_pool = dense_pool
        self.engine_residency: Optional[tuple[torch.Tensor, int]] = None
        """``(v2p, page_size)``: host slots whose KV the engine still holds on the GPU
        (``host_addressing='tokens'``); the swap-in reads those from GPU memory."""
        # per layer: the pool it attends (hierarchical dense layers: the dense-layer pool)
        # and its index there
        self._layer_pool = {}
        for layer in range(num_layers):
            own_pool = hierarchical and dense_pool is not None and layer in self.dense_layers
            pool, li = (dense_pool, self.dense_layers.index(layer)) if own_pool else (device_pool, layer)
            self._layer_pool[layer] = (pool.layer_buffers(li), pool.get_key_buffer(li), pool.get_value_buffer(li),
                                       own_pool)
        self._columns = torch.arange(sizes.top_k, dtype=torch.int32, device=device)[None, :]
        self._offsets = torch.arange(sizes.page_size, dtype=torch.int64, device=device)
        self._page_bytes = device_pool.spec.page_bytes_per_layer
        """Bytes a missed page of one layer moves from host (``stats()["bytes_loaded"]``)."""
        self._diff_step: dict[int, int] = {}  # sparse layer -> step of its last checked LRU diff
        self._open: Optional[DecodeState] = None
        self.lru: Optional[LruState] = None
        if hierarchical:
            self.lru = LruState.empty(len(sparse_layers), max_num_reqs, sizes.lru_slots, sizes.max_pages, device)
            self._lru_planes = [self.lru.layer(i) for i in range(len(sparse_layers))]
            self._host_view = None if self.fp8 else host_pool.paged_view()
            self._host_fp8 = (host_pool.fp8_values, host_pool.fp8_scales) if self.fp8 else None
            if self.fp8:  # a miss moves one layer of an FP8 page record: its values and scales
                self._page_bytes = sum(t[0, 0].numel() * t.element_size() for t in self._host_fp8)
            self._dev_view = device_pool.paged_view()
            # the copy kernels' programs per row and program slot: heads (FP8), or buffers x
            # row segments (one segment may span every head)
            self._copy_units_per_row = (device_pool.spec.kv_heads if self.fp8 else
                                        device_pool.spec.num_buffers * word_rows(self._host_view, self._dev_view).nseg)
            # the swap-in's own copy kernel reads pinned host memory from the GPU (the
            # ``kernel`` io backend; FP8 pages always, through their dequantising form);
            # ``direct`` on CUDA keeps the engine's path
            self._fused_copy = (self.fp8 or device.type != "cuda"
                                or getattr(transfer, "io_backend", "kernel") == "kernel")
            if host_tokens and not self._fused_copy:
                raise ValueError("host_addressing='tokens' needs io_backend='kernel' (the swap-in's own copy kernel)")
        self.load_ahead: Optional[LoadAhead] = (self._load_ahead_of(config, max_num_reqs)
                                                 if hierarchical and config.lookahead_units and sparse_layers else None)
        """Hierarchical with ``SparseConfig.lookahead_tokens``: the pages ranked after each
        layer's selection, loaded on a side stream for the next step (load_ahead.py)."""
        self.reset_stats()

    def _load_ahead_of(self, config: SparseConfig, max_num_reqs: int) -> LoadAhead:
        # SparseConfig checks that top_k + lookahead_tokens fit the buffer; the io backend
        # here is the transfer engine's, which the config does not see
        if not self._fused_copy:
            raise ValueError("lookahead_tokens > 0 needs io_backend='kernel' (pages are loaded ahead by the "
                             "swap-in's own copy kernel)")
        return LoadAhead(config.lookahead_units, len(self.sparse_layers), max_num_reqs, self.sizes.max_pages,
                         self.device, self._copy_misses)

    @classmethod
    def over(cls, kv, algorithm=None, adapter=None, validate: Optional[bool] = None) -> "SparseDecoder":
        """The decode path over a ``SparseKVCacheManager``'s pools, page tables and step
        counter (what ``SparseCoordinator`` wires)."""
        return cls(kv.config, algorithm, adapter, sizes=kv.sizes, tables=kv.tables, device_pool=kv.device_pool,
                   dense_pool=kv.dense_pool, host_pool=kv.host_pool, transfer=kv.transfer,
                   sparse_layers=kv.sparse_layers, step_counter=kv.step_counter, hierarchical=kv.hierarchical,
                   host_tokens=kv.host_tokens, max_num_reqs=kv.max_num_reqs,
                   validate=kv.validate if validate is None else validate)

    def reset_row(self, row: int) -> None:
        """A new request in ``row``: its LRU buffers are empty in every layer."""
        if self.load_ahead is not None:
            self.load_ahead.join()  # a step left open may still load into this row
        if self.lru is not None:
            rows = torch.tensor([row], device=self.device)
            self.lru.reset_rows(rows)
            if self.load_ahead is not None:
                self.load_ahead.reset_rows(rows)

    # ------------------------------------------------------------------ step
    def begin_step(self, rows: torch.Tensor, seq_lens: torch.Tensor, has_dense_rows: bool, step: int,
                   checked: Optional[bool] = None) -> DecodeState:
        """The step's tables from ``rows [B] int64`` (``-1`` padding) and ``seq_lens [B]
        int32`` (new token included) after the host part ran for the live rows; ``step``
        its host step number. One launch."""
        if self.load_ahead is not None:
            self.load_ahead.join()  # the previous step's loads ahead, if it was left open
        dev = self.device
        z = self.sizes
        rows = rows.to(dev, torch.int64)
        seq = seq_lens.to(dev, torch.int32)
        n_sparse, B = len(self.sparse_layers), int(rows.shape[0])
        counts = StepCounts.uninitialized(n_sparse, B, dev)
        t = self.tables
        hier = dict(sink_table=t.sink_pages, ring_table=t.ring_pages, host_page_table=t.host_pages,
                    dense_pool_table=t.dense_pool_pages) if self.hierarchical else {}
        s = step_setup(rows, seq, t.context_pages, page_size=z.page_size, top_k=z.top_k, sink=z.sink,
                       recent=z.recent, dense_rows_t=t.dense_rows if has_dense_rows else None,
                       zero_cols=counts.table.view(StepCounts.CHANNELS * n_sparse, B) if n_sparse else None, **hier)
        cand = CandidateTables(candidate_start=s.cs, candidate_end=s.ce, num_candidates=s.ncand,
                               all_candidates=s.all_ids, sparse_rows=s.sparse_mask, uses_selection=s.use,
                               columns=self._columns)
        state = DecodeState(rows=rows, safe_rows=s.safe_rows, live=s.live, seq_lens=seq, num_pages=s.num_pages,
                            out_loc=s.out_loc, candidates=cand, counts=counts, dense_loc=s.dense_loc,
                            host_loc=s.host_loc, dense_rows=s.dense_rows, step=step,
                            checked=(self.validate if checked is None else checked) and not _capturing())
        self._open = state
        return state

    def end_step(self) -> None:
        """Close the open step: fold its per-layer hits / misses (no host sync)."""
        state, self._open = self._open, None
        if self.load_ahead is not None:
            self.load_ahead.join()  # the side stream's counts and buffer slots are the step's
        if state is not None:
            self.counters.close_step(state.counts, self.step_counter, state.live)

    # ------------------------------------------------------------------ one layer
    def layer_cache(self, layer: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor, torch.Tensor]:
        """``(buffers, key_buffer, value_buffer)`` the plan of ``layer`` attends over."""
        return self._layer_pool[layer][:3]

    def write_loc(self, layer: int, state: DecodeState) -> torch.Tensor:
        """``[B] int64`` slot in ``layer_cache(layer)`` where the new token goes."""
        return state.dense_loc if self._layer_pool[layer][3] else state.out_loc

    def plan_layer(self, layer: int, state: DecodeState, q: torch.Tensor, req_pool_indices: torch.Tensor,
                   algo_kw: dict) -> LayerPlan:
        """One decode layer: select, make the selection resident, build the plan."""
        bufs, kbuf, vbuf, _ = self._layer_pool[layer]
        if layer in self.sparse_index:
            topk, valid, choice, lookahead = self.select(layer, state, q, req_pool_indices, algo_kw)
            table = self.build_table(layer, state, topk, valid, choice)
            if lookahead is not None:
                li = self.sparse_index[layer]
                out = state.lru_out[li]
                self.load_ahead.launch(li, layer, state, self._lru_planes[li], self.step_counter, topk, valid,
                                       LruDiffResult(out[0], out[1], out[2], state.counts.loads[li]), lookahead)
            selection = self._with_dense_rows(layer, state, table)
            meta = self.adapter.build_metadata(selection) if self.adapter is not None else None
            sparse = True
        else:
            if state.dense_layer_selection is None:  # shared by the dense layers
                state.dense_layer_selection = self._all_pages(layer, state, with_table=True)
                state.dense_layer_metadata = (self.adapter.build_metadata(state.dense_layer_selection)
                                              if self.adapter is not None else None)
            selection, meta, sparse = state.dense_layer_selection, state.dense_layer_metadata, False
        return LayerPlan(layer, bufs, kbuf, vbuf, self.write_loc(layer, state), selection, meta, sparse, self.adapter)

    def select(self, layer: int, state: DecodeState, q: torch.Tensor, req_pool_indices: torch.Tensor,
               algo_kw: dict) -> tuple[torch.Tensor, torch.Tensor, Optional[RowChoice], Optional[Any]]:
        """The algorithm's Top-k: ``(topk [B, K] int32, valid [B] int32, choice, lookahead)``.
        With ``choice`` set, rows that do not use the selection (``uses_selection`` False)
        take their plain candidate list, read per row by the kernels that come next; with
        ``choice`` None, ``topk`` is already that substituted selection, ascending.
        ``lookahead`` (loading ahead on, else None): returns the Top-(K + lookahead) set."""
        K = self.sizes.top_k
        dev = state.rows.device
        B = int(state.rows.shape[0])
        c = state.candidates
        # retrieve_topk runs for every batch (no host-side "is any row sparse"): rows that
        # are not sparse take their plain candidate list below
        kw = dict(seq_lens=state.seq_lens, candidate_start=c.candidate_start, candidate_end=c.candidate_end, top_k=K,
                  **algo_kw)
        lookahead = None
        if self.load_ahead is None:
            sel, val = self.algorithm.retrieve_topk(q, layer, req_pool_indices, c.sparse_rows, **kw)
        else:
            sel, val, lookahead = self.algorithm.retrieve_topk_and_lookahead(
                q, layer, req_pool_indices, c.sparse_rows, lookahead_top_k=K + self.load_ahead.lookahead, **kw)
        name = type(self.algorithm).__name__
        if not isinstance(sel, torch.Tensor) or not isinstance(val, torch.Tensor):
            raise ValueError(f"retrieve_topk of {name} must return two torch.Tensors (selected_indices [B, top_k] "
                             f"int32, valid_lengths [B] int32), got {type(sel).__name__}, {type(val).__name__}")
        if state.checked:
            check_selection(sel, val, K, c.candidate_start, c.candidate_end)
        if sel.shape[1] < K:
            sel = torch.cat([sel, torch.full((B, K - sel.shape[1]), -1, dtype=torch.int32, device=dev)], 1)
        sel = sel.to(device=dev, dtype=torch.int32).contiguous()
        val = val.to(device=dev, dtype=torch.int32)
        if sel.shape != (B, K) or val.shape != (B,):
            raise ValueError(f"retrieve_topk of {name} must return selected_indices [B={B}, top_k<={K}] and "
                             f"valid_lengths [B={B}], got {tuple(sel.shape)} and {tuple(val.shape)}")
        # Rows that are not sparse (padding rows among them: they select nothing, whatever the
        # algorithm said) take their plain candidate list. The kernels that read the selection
        # next make that choice per row themselves: no substitution launch.
        choice: Optional[RowChoice] = RowChoice(c.uses_selection, c.all_candidates, c.num_candidates)
        topk, valid = sel, val
        if state.checked or not self.algorithm.selects_ascending:
            # the substituted selection itself, for the value checks or the sort
            topk, valid = choice.apply(sel, val)
        if state.checked and bool((valid.long() > K).any()):
            raise ValueError(f"more than top_k={K} ids selected in a row")
        if not self.algorithm.selects_ascending:
            # ascending ids, -1 padding last: the selection table needs that order (the
            # valid ids of a row are distinct, so the order is unique)
            key = torch.where(c.columns < valid[:, None], topk, INT32_MAX)
            key = torch.sort(key, dim=1).values
            topk = key.masked_fill_(key == INT32_MAX, -1).contiguous()
            choice = None
        self.check_topk(state, topk, valid, c.candidate_end)
        if choice is not None:  # the kernels read the algorithm's selection and choose per row
            topk, valid = sel, val
        return topk, valid, choice, lookahead

    def check_topk(self, state: DecodeState, topk: torch.Tensor, valid: torch.Tensor,
                   candidate_end: Optional[torch.Tensor] = None) -> None:
        """Shape check, and value checks (host reads) when the step is ``checked``: ``valid``
        ids then -1, ids below ``candidate_end`` (default: the pages in context), no
        duplicates, distinct live rows. Raises ValueError before any state moves."""
        if topk.shape[1] > self.sizes.lru_slots:
            raise ValueError(f"topk width K={topk.shape[1]} exceeds buffer slots S={self.sizes.lru_slots}: "
                             f"K must be <= S")
        if state.checked:
            lim = candidate_end if candidate_end is not None else state.num_pages
            check_lru_diff_values(topk, valid, lim.to(topk.device), rows=state.rows if self.hierarchical else None,
                                  num_rows=self.max_num_reqs)

    def build_table(self, layer: int, state: DecodeState, topk: torch.Tensor, valid: torch.Tensor,
                    choice: Optional[RowChoice] = None) -> SelectionTable:
        """The layer's selection table (sink pages, the selection's pages, recent pages: what
        attention reads). Hierarchical: after the LRU diff, the copy of the misses and the
        table in one launch. gpu_only: over the request's own pages."""
        z, t = self.sizes, self.tables
        if not self.hierarchical:
            return selection_table(topk, valid, state.num_pages, state.seq_lens, state.safe_rows, sink=z.sink,
                                   recent=z.recent, page_size=z.page_size, own_table=t.context_pages, choice=choice)
        if not self._fused_copy:
            slots = self.swap_in(layer, state, topk, valid, choice)
            return selection_table(topk, valid, state.num_pages, state.seq_lens, state.safe_rows, sink=z.sink,
                                   recent=z.recent, page_size=z.page_size, sink_table=t.sink_pages,
                                   ring_table=t.ring_pages, topk_phys=slots, slot_table=t.lru_pages, choice=choice)
        r = self._lru_diff(layer, state, topk, valid, choice)
        if self.fp8:
            return swap_in_fp8_copy_and_table(*self._host_fp8, self._dev_view, layer, r.load_ids, r.load_slots,
                                              r.num_loads, state.rows, t.host_pages, t.lru_pages, topk, valid,
                                              state.num_pages, state.seq_lens, state.safe_rows, sink=z.sink,
                                              recent=z.recent, sink_table=t.sink_pages, ring_table=t.ring_pages,
                                              device_slots=r.device_slots, choice=choice)
        return swap_in_copy_and_table(self._host_view, self._dev_view, layer, r.load_ids, r.load_slots, r.num_loads,
                                      state.rows, t.host_pages, t.lru_pages, z.page_size, topk, valid,
                                      state.num_pages, state.seq_lens, state.safe_rows, sink=z.sink, recent=z.recent,
                                      sink_table=t.sink_pages, ring_table=t.ring_pages, device_slots=r.device_slots,
                                      choice=choice, **self._host_addressing())

    def _with_dense_rows(self, layer: int, state: DecodeState, tab: SelectionTable) -> SparseSelection:
        """The sparse layer's selection; dense rows attend all their pages (one table, as
        wide as the wider of the two)."""
        ps = self.sizes.page_size
        if state.dense_rows is None:
            return SparseSelection(tab.logical, tab.physical, tab.num_valid, state.seq_lens, ps, self.selection_mode,
                                   page_table=tab.page_table, attended=tab.attended)
        if state.dense_row_selection is None:
            state.dense_row_selection = self._all_pages(layer, state, with_table=False)
        d = state.dense_row_selection
        w = max(tab.logical.shape[1], d.logical_ids.shape[1])
        dr = state.dense_rows[:, None]
        logical = torch.where(dr, _pad_cols(d.logical_ids, w), _pad_cols(tab.logical, w))
        phys = torch.where(dr, _pad_cols(d.physical_ids, w), _pad_cols(tab.physical, w))
        num_valid = torch.where(state.dense_rows, d.num_valid, tab.num_valid)
        return SparseSelection(logical, phys, num_valid, state.seq_lens, ps, self.selection_mode)

    def _all_pages(self, layer: int, state: DecodeState, with_table: bool) -> SparseSelection:
        """Every page of every row (``[B, M]``, one launch) from the table that holds a
        request's whole context: dense layers (hierarchical: the dense-layer pool) and the
        sparse layers' dense rows (the main pool). ``with_table``: with the attention
        backend's page table (the sparse layers' dense rows merge into their own table)."""
        d = self.all_pages(layer, state, with_table)
        return SparseSelection(d.logical, d.physical, state.num_pages, state.seq_lens, self.sizes.page_size,
                               self.selection_mode, page_table=d.page_table, attended=d.attended)

    def all_pages(self, layer: int, state: DecodeState, with_table: bool = False) -> DensePages:
        """``logical [B, M] int32`` (``c`` for ``c < num_pages``, else -1) and its
        ``physical`` pages; ``with_table``: also an attention backend's ``page_table`` and
        ``attended`` tokens (sparsehi/kernels/step_setup.py)."""
        table = self.tables.dense_pool_pages if self._layer_pool[layer][3] else self.tables.context_pages
        if with_table:
            return dense_pages(state.num_pages, state.safe_rows, table, state.seq_lens, self.sizes.page_size)
        return dense_pages(state.num_pages, state.safe_rows, table)

    # ------------------------------------------------------------------ swap-in
    def swap_in(self, layer: int, state: DecodeState, topk: torch.Tensor, valid: torch.Tensor,
                choice: Optional[RowChoice] = None) -> torch.Tensor:
        """Hierarchical sparse layer: make ``topk [B, K] int32`` (-1 padded, ``valid [B]``)
        resident in the layer's LRU buffer — the LRU diff (one launch) and the host->device
        copy of the misses straight from its output (one launch) — and return each id's
        buffer slot ``[B, K] int32`` (-1 padded; its page is ``lru_pages[row, slot]``).
        ``choice``: rows that do not use ``topk`` take ``choice.ids`` (row_choice.py).
        Value checks are the caller's (``check_topk``)."""
        r = self._lru_diff(layer, state, topk, valid, choice)
        if self._fused_copy:
            self._copy_misses(layer, state, r)
        else:  # io_backend "direct" on CUDA: the engine's host-side path (not graph-capturable)
            self._load_through_engine(layer, state, r)
        return r.device_slots

    def _copy_misses(self, layer: int, state: DecodeState, r: LruDiffResult, programs: Optional[int] = None) -> None:
        """The copy kernel of a diff's loads, host pages into their buffer slots of ``layer``
        (FP8 host KV: dequantised on the way). ``programs``: about this many programs in all,
        each looping over misses (at least one per row and head or row segment), for a copy
        beside other work; None: one program per miss and head or block."""
        programs_per_row = None
        if programs is not None:
            programs_per_row = max(1, programs // (max(1, int(state.rows.shape[0])) * self._copy_units_per_row))
        if self.fp8:
            swap_in_fp8_copy(*self._host_fp8, self._dev_view, layer, r.load_ids, r.load_slots, r.num_loads, state.rows,
                             self.tables.host_pages, self.tables.lru_pages, programs_per_row)
            return
        swap_in_copy(self._host_view, self._dev_view, layer, r.load_ids, r.load_slots, r.num_loads, state.rows,
                     self.tables.host_pages, self.tables.lru_pages, self.sizes.page_size,
                     programs_per_row=programs_per_row, **self._host_addressing())

    def selected_pages(self, layer: int, state: DecodeState, topk: torch.Tensor, valid: torch.Tensor,
                       candidate_end: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Device pages ``[B, K] int32`` of the top-k ids of a sparse layer (-1 padded):
        checked, then (hierarchical) swapped in. ``topk`` ``[B, K] int32`` -1 padded;
        padding rows must have ``valid == 0``."""
        self.check_topk(state, topk, valid, candidate_end)
        if not self.hierarchical:
            lid = topk.long().clamp(min=0)
            phys = self.tables.context_pages[state.safe_rows[:, None], lid]
            return torch.where(topk >= 0, phys, -1).to(torch.int32)
        slots = self.swap_in(layer, state, topk, valid).long()
        pages = self.tables.lru_pages.long()[state.safe_rows[:, None], slots.clamp(min=0)]
        return torch.where(slots >= 0, pages, -1).to(torch.int32)

    def _host_addressing(self) -> dict:
        """The copy kernels' host addressing: per page (none), or per token from the token
        table, with the engine's GPU residency (misses still on the GPU read from there)."""
        if not self.host_tokens:
            return {}
        return {"host_tokens": self.tables.host_token_slots[: self.max_num_reqs], "resident": self.engine_residency}

    def _lru_diff(self, layer: int, state: DecodeState, topk: torch.Tensor, valid: torch.Tensor,
                  choice: Optional[RowChoice] = None) -> LruDiffResult:
        """The layer's LRU diff for this step (outputs in the step's shared buffers)."""
        li = self.sparse_index.get(layer)
        if li is None:
            raise ValueError(f"layer_id={layer} is not a sparse layer (sparse layers: {self.sparse_layers})")
        if state.checked:
            if self._diff_step.get(layer) == state.step:
                # A second diff with the same step would see its own hits as "used this step"
                # and corrupt the LRU state (and read stale load slots).
                raise ValueError(f"layer_id={layer} already ran its LRU diff in decode step {state.step}: each sparse "
                                 f"layer runs once per step (prepare_decode starts the next step)")
            self._diff_step[layer] = state.step
        res, lu, so = self._lru_planes[li]  # (resident, last_used, slot_of) of the layer
        B, K = topk.shape
        out = state.lru_out
        if self.load_ahead is not None:
            # one plane per layer: the side stream reads a layer's diff after the next one ran
            if out is None or out.shape != (len(self.sparse_layers), 3, B, K):
                out = state.lru_out = torch.empty(len(self.sparse_layers), 3, B, K, dtype=torch.int32,
                                                  device=topk.device)
            out = out[li]
        elif out is None or out.shape[1:] != (B, K):
            out = state.lru_out = torch.empty(3, B, K, dtype=torch.int32, device=topk.device)
        counts = state.counts
        return lru_diff(topk, valid, res, lu, so, self.step_counter, rows=state.rows,
                        out=LruDiffResult(out[0], out[1], out[2], counts.loads[li], counts.valid[li]), choice=choice)

    def _load_through_engine(self, layer: int, state: DecodeState, r: LruDiffResult) -> None:
        rows = state.safe_rows[:, None]
        ok = r.load_ids >= 0
        hp = torch.where(ok, self.tables.host_pages[rows, r.load_ids.long().clamp(min=0)], -1)
        dp = torch.where(ok, self.tables.lru_pages.long()[rows, r.load_slots.long().clamp(min=0)], -1)
        slots = torch.stack([hp, dp])[..., None] * self.sizes.page_size + self._offsets
        slots = torch.where(torch.stack([ok, ok])[..., None], slots, -1).view(2, -1)
        self.transfer.load_layer_now(layer, slots[0], slots[1])

    # ------------------------------------------------------------------ after attention
    def finish_layer(self, layer: int, state: DecodeState, k: torch.Tensor, v: Optional[torch.Tensor],
                     req_pool_indices: torch.Tensor, positions: torch.Tensor, algo_kw: dict) -> None:
        """Back the new token up to host, then fold it into the algorithm's representations
        (sparse layers): a backup that raises leaves the representations unchanged."""
        self.backup_token(layer, state, k, v)
        if layer in self.sparse_index:
            self.algorithm.update_representations(layer, req_pool_indices, positions, k, **algo_kw)

    def backup_token(self, layer: int, state: DecodeState, k: torch.Tensor, v: Optional[torch.Tensor]) -> None:
        """Hierarchical: copy the new token of ``layer`` to its host slot (per layer, so the
        page is complete on host before it leaves the recent window). FP8 host KV: the pages
        this token completes instead (``fp8_pages``). Graph-safe."""
        if self.fp8:
            self._store_completed_pages(layer, state)
            return
        if not self.hierarchical or self.host_tokens:  # token addressing: the engine writes its host copy
            return
        if self._layer_pool[layer][3]:
            # The model wrote it into the dense-layer pool, which the transfer engine does not
            # address: the engine backs it up from k / v themselves (one launch for both).
            self.transfer.backup_tokens_from(layer, state.host_loc, *(k, v)[: self.device_pool.spec.num_buffers])
            return
        self.transfer.backup_layer_now(layer, state.out_loc, state.host_loc)

    def _store_completed_pages(self, layer: int, state: DecodeState) -> None:
        """FP8 host KV: the pages whose last token this step wrote, of ``layer``, to their
        host pages (hierarchical, page addressing) or rounded in place (gpu_only, token
        addressing)."""
        own_pool = self._layer_pool[layer][3]
        if self.hierarchical and not self.host_tokens:
            if state.completed_pages is None:  # once per step: the same pages in every layer
                host_pages, main_pages = self.transfer.completed_pages(state.out_loc, state.host_loc)
                dense_pages = (None if state.dense_loc is None
                               else self.transfer.completed_pages(state.dense_loc, state.host_loc)[1])
                state.completed_pages = (host_pages, main_pages, dense_pages)
            host_pages, main_pages, dense_pages = state.completed_pages
            if own_pool:
                self.transfer.store_pages_now(layer, dense_pages, host_pages, pool=self._dense_pool,
                                              pool_layer=self.dense_layers.index(layer))
            else:
                self.transfer.store_pages_now(layer, main_pages, host_pages)
            return
        ps = self.sizes.page_size
        complete = state.live & (state.seq_lens % ps == 0)
        pool, li, loc = ((self._dense_pool, self.dense_layers.index(layer), state.dense_loc) if own_pool
                         else (self.device_pool, layer, state.out_loc))
        round_pages(pool.paged_view()[:, :, li:li + 1], loc // ps, ps, complete)

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

    def stats(self) -> dict:
        """Counters (syncs with the device): totals and per-layer hit rates over every
        closed decode step since ``reset_stats``; ``per_step`` holds the last
        ``STATS_HISTORY`` steps only; with loading ahead, its counters too
        (``SwapInCounters.report``)."""
        return self.counters.report(self._page_bytes, with_ahead=self.load_ahead is not None)
