"""SparseCoordinator: the lifecycle hooks that join an algorithm (what to attend), the
KV manager (where the KV is) and the decode path (``sparsehi.decode``: selection, swap-in,
page tables, attention through an attention-backend adapter).

Hook names follow SGLang's sparse framework. The exact API the runtime uses is in
``docs/coordinator.md``. The coordinator is the one door from the runtime and the SGLang
plugin to the sparse state: it holds no kernels and no tables of its own; it hands each
hook to the part that owns the state (``SparseKVCacheManager`` for requests, pages and page
tables; ``SparseDecoder`` for a decode step's device part, the LRU state and counters).
"""
from __future__ import annotations

from typing import Any, Optional

import numpy as np
import torch

from sparsehi.algorithms.base import BaseSparseAlgorithm
from sparsehi.config import SparseConfig
from sparsehi.decode import DecodeState, LayerPlan, SparseDecoder, gathered_attention
from sparsehi.forward_batch import ForwardBatch
from sparsehi.kernels.table_scatter import table_scatter
from sparsehi.kv_manager import COORDINATOR_MODES, RequestKV, SparseKVCacheManager
from sparsehi.selection import SparseMode

__all__ = ["SparseCoordinator", "LayerPlan", "RequestKV", "COORDINATOR_MODES", "gathered_attention"]


