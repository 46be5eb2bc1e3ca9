"""SparseCoordinator: the lifecycle hooks that join an algorithm (what to attend), the
KV manager (where the KV is) and a backend adaptor (how attention reads it).

Hook names follow SGLang's sparse framework. The exact API the runtime uses is in
``docs/coordinator.md``. The coordinator holds no kernels: the LRU diff and transfers run
in the manager, selection in the algorithm, attention in the adaptor (or the torch
fallback below while no adaptor is given).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from sparsehi.algorithms.base import BaseSparseAlgorithm, SparseMode, check_selection
from sparsehi.config import SparseConfig
from sparsehi.decode_step import StepTables
from sparsehi.forward_batch import ForwardBatch
from sparsehi.kernels.selection_table import selection_table
from sparsehi.kernels.store_kv import store_kv
from sparsehi.kv_manager import COORDINATOR_MODES, DecodeStep, RequestKV, SparseKVCacheManager
from sparsehi.row_choice import RowChoice
from sparsehi.selection import SparseSelection

__all__ = ["SparseCoordinator", "LayerPlan", "RequestKV", "COORDINATOR_MODES", "gathered_attention"]

_STEP_KEY = "_sparse_decode_step"
_INT32_MAX = 2**31 - 1


def _pad_cols(x: torch.Tensor, width: int) -> torch.Tensor:
    """``x [B, N]`` padded with -1 columns to ``[B, width]``."""
    if x.shape[1] == width:
        return x
    return torch.nn.functional.pad(x, (0, width - x.shape[1]), value=-1)


def gathered_attention(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, selection: SparseSelection,
                       sm_scale: float) -> torch.Tensor:
    """Torch decode attention over the selected pages (fallback while no adaptor is given;
    also the reference adaptors are tested against).

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
    adaptor: Any = None

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
        if self.adaptor is not None:
            return self.adaptor.forward_decode(q, self.layer_cache, self.metadata, sm_scale=sm_scale)
        return gathered_attention(q, self.k_buffer, self.v_buffer, self.selection, sm_scale)


