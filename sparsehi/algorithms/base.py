"""BaseSparseAlgorithm: the one class an algorithm author subclasses.

The signatures follow SGLang's sparse framework (``sglang.srt.mem_cache.sparsity``) so an
algorithm written for one runs in the other. An algorithm decides *what* to attend to;
it knows nothing of attention backends, host memory or buffers (the coordinator joins
those).

Units. ``SparseMode.PAGE_WISE`` algorithms score and return logical **page** ids
(``token_position // page_size``); ``TOKEN_WISE`` ones return logical **token** positions
(they run with ``page_size == 1``).

Candidates. Sink ids (the first ``config.sink_units``) and the recent window (the last
``config.recent_units``, the page being written included) are always attended and are
added by the coordinator; ``retrieve_topk`` picks among the ids in
``[candidate_start, candidate_end)`` only, at most ``top_k`` of them, no duplicates.

Memory. Representations (Quest: per-page key min/max; DSA: index keys) live on the GPU,
indexed by ``(req_pool_index, logical id)``; ``initialize_representation_pool`` reserves
them once, for ``max_num_reqs`` request slots of up to ``max_context_len`` tokens.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

from sparsehi.kernels.topk import topk_select
from sparsehi.selection import SparseMode

if TYPE_CHECKING:
    from sparsehi.config import SparseConfig


@dataclass
class TopkRanking:
    """Scores a selection cuts with ``topk_select``: ``scores [B, N] float32`` over ids
    ``[0, N)``, the selectable ``[candidate_start, candidate_end)`` (``[B] int32`` each),
    ``top_k`` and the rows that select (``row_mask [B] bool`` or None)."""

    scores: torch.Tensor
    candidate_start: torch.Tensor
    candidate_end: torch.Tensor
    top_k: int
    row_mask: Optional[torch.Tensor]

    def cut(self, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The best ``top_k`` ids of each row (``[B, top_k] int32`` ascending, -1 padded;
        ``[B] int32`` counts), ties to the lower id."""
        return topk_select(self.scores, top_k, self.candidate_start, self.candidate_end, self.row_mask)