class SparseCoordinator:
    """Lifecycle hooks of hierarchical (or GPU-only) sparse decoding.

    Parts (read them, drive them through the hooks): ``kv`` the KV manager (requests,
    pages, page tables), ``decoder`` the decode step's device part.
    """

    def __init__(
        self,
        config: SparseConfig,
        algorithm: BaseSparseAlgorithm,
        device_pool,
        *,
        mode: str = "hierarchical",
        host_pool=None,
        transfer=None,
        adapter=None,
        max_num_reqs: int,
        max_context_len: int,
        init_algorithm: bool = True,
        validate: bool = True,
        dense_pool_tokens: Optional[int] = None,
        host_addressing: str = "pages",
        defer_page_entries: bool = False,
    ) -> None:
        if not isinstance(algorithm, BaseSparseAlgorithm):
            raise ValueError(f"algorithm must be a BaseSparseAlgorithm, got {type(algorithm).__name__}")
        if algorithm.mode is SparseMode.TOKEN_WISE and config.page_size != 1:
            raise ValueError(f"token-wise algorithm needs SparseConfig.page_size=1, got {config.page_size}")
        self.config = config
        self.algorithm = algorithm
        self.adapter = adapter
        self.mode = mode
        self.validate = validate
        self.device_pool = device_pool
        if device_pool.spec.fp8_latent_rows and adapter is None:
            raise ValueError("adapter must be given for a device pool of FP8 latent rows (kv_cache_dtype='fp8_e4m3'): "
                             "the dsa adapter's sparse MLA decode reads them; the torch fallback cannot")
        num_layers = device_pool.spec.num_layers
        self.num_layers = num_layers
        if config.dense_layers is not None and any(x >= num_layers for x in config.dense_layers):
            raise ValueError(f"SparseConfig.dense_layers={config.dense_layers} is invalid for a {num_layers}-layer "
                             f"model: layer ids in [0, {num_layers})")
        sparse = [layer for layer in range(num_layers) if algorithm.is_sparse_layer(layer)]
        self.kv = kv = SparseKVCacheManager(
            config, device_pool, mode=mode, host_pool=host_pool, transfer=transfer, sparse_layers=sparse,
            max_num_reqs=max_num_reqs, max_context_len=max_context_len, dense_pool_tokens=dense_pool_tokens,
            validate=validate, host_addressing=host_addressing,
        )
        kv.tables.defer_entries = defer_page_entries
        self.decoder = SparseDecoder.over(kv, algorithm, adapter, validate=validate)
        if init_algorithm:
            spec = device_pool.spec
            algorithm.initialize_representation_pool(
                0, num_layers, max_num_reqs, max_context_len, kv_heads=spec.kv_heads, head_dim=spec.head_dim,
                dtype=spec.dtype,
            )

    # ------------------------------------------------------------------ read-only facts
    @property
    def host_pool(self):
        """The host pool (hierarchical), or None."""
        return self.kv.host_pool

    @property
    def transfer(self):
        """The host<->device transfer engine (hierarchical), or None."""
        return self.kv.transfer

    @property
    def dense_pool(self):
        """The dense-layers-only device pool (hierarchical with dense layers), or None."""
        return self.kv.dense_pool

    def live_rows(self) -> list[int]:
        """Rows of the requests between ``on_request_begin`` and ``on_request_end``."""
        return self.kv.requests.live_rows()

    def has_dense_rows(self, req_pool_indices) -> bool:
        """Whether any of the rows decodes densely (what ``prepare_decode`` returns; no effect)."""
        return self.kv.has_dense_rows(req_pool_indices)

    # ------------------------------------------------------------------ requests
    def on_request_begin(self, req_pool_index: int, **kwargs: Any) -> None:
        self.kv.begin_request(int(req_pool_index))
        self.decoder.reset_row(int(req_pool_index))

    def on_request_end(self, req_pool_index: int) -> RequestKV:
        kv = self.kv.end_request(int(req_pool_index))
        self.algorithm.on_request_end(int(req_pool_index))
        return kv

    # ------------------------------------------------------------------ engine-held host KV
    def adopt_prompts(self, req_pool_indices: list[int], seq_lens: list[int], token_slots: torch.Tensor,
                      host_slots: torch.Tensor) -> None:
        """``host_addressing='tokens'``: register prompts whose KV the engine holds (on the GPU
        at ``token_slots [B, max_len]``, -1 where only in host memory; in host memory at
        ``host_slots [B, max_len]``); the requests began with ``on_request_begin`` and their
        representations were built with prefill ``attention_end`` calls. See
        ``SparseKVCacheManager.adopt_prompt``."""
        self.kv.adopt_prompt(list(req_pool_indices), list(seq_lens), token_slots, host_slots)

    def record_host_tokens(self, req_pool_indices: torch.Tensor, positions: torch.Tensor,
                           host_slots: torch.Tensor) -> None:
        """``host_addressing='tokens'``: the host slot of each decode row's new token (``-1``
        rows are padding); graph-safe."""
        self.kv.tables.record_host_tokens(req_pool_indices, positions, host_slots)

    def rewrite_host_tokens(self, req_pool_index: int, start: int, end: int, host_slots: torch.Tensor) -> None:
        """``host_addressing='tokens'``: positions ``[start, end)`` of a registered request now
        live at ``host_slots [end - start]`` (the engine replaced its slots by copies of the
        same KV, e.g. a prefix another request cached first)."""
        tab = self.kv.tables.host_token_slots
        if tab is None:
            raise ValueError("rewrite_host_tokens is for host_addressing='tokens'")
        tab[req_pool_index, start:end] = host_slots
        self.kv.tables.host_pages_from_tokens(req_pool_index, start, end)

    def set_residency(self, v2p: Optional[torch.Tensor], page_size: int = 1) -> None:
        """``host_addressing='tokens'``: the engine's virtual->GPU page map over host slots
        (``v2p [pages] int32``, 0 = not on the GPU; ``page_size`` tokens a page), so misses
        still on the GPU are read from there. None: every miss reads host memory. FP8 host
        pages are always read from host: the engine stores a page's record on the compute
        stream once it is complete, so it is there before a step can miss it."""
        if not self.kv.host_tokens:
            raise ValueError("set_residency is for host_addressing='tokens'")
        self.decoder.engine_residency = None if v2p is None else (v2p, int(page_size))

    # ------------------------------------------------------------------ page-boundary entries
    def page_entry_tables(self) -> list[torch.Tensor]:
        """The device tables a decode step's page entries name (``table_scatter`` format)."""
        return self.kv.tables.entry_tables()

    def take_page_entries(self) -> Optional[np.ndarray]:
        """With ``defer_page_entries``: ``[E, 4] int64`` entries of the pages the last
        ``prepare_decode`` opened (None: none), for a caller that writes them inside its
        decode step (``write_page_entries``, e.g. from a CUDA graph's inputs); cleared."""
        return self.kv.tables.take_entries()

    def write_page_entries(self, entries: torch.Tensor) -> None:
        """Device part: write ``[E, 4] int64`` page entries (rows with table ``-1`` are
        unused) into the page tables. Graph-safe."""
        table_scatter(entries, self.page_entry_tables())

    def _check_layer(self, layer_id: int) -> None:
        if not isinstance(layer_id, int) or not 0 <= layer_id < self.num_layers:
            raise ValueError(f"layer_id={layer_id!r} is invalid: an int in [0, {self.num_layers})")

    # ------------------------------------------------------------------ forward
    def prepare_decode(self, req_pool_indices, seq_lens) -> bool:
        """Host part of a decode step, outside any CUDA graph: checks, new pages for rows
        that open a page (vectorised), step counter. ``req_pool_indices`` / ``seq_lens``:
        the live rows and their lengths with the new token (sequences of int or NumPy
        arrays). Returns ``has_dense_rows`` for the step's ``ForwardBatch``."""
        rows, lens = self.kv.check_decode(req_pool_indices, seq_lens)
        self.decoder.end_step()  # a step left open (no forward_end) still counts
        return self.kv.advance_decode(rows, lens)

    def forward_begin(self, batch: ForwardBatch) -> None:
        """Decode: place every row's new token (sets ``batch.out_cache_loc``) and open the
        step's state (``batch.decode_state``). A batch that is not ``prepared`` runs
        ``prepare_decode`` first (eager callers); a prepared one does device work only
        (CUDA-graph safe)."""
        if batch.mode != "decode":
            return
        if batch.prepared:
            has_dense = batch.has_dense_rows
        else:
            rows = [int(x) for x in batch.req_pool_indices.tolist()]
            has_dense = self.prepare_decode(rows, batch.seq_lens_cpu)
        state = self.decoder.begin_step(batch.req_pool_indices, batch.seq_lens, has_dense, self.kv.step,
                                        checked=self.validate)
        batch.out_cache_loc = state.out_loc
        batch.decode_state = state

    @staticmethod
    def _rows_cpu(batch: ForwardBatch) -> list[int]:
        """``batch.req_pool_indices`` on the host, read once per forward."""
        if batch.req_pool_indices_cpu is None:
            batch.req_pool_indices_cpu = [int(x) for x in batch.req_pool_indices.tolist()]
        return batch.req_pool_indices_cpu

    def _state(self, batch: ForwardBatch) -> DecodeState:
        if batch.decode_state is None:
            raise ValueError("decode batch has not been through forward_begin")
        return batch.decode_state

    def attention_begin(self, layer_id: int, batch: ForwardBatch, q: torch.Tensor, **algo_kw: Any) -> LayerPlan:
        """One decode layer: select, make the selection resident, build the plan."""
        self._check_layer(layer_id)
        if batch.mode != "decode":
            raise ValueError("attention_begin is a decode hook: batch.mode must be 'decode' (prefill attends densely)")
        return self.decoder.plan_layer(layer_id, self._state(batch), q, batch.req_pool_indices, algo_kw)

    def attention_end(self, layer_id: int, batch: ForwardBatch, k: Optional[torch.Tensor] = None,
                      v: Optional[torch.Tensor] = None, **algo_kw: Any) -> None:
        """Prefill: build representations. Decode: back the new token up to host
        (hierarchical), then fold it into the representations."""
        self._check_layer(layer_id)
        if batch.mode == "prefill":
            if self.algorithm.is_sparse_layer(layer_id):
                starts = self.kv.chunk_starts(self._rows_cpu(batch)) if self.kv.has_chunked_rows() else None
                if starts is not None:
                    if not self.algorithm.supports_chunked_prefill:
                        raise ValueError(f"{type(self.algorithm).__name__} does not build representations chunk by "
                                         "chunk (supports_chunked_prefill is False): prefill its prompts whole")
                    algo_kw = {**algo_kw, "represented_lens": torch.tensor(starts, dtype=torch.int32)}
                self.algorithm.construct_representations(
                    layer_id, batch.req_pool_indices, batch.seq_lens, self.device_pool.get_key_buffer(layer_id),
                    batch.token_slots, **algo_kw,
                )
            return
        state = self._state(batch)
        if k is None:
            raise ValueError("decode attention_end needs k (the new token's key, [B, Hkv, D])")
        self.decoder.finish_layer(layer_id, state, k, v, batch.req_pool_indices, batch.positions, algo_kw)

    def forward_end(self, batch: ForwardBatch, host_slots: Optional[list[torch.Tensor]] = None,
                    free_device_kv: bool = True, more_chunks: Optional[list[bool]] = None) -> None:
        """Prefill: offload / set up buffers (see docs); ``more_chunks[b]``: row ``b``'s
        prompt goes on in a later prefill chunk (chunked prefill). Decode: close the
        step's counters."""
        if batch.mode == "prefill":
            self.kv.finish_prefill(self._rows_cpu(batch), batch.seq_lens_cpu, batch.prefix_lens_cpu, batch.token_slots,
                                   host_slots=host_slots, free_device_kv=free_device_kv, more_chunks=more_chunks)
            return
        if more_chunks is not None:
            raise ValueError("more_chunks is for prefill batches")
        self._state(batch)
        self.decoder.end_step()
        batch.decode_state = None

    # ------------------------------------------------------------------ counters
    def stats(self) -> dict:
        return self.decoder.stats()

    def reset_stats(self) -> None:
        self.decoder.reset_stats()

    def buffer_fill(self, req_pool_indices: torch.Tensor) -> float:
        """Share of occupied slots in the least-filled LRU buffer of these requests (every
        sparse layer); 1.0 without LRU buffers. Syncs with the device."""
        lru = self.decoder.lru
        return 1.0 if lru is None else lru.fill(req_pool_indices)
