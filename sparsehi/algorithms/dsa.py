"""DSA (DeepSeek-V3.2 sparse attention): token-wise Top-k by the lightning indexer.

Representation, per sparse layer: one index key per token ``[max_num_reqs,
max_context_len, index_head_dim]`` on the GPU, indexed by ``(req_pool_index, position)``
and never offloaded (it is what decides what to load). Stored as FP8 e4m3 with a per-token
float32 scale where the GPU supports it (compute capability >= 8.9 and torch has
``float8_e4m3fn``), bf16 otherwise; ``sparse_extra_config["index_dtype"]`` forces
``"fp8" | "bf16" | "fp32"`` (default ``"auto"``). The choice is logged.

Index queries: ``sparse_extra_config["index_query_dtype"]`` ``"fp8"`` quantises them to FP8
e4m3 per (row, head) with a power-of-two scale folded into the head's weight, as
DeepSeek-V3.2's inference code does before the product (FP8 x FP8 on the tensor cores;
``quantize_index_queries``); ``"native"`` scores them in the dtype the model gives;
``"auto"`` (default) is ``"fp8"`` when the index keys are FP8, else ``"native"``.

The model provides the indexer's outputs: ``construct_representations(...,
index_keys=[B, max_len, Di])`` after prefill, ``update_representations(...,
index_keys=[B, Di])`` per decoded token, and ``retrieve_topk(index_queries [B, H, Di], ...,
weights=[B, H])``. Score ``Σ_h w_h ReLU(q_h · k_t)``; top ``top_k`` tokens (default
2048) among the candidates by :func:`sparsehi.kernels.topk.topk_select`.

Decode launches per sparse layer on CUDA: ``retrieve_topk`` is two kernels (the indexer,
which reads each slot's indexed count itself, then ``topk_select``;
loading ahead cuts the same scores a second time, ``selection_ranking``);
``update_representations`` one (quantise, store and count:
:func:`sparsehi.kernels.dsa_index_store.dsa_store_index_keys`).

Invariant from upstream bugs: the index must cover every selectable token. Each layer
tracks how many tokens of each request it indexed; selecting past that is a ValueError.
That check, and the range checks of positions and request slots, read back to the host:
they run with ``sparse_extra_config["validate"]`` (default True) except while a CUDA graph
is being captured (``torch.cuda.is_current_stream_capturing()``); ``validate=False``
drops them everywhere. Unchecked, unindexed positions are still never selected. Shape and
dtype checks always run.

Padding rows (``req_pool_index < 0``, e.g. the unused rows of a CUDA-graph batch) are
ignored: they write nothing (the torch path on CPU sends their writes to one dump entry
past the pool, never read), their indexed count stays untouched, and ``retrieve_topk``
returns ``valid_lengths == 0`` for them.
"""
from __future__ import annotations

import logging
from typing import Any, Optional

import torch

from sparsehi.algorithms.base import (BaseSparseAlgorithm, SparseMode, TopkRanking, check_pool_args,
                                      represented_lens_of)
from sparsehi.algorithms.registry import register_algorithm
from sparsehi.input_checks import (as_row_mask, check_batch_rows, check_int_vector, host_checks_enabled, live_rows,
                                   raise_if_any, selection_kwargs)
from sparsehi.kernels.dsa_index_store import dsa_store_index_keys
from sparsehi.kernels.dsa_indexer import dsa_indexer, fp8_dtype, quantize_index_keys

logger = logging.getLogger(__name__)
INDEX_DTYPES = ("auto", "fp8", "bf16", "fp32")
INDEX_QUERY_DTYPES = ("auto", "fp8", "native")


def choose_index_dtype(device: torch.device, requested: str = "auto") -> str:
    """``"fp8"`` where the device supports FP8 e4m3 (CUDA, compute capability >= 8.9, torch
    with float8_e4m3fn), else ``"bf16"``; an explicit request is returned as is."""
    if requested not in INDEX_DTYPES:
        raise ValueError(f"sparse_extra_config['index_dtype']={requested!r} is invalid: one of {INDEX_DTYPES}")
    if requested != "auto":
        if requested == "fp8" and fp8_dtype() is None:
            raise ValueError("sparse_extra_config['index_dtype']='fp8' needs torch.float8_e4m3fn")
        return requested
    dev = torch.device(device)
    if dev.type == "cuda" and fp8_dtype() is not None and torch.cuda.is_available():
        if torch.cuda.get_device_capability(dev) >= (8, 9):
            return "fp8"
    return "bf16"


