"""Oracle: exact attention scores over the true keys — the ceiling other algorithms are
measured against (tests, author test kit, fidelity benchmark).

Token score ``s_t = reduce_h (q_h · k_{t, g(h)})`` over all query heads ``h`` (``g(h)``
the KV head of ``h``'s GQA group); ``reduce`` is ``sum`` (default) or ``max``
(``sparse_extra_config["head_reduce"]``). Sum is the default because one selection
serves all heads and the fidelity benchmark measures head-averaged attention mass: there
Quest with summed heads keeps 0.99 of the best top-k mass at 32k/2048, with max 0.94. Page mode scores a page by the max of ``s_t``
over its tokens (a partial last page over its written tokens only). Token mode
(``page_size == 1``) selects tokens by ``s_t``.

The oracle needs every key, so its "representation" is its own copy of the keys per
``(req_pool_index, position)`` on the device — as large as the key cache itself. It is a
measuring instrument, not something to serve with.

Padding rows (``req_pool_index < 0``) are ignored on write (one dump entry past the pool
takes them) and select nothing. Value checks read back to the host: they run with
``sparse_extra_config["validate"]`` (default True), never during CUDA-graph capture.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from sparsehi.algorithms.base import BaseSparseAlgorithm, SparseMode, check_pool_args, represented_lens_of
from sparsehi.algorithms.registry import register_algorithm
from sparsehi.input_checks import (as_row_mask, check_batch_rows, check_float_tensor, check_int_vector,
                                   host_checks_enabled, live_rows, raise_if_any, selection_kwargs)
from sparsehi.kernels.topk import topk_select

HEAD_REDUCE = ("max", "sum")


def head_reduce_of(config: Any) -> str:
    """``sparse_extra_config["head_reduce"]`` validated (default ``"sum"``)."""
    r = config.sparse_extra_config.get("head_reduce", "sum")
    if r not in HEAD_REDUCE:
        raise ValueError(f"sparse_extra_config['head_reduce']={r!r} is invalid: one of {HEAD_REDUCE}")
    return r


def exact_token_scores(queries: torch.Tensor, keys: torch.Tensor, head_reduce: str = "sum") -> torch.Tensor:
    """Exact per-token scores.

    queries: ``[B, Hq, D]``; keys: ``[B, T, Hkv, D]`` with ``Hq % Hkv == 0``.
    Returns ``[B, T] float32``: ``reduce_h q_h · k_{t, h // (Hq/Hkv)}``.
    """
    if queries.dim() != 3 or keys.dim() != 4:
        raise ValueError(f"queries must be [B, Hq, D] and keys [B, T, Hkv, D], got {tuple(queries.shape)}, {tuple(keys.shape)}")
    b, hq, d = queries.shape
    hkv = keys.shape[2]
    if keys.shape[0] != b or keys.shape[3] != d or hq % hkv:
        raise ValueError(f"queries {tuple(queries.shape)} and keys {tuple(keys.shape)} disagree (need same B, D and Hq % Hkv == 0)")
    if head_reduce not in HEAD_REDUCE:
        raise ValueError(f"head_reduce={head_reduce!r} is invalid: one of {HEAD_REDUCE}")
    q = queries.float().view(b, hkv, hq // hkv, d)
    logits = torch.einsum("bgrd,btgd->bgrt", q, keys.float()).reshape(b, hq, -1)
    return logits.amax(dim=1) if head_reduce == "max" else logits.sum(dim=1)


def page_max_scores(token_scores: torch.Tensor, seq_lens: torch.Tensor, page_size: int) -> torch.Tensor:
    """Page score = max over the page's written tokens.

    token_scores: ``[B, T] float``; seq_lens: ``[B]`` int (tokens ``>= seq_len`` ignored).
    Returns ``[B, ceil(T / page_size)] float32``; pages with no written token are -inf.
    """
    b, t = token_scores.shape
    pages = -(-t // page_size)
    pos = torch.arange(pages * page_size, device=token_scores.device)[None, :]
    s = torch.full((b, pages * page_size), float("-inf"), device=token_scores.device)
    s[:, :t] = token_scores.float()
    s = torch.where(pos < seq_lens.to(s.device).long()[:, None], s, torch.full_like(s, float("-inf")))
    return s.view(b, pages, page_size).amax(dim=2)


@register_algorithm("oracle")
class OracleAlgorithm(BaseSparseAlgorithm):
    """Exact top-k by true q·k (page mode for ``page_size > 1``, token mode for 1)."""

    default_dense_layers: tuple[int, ...] = ()

    selects_ascending = True  # topk_select returns each row's ids in ascending order
    supports_chunked_prefill = True

    def __init__(self, config: Any, device: torch.device, **kwargs: Any) -> None:
        # The oracle serves both granularities, so its mode follows the config.
        self.mode = SparseMode.TOKEN_WISE if config.page_size == 1 else SparseMode.PAGE_WISE
        super().__init__(config, device, **kwargs)
        self.head_reduce = head_reduce_of(config)
        self.page_size = config.page_size
        self.validate = bool(config.sparse_extra_config.get("validate", True))
        # flat [R * T + 1, Hkv, D] (last entry: padding rows' writes) and its [R, T, Hkv, D] view
        self._keys_flat: dict[int, torch.Tensor] = {}
        self._keys: dict[int, torch.Tensor] = {}
        self.max_num_reqs = 0
        self.max_context_len = 0
        self.kv_heads = 0
        self.head_dim = 0

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
        """Keys ``[max_num_reqs, max_context_len, kv_heads, head_dim]`` per sparse layer (+ one
        dump entry for padding rows' writes)."""
        check_pool_args(start_layer, end_layer, max_num_reqs=max_num_reqs, max_context_len=max_context_len,
                        kv_heads=kv_heads, head_dim=head_dim)
        self.max_num_reqs, self.max_context_len = max_num_reqs, max_context_len
        self.kv_heads, self.head_dim = kv_heads, head_dim
        self._keys_flat = {
            layer: torch.zeros(max_num_reqs * max_context_len + 1, kv_heads, head_dim, dtype=dtype, device=self.device)
            for layer in range(start_layer, end_layer)
            if self.is_sparse_layer(layer)
        }
        self._keys = {layer: t[:-1].view(max_num_reqs, max_context_len, kv_heads, head_dim)
                      for layer, t in self._keys_flat.items()}

    def _layer(self, layer_id: int) -> Optional[torch.Tensor]:
        return self.layer_representation(self._keys, layer_id)

    def construct_representations(
        self,
        layer_id: int,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        key_buffer: torch.Tensor,
        token_slots: torch.Tensor,
        **kwargs: Any,
    ) -> None:
        pool = self._layer(layer_id)
        if pool is None:
            return
        b, max_len = token_slots.shape
        if max_len > self.max_context_len:
            raise ValueError(f"token_slots has {max_len} positions > max_context_len={self.max_context_len}")
        check_batch_rows(req_pool_indices)
        req = req_pool_indices.to(token_slots.device).long()
        if host_checks_enabled(self.validate):
            raise_if_any([(req >= self.max_num_reqs,
                           f"req_pool_indices must be < max_num_reqs={self.max_num_reqs} (negative: padding row)")])
        pos = torch.arange(max_len, device=token_slots.device)[None, :]
        start = torch.tensor(represented_lens_of(kwargs, b, self.config.page_size), device=token_slots.device)
        valid = ((pos < seq_lens.to(token_slots.device).long()[:, None]) & (pos >= start[:, None])
                 & live_rows(req, self.max_num_reqs)[:, None])
        rows = req[:, None].expand(b, max_len)[valid]
        cols = pos.expand(b, max_len)[valid]
        slots = token_slots[valid].long()
        pool[rows.to(pool.device), cols.to(pool.device)] = key_buffer[slots.to(key_buffer.device)].to(pool.device, pool.dtype)

    def update_representations(
        self,
        layer_id: int,
        req_pool_indices: torch.Tensor,
        positions: torch.Tensor,
        new_keys: torch.Tensor,
        **kwargs: Any,
    ) -> None:
        pool = self._layer(layer_id)
        if pool is None:
            return
        flat = self._keys_flat[layer_id]
        b = check_batch_rows(req_pool_indices)
        check_int_vector("positions", positions, b)
        check_float_tensor("new_keys", new_keys, (b, self.kv_heads, self.head_dim), "[B, Hkv, D]")
        pos = positions.long().to(pool.device)
        req = req_pool_indices.long().to(pool.device)
        live = live_rows(req, self.max_num_reqs)
        if host_checks_enabled(self.validate):
            raise_if_any([
                (req >= self.max_num_reqs,
                 f"req_pool_indices must be < max_num_reqs={self.max_num_reqs} (negative: padding row)"),
                (live & ((pos < 0) | (pos >= self.max_context_len)),
                 f"positions must lie in [0, max_context_len={self.max_context_len})"),
            ])
        ok = live & (pos >= 0) & (pos < self.max_context_len)
        idx = torch.where(ok, req * self.max_context_len + pos, torch.full_like(req, flat.shape[0] - 1))
        flat[idx] = new_keys.to(pool.device, pool.dtype)

    def score(self, queries: torch.Tensor, layer_id: int, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
        """``[B, N] float32`` exact score of every logical id (pages or tokens)."""
        pool = self._layer(layer_id)
        if pool is None:
            raise ValueError(f"layer_id={layer_id} is dense for this algorithm: retrieve_topk is not defined there")
        if host_checks_enabled(True):
            # eager: score only up to the longest row (an oracle may sync with the host)
            t = min(max(1, int(seq_lens.max())), self.max_context_len)
        else:
            t = self.max_context_len  # capturing a CUDA graph: a fixed shape, no read-back
        req = req_pool_indices.long().to(pool.device)
        live = live_rows(req, self.max_num_reqs)
        keys = pool[torch.where(live, req, torch.zeros_like(req)), :t]
        s = exact_token_scores(queries.to(pool.device), keys, self.head_reduce)
        # padding rows score nothing
        n = torch.where(live, seq_lens.to(s.device).long(), torch.zeros_like(req))
        if self.mode is SparseMode.TOKEN_WISE:
            pos = torch.arange(t, device=s.device)[None, :]
            return torch.where(pos < n[:, None], s, torch.full_like(s, float("-inf")))
        return page_max_scores(s, n, self.page_size)

    def retrieve_topk(
        self,
        queries: torch.Tensor,
        layer_id: int,
        req_pool_indices: torch.Tensor,
        sparse_mask: torch.Tensor,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        b = check_batch_rows(req_pool_indices, sparse_mask)
        if (not isinstance(queries, torch.Tensor) or queries.dim() != 3 or queries.shape[0] != b
                or not queries.is_floating_point()):
            got = (tuple(queries.shape), queries.dtype) if isinstance(queries, torch.Tensor) else type(queries).__name__
            raise ValueError(f"queries must be a floating [B={b}, Hq, D] tensor, got {got}")
        seq_lens, cs, ce, top_k = selection_kwargs(kwargs, b, self.device)
        if host_checks_enabled(self.validate):
            raise_if_any([(req_pool_indices >= self.max_num_reqs,
                           f"req_pool_indices must be < max_num_reqs={self.max_num_reqs} (negative: padding row)")])
        scores = self.score(queries, layer_id, req_pool_indices, seq_lens)
        return topk_select(scores, top_k, cs, ce, as_row_mask(sparse_mask, scores.device))

    def representation_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._keys_flat.values())
