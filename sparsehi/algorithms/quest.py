"""Quest (Tang et al., ICML 2024): query-aware page selection from per-page key bounds.

Representation, per sparse layer: element-wise key ``min`` and ``max`` of every page and
KV head, ``[max_num_reqs, max_pages, Hkv, D]`` each (2/page_size of the key cache), in the
key dtype (min/max of stored values are exact in it). Built from the device key cache
after prefill; each decoded key is folded into its page's running min/max, so the page
being written is bounded too.

Score: the Quest upper bound ``Σ_d max(q_d·min_d, q_d·max_d)`` per page and query head,
reduced over all query heads by **sum** by default (``sparse_extra_config
["head_reduce"] = "max"`` takes the max). Either is an upper bound of the oracle's page
score with the same reduction (``Σ_h max_t ≥ max_t Σ_h``), which the property test
checks. Sum is the default: at 32k context and a 2048-token budget it keeps 0.99 of the
best top-k head-averaged attention mass vs 0.94 for max (benchmarks/results/fidelity.json).

Decode launches per sparse layer on CUDA: ``retrieve_topk``
(:func:`sparsehi.kernels.quest_select.quest_retrieve`) is the bound of every page (pages
counted from ``seq_lens`` inside the kernel), then :func:`sparsehi.kernels.topk.topk_select`
(one launch, or two when it splits a small batch: chunk shortlists, then the merge). A
fused kernel of the bounds and the chunk shortlists exists (``fused=True``) but measured
slower on an H100. ``update_representations`` is one
(:func:`sparsehi.kernels.quest_update_bounds.quest_update_bounds`).

Padding rows (``req_pool_index < 0``, e.g. the unused rows of a CUDA-graph batch) are
ignored: ``update_representations`` changes nothing for them (the torch path on CPU sends
their writes to one dump entry past the pool, never read), ``retrieve_topk`` returns
``valid_lengths == 0`` for them. Value checks
(positions and request slots in range) read back to the host, so they run only with
``sparse_extra_config["validate"]`` (default True) and never during CUDA-graph capture;
shape / dtype checks always run.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from sparsehi.algorithms.base import (BaseSparseAlgorithm, SparseMode, TopkRanking, check_pool_args,
                                      represented_lens_of)
from sparsehi.algorithms.oracle import head_reduce_of
from sparsehi.algorithms.registry import register_algorithm
from sparsehi.input_checks import (as_row_mask, check_batch_rows, check_float_tensor, check_int_vector,
                                   host_checks_enabled, live_rows, raise_if_any, selection_kwargs)
from sparsehi.kernels.quest_score import quest_score
from sparsehi.kernels.quest_select import quest_retrieve
from sparsehi.kernels.quest_update_bounds import quest_update_bounds


@register_algorithm("quest")
class QuestAlgorithm(BaseSparseAlgorithm):
    """Page-wise Top-k by the Quest bound. ``page_size`` must be a power of two >= 2."""

    mode = SparseMode.PAGE_WISE
    selects_ascending = True  # topk_select returns each row's ids in ascending order
    supports_chunked_prefill = True
    default_dense_layers: tuple[int, ...] = (0, 1)

    def __init__(self, config: Any, device: torch.device, **kwargs: Any) -> None:
        super().__init__(config, device, **kwargs)
        ps = config.page_size
        if not isinstance(ps, int) or ps < 2 or ps & (ps - 1):
            raise ValueError(f"SparseConfig.page_size={ps!r} is invalid for quest: a power of two >= 2 "
                             "(Quest bounds pages; token-wise selection is what dsa/oracle do)")
        self.page_size = ps
        self.head_reduce = head_reduce_of(config)
        # value checks read back to the host: skipped when False and during CUDA-graph capture
        self.validate = bool(config.sparse_extra_config.get("validate", True))
        # flat [R * P + 1, Hkv, D] storage (the last entry absorbs padding rows' writes) and
        # its [R, P, Hkv, D] view without that entry
        self._kmin_flat: dict[int, torch.Tensor] = {}
        self._kmax_flat: dict[int, torch.Tensor] = {}
        self._kmin: dict[int, torch.Tensor] = {}
        self._kmax: dict[int, torch.Tensor] = {}
        self.max_num_reqs = 0
        self.max_pages = 0
        self.kv_heads = 0
        self.head_dim = 0

    # ------------------------------------------------------------------ memory
    def initialize_representation_pool(
        self,
        start_layer: int,
        end_layer: int,
        max_num_reqs: int,
        max_context_len: int,
        *,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        **kwargs: Any,
    ) -> None:
        """Reserve min/max ``[max_num_reqs, ceil(max_context_len / page_size), kv_heads,
        head_dim]`` (``dtype``) for every sparse layer in ``[start_layer, end_layer)``, plus
        one ``[kv_heads, head_dim]`` dump entry each for padding rows' writes."""
        check_pool_args(start_layer, end_layer, max_num_reqs=max_num_reqs, max_context_len=max_context_len,
                        kv_heads=kv_heads, head_dim=head_dim)
        self.max_num_reqs = max_num_reqs
        self.max_pages = -(-max_context_len // self.page_size)
        self.kv_heads, self.head_dim = kv_heads, head_dim
        flat_shape = (max_num_reqs * self.max_pages + 1, kv_heads, head_dim)
        shape = (max_num_reqs, self.max_pages, kv_heads, head_dim)
        self._kmin_flat, self._kmax_flat, self._kmin, self._kmax = {}, {}, {}, {}
        for layer in range(start_layer, end_layer):
            if self.is_sparse_layer(layer):
                for flat, view in ((self._kmin_flat, self._kmin), (self._kmax_flat, self._kmax)):
                    flat[layer] = torch.zeros(flat_shape, dtype=dtype, device=self.device)
                    view[layer] = flat[layer][:-1].view(shape)

    def _pools(self, layer_id: int) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        kmin = self.layer_representation(self._kmin, layer_id)
        return None if kmin is None else (kmin, self._kmax[layer_id])

    # ------------------------------------------------------------------ build / update
    def construct_representations(
        self,
        layer_id: int,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        key_buffer: torch.Tensor,
        token_slots: torch.Tensor,
        **kwargs: Any,
    ) -> None:
        """Recompute min/max of every page covering ``[represented_lens[b], seq_lens[b])``
        (``represented_lens``: 0 when absent; see the base class), so a re-call after a
        further prefill chunk is correct too, whether or not the earlier chunk's keys are
        still on the device."""
        pools = self._pools(layer_id)
        if pools is None:
            return
        kmin, kmax = pools
        b, max_len = token_slots.shape
        ps = self.page_size
        pages = -(-max_len // ps)
        if pages > self.max_pages:
            raise ValueError(f"token_slots has {max_len} positions > max_context_len={self.max_pages * ps}")
        if key_buffer.shape[1:] != kmin.shape[2:]:
            raise ValueError(f"key_buffer {tuple(key_buffer.shape)} does not match the pool's [Hkv, D]={tuple(kmin.shape[2:])}")
        # lengths and rows on the host (one read; none when the caller passes CPU tensors)
        seq = [int(x) for x in seq_lens.tolist()]
        req = [int(x) for x in req_pool_indices.tolist()]
        starts = represented_lens_of(kwargs, b, ps)
        # One request at a time bounds the temporary to one row's keys.
        for i in range(b):
            n, r, s0 = seq[i], req[i], starts[i]
            if n <= s0 or r < 0:  # nothing new, or a padding row
                continue
            if r >= self.max_num_reqs:
                raise ValueError(f"req_pool_indices[{i}]={r} is invalid: < max_num_reqs={self.max_num_reqs} (negative: padding)")
            k = key_buffer[token_slots[i, s0:n].to(key_buffer.device).long()].to(kmin.device)
            p0, full = s0 // ps, n // ps
            if full > p0:
                kp = k[: (full - p0) * ps].view(full - p0, ps, *k.shape[1:])
                kmin[r, p0:full] = kp.amin(dim=1).to(kmin.dtype)
                kmax[r, p0:full] = kp.amax(dim=1).to(kmax.dtype)
            if n % ps:
                tail = k[(full - p0) * ps:]
                kmin[r, full] = tail.amin(dim=0).to(kmin.dtype)
                kmax[r, full] = tail.amax(dim=0).to(kmax.dtype)

    def update_representations(
        self,
        layer_id: int,
        req_pool_indices: torch.Tensor,
        positions: torch.Tensor,
        new_keys: torch.Tensor,
        **kwargs: Any,
    ) -> None:
        """Fold ``new_keys [B, Hkv, D]`` at ``positions [B]`` into their pages' running
        min/max; the first token of a page resets it (the slot may hold an old request's
        bounds). Rows with ``req_pool_indices < 0`` are padding and change nothing."""
        pools = self._pools(layer_id)
        if pools is None:
            return
        kmin_flat, kmax_flat = self._kmin_flat[layer_id], self._kmax_flat[layer_id]
        b = check_batch_rows(req_pool_indices)
        check_int_vector("positions", positions, b)
        check_float_tensor("new_keys", new_keys, (b, self.kv_heads, self.head_dim), "[B, Hkv, D]")
        dev = kmin_flat.device
        limit = self.max_pages * self.page_size
        if host_checks_enabled(self.validate):
            pos = positions.to(dev).long()
            req = req_pool_indices.to(dev).long()
            live = live_rows(req, self.max_num_reqs)
            raise_if_any([
                (req >= self.max_num_reqs,
                 f"req_pool_indices must be < max_num_reqs={self.max_num_reqs} (negative: padding row)"),
                (live & ((pos < 0) | (pos >= limit)), f"positions must lie in [0, max_context_len={limit})"),
            ])
        # padding and (unchecked) out-of-range rows change nothing
        quest_update_bounds(kmin_flat, kmax_flat, req_pool_indices, positions, new_keys,
                            max_num_reqs=self.max_num_reqs, max_pages=self.max_pages, page_size=self.page_size)

    # ------------------------------------------------------------------ select
    def score(self, queries: torch.Tensor, layer_id: int, req_pool_indices: torch.Tensor,
              seq_lens: torch.Tensor) -> torch.Tensor:
        """``[B, max_pages] float32`` Quest bound per logical page (-inf past the context)."""
        pools = self._pools(layer_id)
        if pools is None:
            raise ValueError(f"layer_id={layer_id} is dense for quest (dense_layers={self.dense_layers()}): no retrieve_topk there")
        kmin, kmax = pools
        dev = kmin.device
        # pages from seq_lens, padding / out-of-range rows (-inf), all inside the kernel
        return quest_score(queries.to(dev), kmin, kmax, req_pool_indices.to(dev), seq_lens.to(dev), self.head_reduce,
                           page_size=self.page_size)

    def retrieve_topk(
        self,
        queries: torch.Tensor,
        layer_id: int,
        req_pool_indices: torch.Tensor,
        sparse_mask: torch.Tensor,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Top ``top_k`` pages by the Quest bound among ``[candidate_start, candidate_end)``.
        queries ``[B, Hq, D]`` (post-RoPE, as the keys in the cache). Padding rows
        (``req_pool_indices < 0``) return ``valid_lengths == 0``."""
        q, kmin, kmax, req, seq_lens, cs, ce, top_k, mask = self._retrieve_args(queries, layer_id, req_pool_indices,
                                                                                sparse_mask, kwargs)
        # fused score + chunk shortlists, then the merge, when a small batch splits the
        # select; else the score kernel and topk_select (same ids either way)
        return quest_retrieve(q, kmin, kmax, req, seq_lens, self.head_reduce, self.page_size, top_k, cs, ce, mask)

    def selection_ranking(self, queries: torch.Tensor, layer_id: int, req_pool_indices: torch.Tensor,
                          sparse_mask: torch.Tensor, **kwargs: Any) -> TopkRanking:
        """The Quest bounds over ``retrieve_topk``'s checked inputs (the score kernel; the
        selection of small batches fuses it with the select): one scoring pass that loading
        ahead cuts twice, the same ids as two ``retrieve_topk`` calls."""
        q, kmin, kmax, req, seq_lens, cs, ce, top_k, mask = self._retrieve_args(queries, layer_id, req_pool_indices,
                                                                                sparse_mask, kwargs)
        scores = quest_score(q, kmin, kmax, req, seq_lens, self.head_reduce, page_size=self.page_size)
        return TopkRanking(scores, cs, ce, top_k, mask)

    def _retrieve_args(self, queries: torch.Tensor, layer_id: int, req_pool_indices: torch.Tensor,
                       sparse_mask: torch.Tensor, kwargs: dict) -> tuple:
        """The checked inputs of a selection: ``(q, kmin, kmax, req_pool_indices, seq_lens,
        candidate_start, candidate_end, top_k, row_mask)`` on the pools' device."""
        b = check_batch_rows(req_pool_indices, sparse_mask)
        if self._pools(layer_id) is None:
            raise ValueError(f"layer_id={layer_id} is dense for quest (dense_layers={self.dense_layers()}): no retrieve_topk there")
        if (not isinstance(queries, torch.Tensor) or queries.dim() != 3 or queries.shape[0] != b
                or queries.shape[2] != self.head_dim or queries.shape[1] % self.kv_heads):
            got = tuple(queries.shape) if isinstance(queries, torch.Tensor) else type(queries).__name__
            raise ValueError(f"queries must be [B={b}, Hq, D={self.head_dim}] with Hq a multiple of "
                             f"Hkv={self.kv_heads}, got {got}")
        if not queries.is_floating_point():
            raise ValueError(f"queries must be a floating tensor, got {queries.dtype}")
        seq_lens, cs, ce, top_k = selection_kwargs(kwargs, b, self.device)
        if host_checks_enabled(self.validate):
            raise_if_any([(req_pool_indices >= self.max_num_reqs,
                           f"req_pool_indices must be < max_num_reqs={self.max_num_reqs} (negative: padding row)")])
        kmin, kmax = self._pools(layer_id)
        dev = kmin.device
        return (queries.to(dev), kmin, kmax, req_pool_indices.to(dev), seq_lens.to(dev), cs, ce, top_k,
                as_row_mask(sparse_mask, dev))

    def on_request_end(self, req_pool_index: int) -> None:
        """Nothing to clear: a page's bounds are reset when its first token is written."""

    def representation_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for d in (self._kmin_flat, self._kmax_flat) for t in d.values())