def choose_index_query_dtype(index_dtype: str, requested: str = "auto") -> str:
    """``"fp8"`` or ``"native"`` for the index queries: ``"auto"`` takes ``"fp8"`` over FP8
    index keys (DeepSeek-V3.2's indexer), else ``"native"``; FP8 queries need FP8 keys."""
    if requested not in INDEX_QUERY_DTYPES:
        raise ValueError(f"sparse_extra_config['index_query_dtype']={requested!r} is invalid: one of "
                         f"{INDEX_QUERY_DTYPES}")
    if requested == "auto":
        return "fp8" if index_dtype == "fp8" else "native"
    if requested == "fp8" and index_dtype != "fp8":
        raise ValueError(f"sparse_extra_config['index_query_dtype']='fp8' needs FP8 index keys (index_dtype "
                         f"'fp8'), got index_dtype {index_dtype!r}")
    return requested


@register_algorithm("dsa")
class DSAAlgorithm(BaseSparseAlgorithm):
    """Token-wise Top-k by the DSA lightning indexer (``page_size`` must be 1)."""

    mode = SparseMode.TOKEN_WISE
    selects_ascending = True  # topk_select returns each row's ids in ascending order
    supports_chunked_prefill = True
    default_dense_layers: tuple[int, ...] = ()

    def __init__(self, config: Any, device: torch.device, **kwargs: Any) -> None:
        super().__init__(config, device, **kwargs)
        extra = config.sparse_extra_config
        self.index_head_dim = extra.get("index_head_dim", 128)
        if not isinstance(self.index_head_dim, int) or self.index_head_dim <= 0:
            raise ValueError(f"sparse_extra_config['index_head_dim']={self.index_head_dim!r} is invalid: an integer > 0")
        self.index_dtype = choose_index_dtype(self.device, extra.get("index_dtype", "auto"))
        self.index_query_dtype = choose_index_query_dtype(self.index_dtype, extra.get("index_query_dtype", "auto"))
        self.validate = bool(extra.get("validate", True))
        logger.info("dsa: index keys stored as %s, index queries scored as %s, on %s", self.index_dtype,
                    self.index_query_dtype, self.device)
        # flat [R * T + 1, Di] storage (the last entry absorbs padding rows' writes) and its
        # [R, T, Di] view without it; likewise the scales, and [R + 1] indexed counts
        self._keys_flat: dict[int, torch.Tensor] = {}
        self._scales_flat: dict[int, Optional[torch.Tensor]] = {}
        self._keys: dict[int, torch.Tensor] = {}
        self._scales: dict[int, Optional[torch.Tensor]] = {}
        self._indexed: dict[int, torch.Tensor] = {}
        self.max_num_reqs = 0
        self.max_context_len = 0

    @property
    def storage_dtype(self) -> torch.dtype:
        return {"fp8": fp8_dtype(), "bf16": torch.bfloat16, "fp32": torch.float32}[self.index_dtype]

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
        """Index keys ``[max_num_reqs, max_context_len, index_head_dim]`` (+ FP8 scales
        ``[max_num_reqs, max_context_len] float32``) per sparse layer, plus one dump entry
        for padding rows' writes. ``kv_heads``, ``head_dim``, ``dtype`` describe the
        attention cache and are not needed here."""
        check_pool_args(start_layer, end_layer, max_num_reqs=max_num_reqs, max_context_len=max_context_len)
        self.max_num_reqs, self.max_context_len = max_num_reqs, max_context_len
        self._keys_flat, self._scales_flat, self._keys, self._scales, self._indexed = {}, {}, {}, {}, {}
        n = max_num_reqs * max_context_len + 1
        for layer in range(start_layer, end_layer):
            if not self.is_sparse_layer(layer):
                continue
            kf = torch.zeros(n, self.index_head_dim, dtype=self.storage_dtype, device=self.device)
            self._keys_flat[layer] = kf
            self._keys[layer] = kf[:-1].view(max_num_reqs, max_context_len, self.index_head_dim)
            sf = torch.ones(n, dtype=torch.float32, device=self.device) if self.index_dtype == "fp8" else None
            self._scales_flat[layer] = sf
            self._scales[layer] = sf[:-1].view(max_num_reqs, max_context_len) if sf is not None else None
            # entry max_num_reqs counts nothing real: padding rows' counts land there
            self._indexed[layer] = torch.zeros(max_num_reqs + 1, dtype=torch.int64, device=self.device)

    def _layer(self, layer_id: int) -> Optional[torch.Tensor]:
        return self.layer_representation(self._keys, layer_id)

    def _store(self, layer_id: int, rows: torch.Tensor, cols: torch.Tensor, keys: torch.Tensor,
               ok: Optional[torch.Tensor] = None) -> None:
        """Write ``keys [N, Di]`` at ``(rows, cols)``; entries with ``ok`` False go to the
        dump entry instead (no host sync)."""
        pool = self._keys_flat[layer_id]
        flat = rows * self.max_context_len + cols
        if ok is not None:
            flat = torch.where(ok, flat, torch.full_like(flat, pool.shape[0] - 1))
        if self.index_dtype == "fp8":
            q, s = quantize_index_keys(keys)
            pool[flat] = q
            self._scales_flat[layer_id][flat] = s  # type: ignore[index]
        else:
            pool[flat] = keys.to(pool.dtype)

    def _index_keys_kwarg(self, kwargs: dict, shape_desc: str, lead: tuple[int, ...]) -> torch.Tensor:
        k = kwargs.get("index_keys")
        if (not isinstance(k, torch.Tensor) or k.dim() != len(lead) + 1 or tuple(k.shape[:-1]) != lead
                or k.shape[-1] != self.index_head_dim):
            got = tuple(k.shape) if isinstance(k, torch.Tensor) else type(k).__name__
            raise ValueError(f"dsa needs index_keys={shape_desc} with index_head_dim={self.index_head_dim}, got {got}")
        if not k.is_floating_point():
            raise ValueError(f"dsa index_keys must be a floating tensor, got {k.dtype}")
        return k

    def construct_representations(
        self,
        layer_id: int,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        key_buffer: torch.Tensor,
        token_slots: torch.Tensor,
        **kwargs: Any,
    ) -> None:
        """Store ``index_keys [B, max_len, index_head_dim]`` (kwarg) for positions
        ``[represented_lens[b], seq_lens[b])`` (``represented_lens``: 0 when absent; see the
        base class); ``key_buffer`` / ``token_slots`` are not used."""
        pool = self._layer(layer_id)
        if pool is None:
            return
        b = check_batch_rows(req_pool_indices)
        check_int_vector("seq_lens", seq_lens, b)
        ik = kwargs.get("index_keys")
        max_len = ik.shape[1] if isinstance(ik, torch.Tensor) and ik.dim() == 3 else -1
        ik = self._index_keys_kwarg(kwargs, "[B, max_len, index_head_dim]", (b, max_len))
        if max_len > self.max_context_len:
            raise ValueError(f"index_keys has {max_len} positions > max_context_len={self.max_context_len}")
        dev = pool.device
        seq = seq_lens.to(dev).long().clamp(max=max_len)
        req = req_pool_indices.to(dev).long()
        if host_checks_enabled(self.validate):
            raise_if_any([(req >= self.max_num_reqs,
                           f"req_pool_indices must be < max_num_reqs={self.max_num_reqs} (negative: padding row)")])
        live = live_rows(req, self.max_num_reqs)
        pos = torch.arange(max_len, device=dev)[None, :]
        start = torch.tensor(represented_lens_of(kwargs, b, 1), dtype=torch.int64, device=dev)
        valid = (pos < seq[:, None]) & (pos >= start[:, None]) & live[:, None]
        rows = req[:, None].expand(b, max_len)[valid]
        cols = pos.expand(b, max_len)[valid]
        self._store(layer_id, rows, cols, ik.to(dev)[valid])
        # padding rows' counts go to the spare last entry
        self._indexed[layer_id][torch.where(live, req, torch.full_like(req, self.max_num_reqs))] = seq

    def update_representations(
        self,
        layer_id: int,
        req_pool_indices: torch.Tensor,
        positions: torch.Tensor,
        new_keys: torch.Tensor,
        **kwargs: Any,
    ) -> None:
        """Store ``index_keys [B, index_head_dim]`` (kwarg) at ``positions [B]``. Rows with
        ``req_pool_indices < 0`` are padding and change nothing."""
        pool = self._layer(layer_id)
        if pool is None:
            return
        b = check_batch_rows(req_pool_indices)
        check_int_vector("positions", positions, b)
        ik = self._index_keys_kwarg(kwargs, "[B, index_head_dim]", (b,))
        dev = pool.device
        if host_checks_enabled(self.validate):
            pos = positions.to(dev).long()
            req = req_pool_indices.to(dev).long()
            live = live_rows(req, self.max_num_reqs)
            raise_if_any([
                (req >= self.max_num_reqs,
                 f"req_pool_indices must be < max_num_reqs={self.max_num_reqs} (negative: padding row)"),
                (live & ((pos < 0) | (pos >= self.max_context_len)),
                 f"positions must lie in [0, max_context_len={self.max_context_len})"),
            ])
        # padding and (unchecked) out-of-range rows change nothing
        dsa_store_index_keys(self._keys_flat[layer_id], self._scales_flat[layer_id], self._indexed[layer_id],
                             req_pool_indices, positions, ik, max_num_reqs=self.max_num_reqs,
                             max_context_len=self.max_context_len)

    def score(self, queries: torch.Tensor, weights: torch.Tensor, layer_id: int,
              req_pool_indices: torch.Tensor, num_tokens: torch.Tensor) -> torch.Tensor:
        """``[B, max_context_len] float32`` indexer score per token: -inf past
        ``min(num_tokens, tokens indexed)`` and for padding / out-of-range rows."""
        pool = self._layer(layer_id)
        if pool is None:
            raise ValueError(f"layer_id={layer_id} is dense for dsa (dense_layers={self.dense_layers()}): no retrieve_topk there")
        dev = pool.device
        # the kernel reads each row's indexed count and drops padding rows itself
        return dsa_indexer(queries.to(dev), weights.to(dev), pool, self._scales[layer_id], req_pool_indices.to(dev),
                           num_tokens.to(dev), self._indexed[layer_id], fp8_queries=self.index_query_dtype == "fp8")

    def retrieve_topk(
        self,
        queries: torch.Tensor,
        layer_id: int,
        req_pool_indices: torch.Tensor,
        sparse_mask: torch.Tensor,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Top ``top_k`` tokens by indexer score among ``[candidate_start, candidate_end)``.

        queries: index queries ``[B, H_index, index_head_dim]``; kwargs ``weights [B, H_index]``.
        Padding rows (``req_pool_indices < 0``) return ``valid_lengths == 0``.
        """
        ranking = self.selection_ranking(queries, layer_id, req_pool_indices, sparse_mask, **kwargs)
        return ranking.cut(ranking.top_k)

    def selection_ranking(self, queries: torch.Tensor, layer_id: int, req_pool_indices: torch.Tensor,
                          sparse_mask: torch.Tensor, **kwargs: Any) -> TopkRanking:
        """The indexer's scores ``[B, max_context_len] float32`` over the checked inputs of a
        selection (``retrieve_topk``'s arguments): one pass that loading ahead cuts twice."""
        b = check_batch_rows(req_pool_indices, sparse_mask)
        seq_lens, cs, ce, top_k = selection_kwargs(kwargs, b, self.device)
        if (not isinstance(queries, torch.Tensor) or queries.dim() != 3 or queries.shape[0] != b
                or queries.shape[2] != self.index_head_dim or not queries.is_floating_point()):
            got = (tuple(queries.shape), queries.dtype) if isinstance(queries, torch.Tensor) else type(queries).__name__
            raise ValueError(f"dsa queries must be floating index queries [B={b}, H_index, "
                             f"index_head_dim={self.index_head_dim}], got {got}")
        w = kwargs.get("weights")
        if not isinstance(w, torch.Tensor) or w.shape != queries.shape[:2] or not w.is_floating_point():
            got = tuple(w.shape) if isinstance(w, torch.Tensor) else type(w).__name__
            raise ValueError(f"dsa needs weights=[B, H_index]={tuple(queries.shape[:2])}, got {got}")
        if self._layer(layer_id) is None:
            raise ValueError(f"layer_id={layer_id} is dense for dsa (dense_layers={self.dense_layers()}): no retrieve_topk there")
        if host_checks_enabled(self.validate):
            req = req_pool_indices.to(self.device).long()
            live = live_rows(req, self.max_num_reqs)
            # padding rows read the spare count entry, then count 0
            indexed = torch.where(live, self._indexed[layer_id][torch.where(live, req, self.max_num_reqs)], 0)
            wanted = live & sparse_mask.to(self.device).bool() & (ce > cs)
            raise_if_any([
                (req >= self.max_num_reqs,
                 f"req_pool_indices must be < max_num_reqs={self.max_num_reqs} (negative: padding row)"),
                (wanted & (ce > indexed),
                 "dsa: candidate_end exceeds the tokens indexed for a request (index keys and KV "
                 "disagree in length); call construct/update_representations for every token"),
            ])
        # Without the check (no host sync), unindexed positions still score -inf, so a short
        # index can shrink a selection but never select stale keys.
        scores = self.score(queries, w, layer_id, req_pool_indices, seq_lens)
        return TopkRanking(scores, cs, ce, top_k, as_row_mask(sparse_mask, scores.device))

    # -- per-token state: the stored index key (and its FP8 scale) ----------------------
    def token_state_bytes(self) -> int:
        """The index key as stored (``index_head_dim`` elements of the storage dtype), plus
        its float32 scale when FP8: restoring these bytes restores the exact selection."""
        es = torch.empty((), dtype=self.storage_dtype).element_size()
        return self.index_head_dim * es + (4 if self.index_dtype == "fp8" else 0)

    def _state_range(self, layer_id: int, req_pool_index: int, start: int, n: int) -> torch.Tensor:
        keys = self._layer(layer_id)
        if keys is None:
            raise ValueError(f"layer_id={layer_id} is dense: it keeps no index keys")
        if not (isinstance(req_pool_index, int) and 0 <= req_pool_index < self.max_num_reqs):
            raise ValueError(f"req_pool_index={req_pool_index!r} is invalid: an int in [0, {self.max_num_reqs})")
        if not (isinstance(start, int) and start >= 0 and n >= 0 and start + n <= self.max_context_len):
            raise ValueError(f"positions [{start}, {start + n}) are outside [0, max_context_len={self.max_context_len})")
        return keys

    def export_token_state(self, layer_id: int, req_pool_index: int, start: int, end: int) -> torch.Tensor:
        keys = self._state_range(layer_id, req_pool_index, start, end - start)
        parts = [keys[req_pool_index, start:end].contiguous().view(torch.uint8)]
        if self.index_dtype == "fp8":
            sc = self._scales[layer_id][req_pool_index, start:end]  # type: ignore[index]
            parts.append(sc.contiguous().view(torch.uint8).view(end - start, 4))
        return torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]

    def import_token_state(self, layer_id: int, req_pool_index: int, start: int, state: torch.Tensor) -> None:
        width = self.token_state_bytes()
        if not isinstance(state, torch.Tensor) or state.dtype != torch.uint8 or state.dim() != 2 \
                or state.shape[1] != width:
            got = (tuple(state.shape), state.dtype) if isinstance(state, torch.Tensor) else type(state).__name__
            raise ValueError(f"state must be uint8 [n, {width}] (export_token_state's format), got {got}")
        n = state.shape[0]
        keys = self._state_range(layer_id, req_pool_index, start, n)
        state = state.to(keys.device)
        kb = self.index_head_dim * keys.element_size()
        keys[req_pool_index, start:start + n] = state[:, :kb].contiguous().view(keys.dtype)
        if self.index_dtype == "fp8":
            self._scales[layer_id][req_pool_index, start:start + n] = (  # type: ignore[index]
                state[:, kb:].contiguous().view(torch.float32).view(n))
        idx = self._indexed[layer_id]
        idx[req_pool_index] = torch.clamp(idx[req_pool_index], min=start + n)

    def on_request_end(self, req_pool_index: int) -> None:
        """Forget how many tokens of the slot were indexed (the slot's keys are rewritten)."""
        if self._indexed and not (isinstance(req_pool_index, int) and 0 <= req_pool_index < self.max_num_reqs):
            raise ValueError(f"req_pool_index={req_pool_index!r} is invalid: an int in [0, max_num_reqs={self.max_num_reqs})")
        for idx in self._indexed.values():
            idx[req_pool_index] = 0

    def representation_bytes(self) -> int:
        n = sum(t.numel() * t.element_size() for t in self._keys_flat.values())
        return n + sum(t.numel() * t.element_size() for t in self._scales_flat.values() if t is not None)