class SparseCoordinator:
    """Lifecycle hooks of hierarchical (or GPU-only) sparse decoding."""

    def __init__(
        self,
        config: SparseConfig,
        algorithm: BaseSparseAlgorithm,
        device_pool,
        *,
        mode: str = "hierarchical",
        host_pool=None,
        transfer=None,
        adaptor=None,
        max_num_reqs: int,
        max_context_len: int,
        init_algorithm: bool = True,
        validate: bool = True,
        dense_pool_tokens: Optional[int] = None,
        host_addressing: str = "pages",
    ) -> None:
        if not isinstance(algorithm, BaseSparseAlgorithm):
            raise ValueError(f"algorithm must be a BaseSparseAlgorithm, got {type(algorithm).__name__}")
        if algorithm.mode is SparseMode.TOKEN_WISE and config.page_size != 1:
            raise ValueError(f"token-wise algorithm needs SparseConfig.page_size=1, got {config.page_size}")
        self.config = config
        self.algorithm = algorithm
        self.adaptor = adaptor
        self.mode = mode
        self.validate = validate
        self.device_pool = device_pool
        num_layers = device_pool.spec.num_layers
        self.num_layers = num_layers
        if config.dense_layers is not None and any(x >= num_layers for x in config.dense_layers):
            raise ValueError(f"SparseConfig.dense_layers={config.dense_layers} is invalid for a {num_layers}-layer "
                             f"model: layer ids in [0, {num_layers})")
        sparse = [layer for layer in range(num_layers) if algorithm.is_sparse_layer(layer)]
        self.manager = SparseKVCacheManager(
            config, device_pool, mode=mode, host_pool=host_pool, transfer=transfer, sparse_layers=sparse,
            max_num_reqs=max_num_reqs, max_context_len=max_context_len, dense_pool_tokens=dense_pool_tokens,
            validate=validate, host_addressing=host_addressing,
        )
        self.sel_mode = SparseMode.TOKEN_WISE if config.page_size == 1 else SparseMode.PAGE_WISE
        if init_algorithm:
            spec = device_pool.spec
            algorithm.initialize_representation_pool(
                0, num_layers, max_num_reqs, max_context_len, kv_heads=spec.kv_heads, head_dim=spec.head_dim,
                dtype=spec.dtype,
            )

    # ------------------------------------------------------------------ requests
    def on_request_begin(self, req_pool_index: int, **kwargs: Any) -> None:
        self.manager.begin_request(int(req_pool_index))

    def on_request_end(self, req_pool_index: int) -> RequestKV:
        kv = self.manager.end_request(int(req_pool_index))
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
        self.manager.adopt_prompt(list(req_pool_indices), list(seq_lens), token_slots, host_slots)

    def record_host_tokens(self, req_pool_indices: torch.Tensor, positions: torch.Tensor,
                           host_slots: torch.Tensor) -> None:
        """``host_addressing='tokens'``: the host slot of each decode row's new token (``-1``
        rows are padding); graph-safe."""
        self.manager.record_host_tokens(req_pool_indices, positions, host_slots)

    def set_residency(self, v2p: Optional[torch.Tensor], page_size: int = 1) -> None:
        """``host_addressing='tokens'``: the engine's virtual->GPU page map over host slots
        (``v2p [pages] int32``, 0 = not on the GPU; ``page_size`` tokens a page), so misses
        still on the GPU are read from there. None: every miss reads host memory."""
        if not self.manager.host_tokens:
            raise ValueError("set_residency is for host_addressing='tokens'")
        self.manager.resident = None if v2p is None else (v2p, int(page_size))

    def _check_layer(self, layer_id: int) -> None:
        if not isinstance(layer_id, int) or not 0 <= layer_id < self.num_layers:
            raise ValueError(f"layer_id={layer_id!r} is invalid: an int in [0, {self.num_layers})")

    # ------------------------------------------------------------------ forward
    def prepare_decode(self, req_pool_indices, seq_lens) -> bool:
        """Host part of a decode step, outside any CUDA graph: checks, new pages for rows
        that open a page (vectorised), step counter. ``req_pool_indices`` / ``seq_lens``:
        the live rows and their lengths with the new token (sequences of int or NumPy
        arrays). Returns ``has_dense_rows`` for the step's ``ForwardBatch``."""
        return self.manager.prepare_decode(req_pool_indices, seq_lens)

    def forward_begin(self, batch: ForwardBatch) -> None:
        """Decode: place every row's new token (sets ``batch.out_cache_loc``). A batch that is
        not ``prepared`` runs ``prepare_decode`` first (eager callers); a prepared one does
        device work only (CUDA-graph safe)."""
        if batch.mode != "decode":
            self.manager.wait_offloads()
            return
        if batch.prepared:
            has_dense = batch.has_dense_rows
        else:
            rows = [int(x) for x in batch.req_pool_indices.tolist()]
            has_dense = self.manager.prepare_decode(rows, batch.seq_lens_cpu)
        step = self.manager.begin_step(batch.req_pool_indices, batch.seq_lens, has_dense, checked=self.validate)
        batch.out_cache_loc = step.out_loc
        batch.extra[_STEP_KEY] = step

    def _step(self, batch: ForwardBatch) -> DecodeStep:
        step = batch.extra.get(_STEP_KEY)
        if step is None:
            raise ValueError("decode batch has not been through forward_begin")
        return step

    def attention_begin(self, layer_id: int, batch: ForwardBatch, q: torch.Tensor, **algo_kw: Any) -> LayerPlan:
        """One decode layer: select, make the selection resident, build the plan."""
        self._check_layer(layer_id)
        if batch.mode != "decode":
            raise ValueError("attention_begin is a decode hook: batch.mode must be 'decode' (prefill attends densely)")
        step = self._step(batch)
        m = self.manager
        bufs, kbuf, vbuf = m.layer_cache(layer_id)
        if self.algorithm.is_sparse_layer(layer_id):
            selection = self._sparse_selection(layer_id, batch, step, q, algo_kw)
            sparse = True
            meta = self.adaptor.build_metadata(selection) if self.adaptor is not None else None
        else:
            selection = self._dense_selection(layer_id, step, "dense_layers")
            sparse = False
            if "dense_metadata" not in step.memo:  # shared by the dense layers, like the selection
                step.memo["dense_metadata"] = self.adaptor.build_metadata(selection) if self.adaptor is not None else None
            meta = step.memo["dense_metadata"]
        return LayerPlan(layer_id, bufs, kbuf, vbuf, m.write_loc(layer_id, step), selection, meta, sparse, self.adaptor)

    def _dense_selection(self, layer_id: int, step: DecodeStep, key: str) -> SparseSelection:
        """Every page of every row, from the pages that hold a request's whole context:
        dense layers (``key="dense_layers"``; hierarchical: the dense-layer pool), and the
        sparse layers of dense rows (``key="dense_rows"``: the main pool). Built once per
        step; ``[B, M]`` with ``M`` the static page bound of a request."""
        sel = step.memo.get(key)
        if sel is None:
            # one launch; the dense layers' selection also carries the attention backend's
            # page table (the sparse layers' dense rows are merged into their own table)
            d = self.manager.own_pages(layer_id, step, with_table=key == "dense_layers")
            sel = SparseSelection(d.logical, d.physical, step.num_pages, step.seq_lens, self.config.page_size,
                                  self.sel_mode, page_table=d.page_table, attended=d.attended)
            step.memo[key] = sel
        return sel

    def _step_tables(self, layer_id: int, step: DecodeStep) -> StepTables:
        """Layer-independent parts of a sparse layer's selection (the candidate range and the
        plain candidate list of rows that are not sparse): ``begin_step`` built them in its
        one launch."""
        return step.memo["sparse_tables"]

    def _sparse_selection(self, layer_id: int, batch: ForwardBatch, step: DecodeStep, q: torch.Tensor,
                          algo_kw: dict) -> SparseSelection:
        m = self.manager
        K = m.K
        dev = step.rows.device
        B = step.batch_size
        t = self._step_tables(layer_id, step)
        # retrieve_topk runs for every batch (no host-side "is any row sparse"): rows that
        # are not sparse take their plain candidate list below
        sel, val = self.algorithm.retrieve_topk(
            q, layer_id, batch.req_pool_indices, t.sparse_mask, seq_lens=step.seq_lens, candidate_start=t.cs,
            candidate_end=t.ce, top_k=K, **algo_kw,
        )
        if not isinstance(sel, torch.Tensor) or not isinstance(val, torch.Tensor):
            raise ValueError(f"retrieve_topk of {type(self.algorithm).__name__} must return two torch.Tensors "
                             f"(selected_indices [B, top_k] int32, valid_lengths [B] int32), got "
                             f"{type(sel).__name__}, {type(val).__name__}")
        if step.checked:
            check_selection(sel, val, K, t.cs, t.ce)
        if sel.shape[1] < K:
            sel = torch.cat([sel, torch.full((B, K - sel.shape[1]), -1, dtype=torch.int32, device=dev)], 1)
        sel = sel.to(device=dev, dtype=torch.int32).contiguous()
        val = val.to(device=dev, dtype=torch.int32)
        if sel.shape != (B, K) or val.shape != (B,):
            raise ValueError(f"retrieve_topk of {type(self.algorithm).__name__} must return selected_indices "
                             f"[B={B}, top_k<={K}] and valid_lengths [B={B}], got {tuple(sel.shape)} and "
                             f"{tuple(val.shape)}")
        # Rows that are not sparse (padding rows among them: they select nothing, whatever the
        # algorithm said) take their plain candidate list. The kernels that read the selection
        # next make that choice per row themselves: no substitution launch.
        choice: Optional[RowChoice] = RowChoice(t.use, t.all_ids, t.ncand)
        topk, valid = sel, val
        if step.checked or not self.algorithm.selects_ascending:
            # the substituted selection itself, for the value checks or the sort
            topk, valid = choice.apply(sel, val)
        if step.checked and bool((valid.long() > K).any()):
            raise ValueError(f"more than top_k={K} ids selected in a row")
        if not self.algorithm.selects_ascending:
            # ascending ids, -1 padding last: the selection table needs that order (the
            # valid ids of a row are distinct, so the order is unique)
            key = torch.where(t.colk < valid[:, None], topk, _INT32_MAX)
            key = torch.sort(key, dim=1).values
            topk = key.masked_fill_(key == _INT32_MAX, -1).contiguous()
            choice = None
        m.check_topk(step, topk, valid, t.ce)
        if choice is not None:  # the kernels read the algorithm's selection and choose per row
            topk, valid = sel, val
        if m.hier:  # LRU diff, then the copy of the misses and the table (buffer pages) in one launch
            tab = m.swap_in_table(layer_id, step, topk, valid, choice)
        else:
            tab = selection_table(topk, valid, step.num_pages, step.seq_lens, step.safe_rows, sink=m.sink, recent=m.R,
                                  page_size=self.config.page_size, own_table=m.page_table, choice=choice)
        if step.dense_rows is None:
            return SparseSelection(tab.logical, tab.physical, tab.num_valid, step.seq_lens, self.config.page_size,
                                   self.sel_mode, page_table=tab.page_table, attended=tab.attended)
        # dense rows attend all their pages: one table, as wide as the wider of the two
        d = self._dense_selection(layer_id, step, "dense_rows")
        w = max(tab.logical.shape[1], d.logical_ids.shape[1])
        dr = step.dense_rows[:, None]
        logical = torch.where(dr, _pad_cols(d.logical_ids, w), _pad_cols(tab.logical, w))
        phys = torch.where(dr, _pad_cols(d.physical_ids, w), _pad_cols(tab.physical, w))
        num_valid = torch.where(step.dense_rows, d.num_valid, tab.num_valid)
        return SparseSelection(logical, phys, num_valid, step.seq_lens, self.config.page_size, self.sel_mode)

    def attention_end(self, layer_id: int, batch: ForwardBatch, k: Optional[torch.Tensor] = None,
                      v: Optional[torch.Tensor] = None, **algo_kw: Any) -> None:
        """Prefill: build representations. Decode: fold the new token into them and back it
        up to host (hierarchical)."""
        self._check_layer(layer_id)
        sparse = self.algorithm.is_sparse_layer(layer_id)
        if batch.mode == "prefill":
            if sparse:
                self.algorithm.construct_representations(
                    layer_id, batch.req_pool_indices, batch.seq_lens, self.device_pool.get_key_buffer(layer_id),
                    batch.token_slots, **algo_kw,
                )
            return
        step = self._step(batch)
        if k is None:
            raise ValueError("decode attention_end needs k (the new token's key, [B, Hkv, D])")
        # Back up first: if the backup raises, the representations have not moved either.
        self.manager.backup_token(layer_id, step, k, v)
        if sparse:
            self.algorithm.update_representations(layer_id, batch.req_pool_indices, batch.positions, k, **algo_kw)

    def forward_end(self, batch: ForwardBatch, host_slots: Optional[list[torch.Tensor]] = None,
                    free_device_kv: bool = True) -> None:
        """Prefill: offload / set up buffers (see docs). Decode: close the step's counters."""
        if batch.mode == "prefill":
            rows = [int(x) for x in batch.req_pool_indices.tolist()]
            self.manager.finish_prefill(rows, batch.seq_lens_cpu, batch.prefix_lens_cpu, batch.token_slots,
                                        host_slots=host_slots, free_device_kv=free_device_kv)
            return
        self._step(batch)
        self.manager.end_step()
        batch.extra.pop(_STEP_KEY, None)

    # ------------------------------------------------------------------ counters
    def stats(self) -> dict:
        return self.manager.stats()

    def reset_stats(self) -> None:
        self.manager.reset_stats()
