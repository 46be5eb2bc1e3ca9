"""The typed state of one decode step, shared by every layer of that step.

Built by ``SparseDecoder.begin_step`` from the step's inputs alone (request rows and
sequence lengths, on the device) and the page tables, with fixed shapes and no host sync,
so a CUDA graph captures it with the rest of the step. Padding rows (``rows == -1``) have
no pages, write their KV to the reserved padding page 0 and back up nothing.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from sparsehi.selection import SparseSelection
from sparsehi.swap_in_stats import StepCounts

__all__ = ["CandidateTables", "DecodeState"]


@dataclass
class CandidateTables:
    """Per-step, layer-independent tensors of the sparse layers' selection (``B`` rows,
    ``K`` top-k), built in the same launch as the step's write locations.

    candidate_start: ``[B] int32`` first candidate id (= the sink pages in context).
    candidate_end:   ``[B] int32`` end of the candidates (= the recent window's first page).
    num_candidates:  ``[B] int32`` candidates of rows that are not sparse (0 for dense rows).
    all_candidates:  ``[B, K] int32`` every candidate (``candidate_start + k`` for
                     ``k < num_candidates``, else -1): the selection of rows that are not sparse.
    sparse_rows:     ``[B] bool`` rows whose candidates outgrow top-k (never dense rows).
    uses_selection:  ``[B] bool`` rows that take the algorithm's selection (sparse and live).
    columns:         ``[1, K] int32`` column index (shared, read-only).
    """

    candidate_start: torch.Tensor
    candidate_end: torch.Tensor
    num_candidates: torch.Tensor
    all_candidates: torch.Tensor
    sparse_rows: torch.Tensor
    uses_selection: torch.Tensor
    columns: torch.Tensor


@dataclass
class DecodeState:
    """One decode step of a batch (``B`` rows, padding rows included).

    rows:       ``[B] int64`` request rows, ``-1`` for padding rows.
    safe_rows:  ``[B] int64`` the same with padding mapped to row 0 (table reads; whatever
                they read for a padding row is masked).
    live:       ``[B] bool`` rows that are real requests.
    seq_lens:   ``[B] int32`` tokens in context, the new one included.
    num_pages:  ``[B] int32`` logical pages in context (0 for padding rows).
    out_loc:    ``[B] int64`` main-pool slot of the new token (hierarchical sparse rows:
                sink page or recent ring; gpu_only and dense rows: the request's page;
                padding rows: slot 0).
    dense_loc:  ``[B] int64`` dense-layer pool slot of the new token (hierarchical), or None.
    host_loc:   ``[B] int64`` host slot of the new token (hierarchical; ``-1`` padding), or None.
    dense_rows: ``[B] bool`` rows decoded densely (prompt shorter than
                ``min_sparse_prompt_len``), or None when no row of the batch is (a host fact,
                fixed for a captured graph).
    candidates: the sparse layers' candidate tables.
    counts:     the step's per-layer hit / miss tables (folded by ``end_step``).
    checked:    value checks that read tensors back to the host run in this step (eager
                steps with validation on; never under capture).
    step:       host step number.

    Built by the first layer that needs them, then shared by the others:
    lru_out:                ``[3, B, K] int32`` the LRU diff's outputs (device slots, load
                            ids, load slots); each sparse layer's copy reads them before
                            the next layer's diff is queued on the same stream. Loading
                            ahead on: ``[n_sparse, 3, B, K]``, one plane per sparse layer
                            (the side stream reads a layer's after the next layer's diff).
    dense_layer_selection:  every page of every row for the dense layers, and
    dense_layer_metadata:   its adapter metadata.
    dense_row_selection:    every page of every row for the sparse layers' dense rows.
    completed_pages:        FP8 host KV (hierarchical): ``(host_pages, main_pool_pages,
                            dense_pool_pages)``, each ``[B] int64``, the pages this step's
                            token completes (``-1`` where none), made once for every layer.
    """

    rows: torch.Tensor
    safe_rows: torch.Tensor
    live: torch.Tensor
    seq_lens: torch.Tensor
    num_pages: torch.Tensor
    out_loc: torch.Tensor
    candidates: CandidateTables
    counts: StepCounts
    dense_loc: Optional[torch.Tensor] = None
    host_loc: Optional[torch.Tensor] = None
    dense_rows: Optional[torch.Tensor] = None
    checked: bool = True
    step: int = 0
    lru_out: Optional[torch.Tensor] = None
    dense_layer_selection: Optional[SparseSelection] = None
    dense_layer_metadata: Any = None
    dense_row_selection: Optional[SparseSelection] = None
    completed_pages: Optional[tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]] = None