class BaseSparseAlgorithm(ABC):
    """A Top-k selection policy.

    Subclasses set ``mode`` and implement the four abstract methods. Shapes below use
    ``B`` = batch rows of the call, ``Hq`` query heads, ``Hkv`` key heads, ``D`` head dim.
    """

    mode: SparseMode = SparseMode.PAGE_WISE
    default_dense_layers: tuple[int, ...] = ()
    selects_ascending: bool = False
    """Set True when ``retrieve_topk`` returns each row's ids in ascending order (the
    contract allows any order): the coordinator then skips its sort of the selection."""
    supports_chunked_prefill: bool = False
    """Set True when ``construct_representations`` honours ``represented_lens`` (see there):
    only then may a hierarchical prompt be prefilled in chunks whose earlier KV has left the
    GPU (the coordinator refuses such a chunk otherwise)."""

    def __init__(self, config: "SparseConfig", device: torch.device, **kwargs: Any) -> None:
        self.config = config
        self.device = torch.device(device)
        if self.mode is SparseMode.TOKEN_WISE and config.page_size != 1:
            raise ValueError(
                f"{type(self).__name__} is token-wise: SparseConfig.page_size must be 1, "
                f"got {config.page_size}"
            )

    # ------------------------------------------------------------------ layers
    def dense_layers(self) -> tuple[int, ...]:
        """Layers that attend densely (config overrides the algorithm default)."""
        if self.config.dense_layers is not None:
            return tuple(self.config.dense_layers)
        return tuple(self.default_dense_layers)

    def is_sparse_layer(self, layer_id: int) -> bool:
        return layer_id not in self.dense_layers()

    def layer_representation(self, pools: dict[int, Any], layer_id: int) -> Any:
        """``pools[layer_id]``; None for a dense layer (nothing to build or score); a
        ValueError for a sparse layer that initialize_representation_pool did not reserve."""
        if layer_id in pools:
            return pools[layer_id]
        if not self.is_sparse_layer(layer_id):
            return None
        raise ValueError(f"layer_id={layer_id} has no representation pool: reserved layers are {sorted(pools)}")

    # ------------------------------------------------------------------ hooks
    @abstractmethod
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
        """Reserve GPU memory for representations of layers ``[start_layer, end_layer)``.

        Called once before any request. ``max_num_reqs`` bounds ``req_pool_indices``;
        ``max_context_len`` bounds logical token positions.
        """

    @abstractmethod
    def construct_representations(
        self,
        layer_id: int,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        key_buffer: torch.Tensor,
        token_slots: torch.Tensor,
        **kwargs: Any,
    ) -> None:
        """Build representations after prefill of one layer.

        req_pool_indices: ``[B] int64`` request slots.
        seq_lens:         ``[B] int32`` tokens prefilled per request.
        key_buffer:       ``[num_slots, Hkv, D]`` the layer's key cache in the device pool
                          (MLA: ``[num_slots, 1, kv_lora_rank + rope_dim]``).
        token_slots:      ``[B, max_len] int64`` device slot of each token position
                          (row ``b`` valid up to ``seq_lens[b]``).
        kwargs:           algorithm-specific model outputs, e.g. DSA's ``index_keys``
                          ``[B, max_len, index_head_dim]``; and, for a chunk of a prompt
                          prefilled in chunks (only to algorithms that set
                          ``supports_chunked_prefill``), ``represented_lens`` ``[B] int32``
                          (CPU): row ``b``'s positions below it were represented by an
                          earlier chunk (a multiple of ``page_size``; 0: none) and are kept;
                          ``token_slots`` and ``index_keys`` are valid (and read) only from
                          there (``token_slots`` holds ``-1`` before it).
        """

    @abstractmethod
    def update_representations(
        self,
        layer_id: int,
        req_pool_indices: torch.Tensor,
        positions: torch.Tensor,
        new_keys: torch.Tensor,
        **kwargs: Any,
    ) -> None:
        """Fold one decoded token per request into the representations.

        positions: ``[B] int64`` logical token position of the new token.
        new_keys:  ``[B, Hkv, D]`` its key (post-RoPE, as stored in the cache).
        kwargs:    e.g. DSA's ``index_keys`` ``[B, index_head_dim]``.
        """

    @abstractmethod
    def retrieve_topk(
        self,
        queries: torch.Tensor,
        layer_id: int,
        req_pool_indices: torch.Tensor,
        sparse_mask: torch.Tensor,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Select the ids to attend to for one decode step of one layer.

        queries:          ``[B, Hq, D]`` (DSA: index queries ``[B, H_index, index_head_dim]``).
        req_pool_indices: ``[B] int64``.
        sparse_mask:      ``[B] bool``; rows with False get ``valid_lengths == 0``.
        kwargs (always passed by the coordinator):
            seq_lens        ``[B] int32`` tokens in context, the new token included;
            candidate_start ``[B] int32`` first selectable id;
            candidate_end   ``[B] int32`` one past the last selectable id;
            top_k           ``int`` maximum ids to return per row (selection units).
          DSA also gets ``weights`` ``[B, H_index]``.

        Returns ``(selected_indices [B, top_k] int32`` ids in ``[candidate_start,
        candidate_end)``, unique per row, ``-1`` padded, in any order,
        ``valid_lengths [B] int32)``.
        """

    def retrieve_topk_and_lookahead(
        self,
        queries: torch.Tensor,
        layer_id: int,
        req_pool_indices: torch.Tensor,
        sparse_mask: torch.Tensor,
        *,
        lookahead_top_k: int,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor, Callable[[], tuple[torch.Tensor, torch.Tensor]]]:
        """``retrieve_topk`` (same arguments and results), and a function that returns the
        Top-``lookahead_top_k`` ids of the same call ``(ids [B, lookahead_top_k] int32,
        valid [B] int32)``: the pages the coordinator loads ahead for the next step
        (``SparseConfig.lookahead_tokens``). That set must contain every id of the
        selection (a ranking cut further down). The function may run later and on another
        CUDA stream; it must not depend on state the next layer changes.

        Default: one ranking cut twice where ``selection_ranking`` gives one (Quest, DSA: one
        scoring pass; the function holds the scores), else ``retrieve_topk`` again with
        ``top_k=lookahead_top_k``, which holds the contract for any algorithm whose
        selection is the best ``top_k`` of a deterministic ranking whose ties break the same
        way at every ``top_k`` (``topk_select``: the lower id first; ``torch.topk`` does not
        promise it). Checked eager steps verify the containment; without checks a set that
        misses a selected page lets the load ahead evict it while the layer attends it."""
        ranking = self.selection_ranking(queries, layer_id, req_pool_indices, sparse_mask, **kwargs)
        if ranking is not None:
            sel, val = ranking.cut(ranking.top_k)
            return sel, val, lambda: ranking.cut(lookahead_top_k)
        sel, val = self.retrieve_topk(queries, layer_id, req_pool_indices, sparse_mask, **kwargs)
        ahead_kw = {**kwargs, "top_k": lookahead_top_k}
        return sel, val, lambda: self.retrieve_topk(queries, layer_id, req_pool_indices, sparse_mask, **ahead_kw)

    def selection_ranking(self, queries: torch.Tensor, layer_id: int, req_pool_indices: torch.Tensor,
                          sparse_mask: torch.Tensor, **kwargs: Any) -> Optional[TopkRanking]:
        """The scores whose ``TopkRanking.cut(top_k)`` is ``retrieve_topk``'s selection for
        the same arguments, or None (the default: the algorithm ranks some other way)."""
        return None

    # ------------------------------------------------------------------ per-token state
    def token_state_bytes(self) -> int:
        """Bytes per token and sparse layer of representation state that cannot be rebuilt
        from the KV cache (0: none — ``construct_representations`` rebuilds everything from
        the keys, as Quest does). A runtime that reuses a cached prefix keeps this state with
        the prefix's KV (host pool, L3) and restores it with ``import_token_state``."""
        return 0

    def export_token_state(self, layer_id: int, req_pool_index: int, start: int, end: int) -> torch.Tensor:
        """``uint8 [end - start, token_state_bytes()]`` (on the algorithm's device): the state
        of positions ``[start, end)`` of request slot ``req_pool_index`` in sparse layer
        ``layer_id``. Called outside decode steps (prefill end, request end)."""
        raise NotImplementedError(f"{type(self).__name__} keeps no per-token state (token_state_bytes() == 0)")

    def import_token_state(self, layer_id: int, req_pool_index: int, start: int, state: torch.Tensor) -> None:
        """Restore ``state`` (``uint8 [n, token_state_bytes()]``, from ``export_token_state``)
        at positions ``[start, start + n)`` of the slot, which then count as represented.
        Called at prefill, after ``construct_representations`` of that layer."""
        raise NotImplementedError(f"{type(self).__name__} keeps no per-token state (token_state_bytes() == 0)")

    # ------------------------------------------------------------------ lifecycle
    def on_request_end(self, req_pool_index: int) -> None:
        """Forget a request's representations (optional)."""

    def representation_bytes(self) -> int:
        """GPU bytes reserved for representations (reported in benchmarks)."""
        return 0


def check_pool_args(start_layer: int, end_layer: int, **sizes: int) -> None:
    """Arguments of ``initialize_representation_pool``: every ``sizes`` value an integer
    > 0 and ``[start_layer, end_layer)`` a non-empty range >= 0. Raises ValueError naming
    the parameter (shared by the built-in algorithms; authors may call it too)."""
    for name, v in sizes.items():
        if not isinstance(v, int) or v <= 0:
            raise ValueError(f"{name}={v!r} is invalid: an integer > 0")
    if not (0 <= start_layer < end_layer):
        raise ValueError(f"layers [start_layer={start_layer}, end_layer={end_layer}) must be a non-empty range >= 0")


def represented_lens_of(kwargs: dict, batch: int, page_size: int) -> list[int]:
    """``construct_representations``' ``represented_lens`` kwarg as a list of ``batch`` ints
    (all 0 when absent). Raises ValueError unless it is ``[B]`` integer, each value ``>= 0``
    and a multiple of ``page_size``."""
    lens = kwargs.get("represented_lens")
    if lens is None:
        return [0] * batch
    if not isinstance(lens, torch.Tensor) or lens.shape != (batch,) or lens.is_floating_point():
        got = tuple(lens.shape) if isinstance(lens, torch.Tensor) else type(lens).__name__
        raise ValueError(f"represented_lens must be [B={batch}] int32, got {got}")
    out = [int(x) for x in lens.tolist()]
    if any(x < 0 or x % page_size for x in out):
        raise ValueError(f"represented_lens={out} must be multiples of page_size={page_size}, >= 0")
    return out


def check_selection(
    selected: torch.Tensor,
    valid: torch.Tensor,
    top_k: int,
    candidate_start: Optional[torch.Tensor] = None,
    candidate_end: Optional[torch.Tensor] = None,
) -> None:
    """Raise ValueError if a retrieve_topk result breaks the contract (used by the
    coordinator in debug mode and by the author test kit)."""
    if selected.dtype != torch.int32 or valid.dtype != torch.int32:
        raise ValueError(
            f"retrieve_topk must return int32 tensors, got selected_indices={selected.dtype}, "
            f"valid_lengths={valid.dtype}"
        )
    if selected.dim() != 2 or selected.shape[1] > top_k:
        raise ValueError(f"selected_indices must be [B, <= top_k={top_k}], got {tuple(selected.shape)}")
    if valid.shape != (selected.shape[0],):
        raise ValueError(f"valid_lengths must be [B={selected.shape[0]}], got {tuple(valid.shape)}")
    v = valid.long()
    if bool(((v < 0) | (v > selected.shape[1])).any()):
        raise ValueError(f"valid_lengths must lie in [0, {selected.shape[1]}] (the columns of selected_indices, "
                         f"at most top_k={top_k}), got {valid.tolist()}")
    cols = torch.arange(selected.shape[1], device=selected.device)[None, :]
    in_range = cols < v[:, None]
    if bool(((selected >= 0) != in_range).any()):
        raise ValueError("selected_indices must hold valid_lengths ids then -1 padding in every row")
    if candidate_start is not None and candidate_end is not None:
        lo = candidate_start[:, None].long()
        hi = candidate_end[:, None].long()
        s = selected.long()
        if bool((in_range & ((s < lo) | (s >= hi))).any()):
            raise ValueError("selected_indices hold ids outside [candidate_start, candidate_end)")
    srt, _ = torch.sort(torch.where(in_range, selected.long(), -1 - cols), dim=1)
    if bool((srt[:, 1:] == srt[:, :-1]).any()):
        raise ValueError("selected_indices hold duplicate ids in a row")
