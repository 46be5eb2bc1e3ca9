"""DecodeStep: the per-step device tables every layer of one decode forward shares.

Built by ``SparseKVCacheManager.begin_step`` from the step's inputs alone (request rows and
sequence lengths, on the device) and the manager's device tables, with fixed shapes and no
host sync, so a CUDA graph captures it with the rest of the step. Padding rows
(``rows == -1``) have no pages, write their KV to the reserved padding page 0 and back up
nothing.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class DecodeStep:
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
    checked:    value checks that read tensors back to the host run in this step (eager
                steps with validation on; never under capture).
    step:       host step number.
    memo:       per-step values the layers share (selection tables, LRU diff outputs,
                counters), built by the first layer that needs them.
    """

    rows: torch.Tensor
    safe_rows: torch.Tensor
    live: torch.Tensor
    seq_lens: torch.Tensor
    num_pages: torch.Tensor
    out_loc: torch.Tensor
    dense_loc: Optional[torch.Tensor] = None
    host_loc: Optional[torch.Tensor] = None
    dense_rows: Optional[torch.Tensor] = None
    checked: bool = True
    step: int = 0
    memo: dict = dataclasses.field(default_factory=dict)

    @property
    def batch_size(self) -> int:
        return int(self.rows.shape[0])


@dataclass
class StepTables:
    """Per-step, layer-independent tensors of the sparse selection (``B`` rows, ``K`` top-k),
    built by ``begin_step`` in the same launch as the step's write locations and kept in
    ``DecodeStep.memo["sparse_tables"]``.

    cs / ce:     ``[B] int32`` candidate range: ``cs`` = sink pages in context, ``ce`` = the
                 recent window's first page.
    ncand:       ``[B] int32`` candidates of rows that are not sparse (0 for dense rows).
    all_ids:     ``[B, K] int32`` every candidate (``cs + k`` for ``k < ncand``, else -1), the
                 selection of rows that are not sparse.
    sparse_mask: ``[B] bool`` rows whose candidates outgrow top-k (never dense rows).
    use:         ``[B] bool`` rows that take the algorithm's selection (sparse and live).
    colk:        ``[1, K] int32`` column index (shared, read-only).
    """

    cs: torch.Tensor
    ce: torch.Tensor
    ncand: torch.Tensor
    all_ids: torch.Tensor
    sparse_mask: torch.Tensor
    use: torch.Tensor
    colk: torch.Tensor
