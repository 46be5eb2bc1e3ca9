"""The swap-in of a hierarchical sparse layer: LRU diff, copy of the misses, page table.

``SwapInMixin`` holds the decode-path methods of ``SparseKVCacheManager`` that make a
layer's Top-k selection resident in its LRU buffer (``swap_in``, ``swap_in_table``) or map
it to physical pages (``sparse_physical``), and their checks. They use the manager's tables
(``host_page_table``, ``buf_pages``, sink and ring tables), its per-layer LRU state and the
step's shared buffers; graph-safe unless the step is ``checked``.
"""
from __future__ import annotations

from typing import Optional

import torch

from sparsehi.decode_step import DecodeStep
from sparsehi.kernels.lru_diff import LruDiffResult, check_lru_diff_values, lru_diff
from sparsehi.kernels.selection_table import SelectionTable, selection_table
from sparsehi.kernels.swap_in_copy import swap_in_copy
from sparsehi.kernels.swap_in_fused import swap_in_copy_and_table
from sparsehi.row_choice import RowChoice
from sparsehi.swap_in_stats import StepCounts


class SwapInMixin:
    """Swap-in methods of ``SparseKVCacheManager`` (see the module docstring)."""

    def check_topk(self, step: DecodeStep, topk: torch.Tensor, valid: torch.Tensor,
                   candidate_end: Optional[torch.Tensor] = None) -> None:
        """Shape check, and value checks (host reads) when the step is ``checked``: ``K <=
        S``, ``valid`` ids then -1, ids below ``candidate_end`` (default: the pages in
        context), no duplicates, distinct live rows. Raises ValueError before any state moves."""
        if topk.shape[1] > self.S:
            raise ValueError(f"topk width K={topk.shape[1]} exceeds buffer slots S={self.S}: K must be <= S")
        if step.checked:
            lim = candidate_end if candidate_end is not None else step.num_pages
            check_lru_diff_values(topk, valid, lim.to(topk.device), rows=step.rows if self.hier else None,
                                  num_rows=self.max_num_reqs)

    def sparse_physical(self, layer: int, step: DecodeStep, topk: torch.Tensor, valid: torch.Tensor,
                        candidate_end: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Physical pages ``[B, K] int32`` of the top-k ids of a sparse layer.

        Hierarchical: ``swap_in`` (LRU diff, copy of the misses, counters), then the pages
        of the slots. gpu_only: the request's own pages. ``topk`` ``[B, K] int32`` -1
        padded; padding rows must have ``valid == 0``.
        """
        self.check_topk(step, topk, valid, candidate_end)
        if not self.hier:
            return self.own_physical(layer, step, topk)
        slots = self.swap_in(layer, step, topk, valid).long()
        pages = self.buf_pages.long()[step.safe_rows[:, None], slots.clamp(min=0)]
        return torch.where(slots >= 0, pages, -1).to(torch.int32)

    def swap_in(self, layer: int, step: DecodeStep, topk: torch.Tensor, valid: torch.Tensor,
                choice: Optional[RowChoice] = None) -> torch.Tensor:
        """Hierarchical sparse layer: make ``topk [B, K] int32`` (-1 padded, ``valid [B]``)
        resident in the layer's LRU buffer — the LRU diff (one launch) and the host->device
        copy of the misses straight from its output (one launch) — and return each id's
        buffer slot ``[B, K] int32`` (-1 padded; its page is ``buf_pages[row, slot]``).
        ``choice``: rows that do not use ``topk`` take ``choice.ids`` (row_choice.py).
        Value checks are the caller's (``sparse_physical``)."""
        r = self._lru_diff(layer, step, topk, valid, choice)
        if self._fused_copy:
            swap_in_copy(self._host_view, self._dev_view, layer, r.load_ids, r.load_slots, r.num_loads, step.rows,
                         self.host_page_table, self.buf_pages, self.ps, **self._host_addressing())
        else:  # io_backend "direct" on CUDA: the engine's host-side path (not graph-capturable)
            self._load_through_engine(layer, step, r)
        return r.device_slots

    def swap_in_table(self, layer: int, step: DecodeStep, topk: torch.Tensor, valid: torch.Tensor,
                      choice: Optional[RowChoice] = None) -> SelectionTable:
        """``swap_in`` and the layer's selection table (sink pages, ``topk``'s buffer pages,
        recent pages: what attention reads) with the copy and the table in one launch after
        the diff (``swap_in_copy_and_table``). ``topk`` ascending ids; ``choice``: rows that
        do not use ``topk`` / ``valid`` take ``choice.ids`` / ``choice.count``, read by the
        diff and the table themselves (no substitution launch)."""
        if not self._fused_copy:
            slots = self.swap_in(layer, step, topk, valid, choice)
            return selection_table(topk, valid, step.num_pages, step.seq_lens, step.safe_rows, sink=self.sink,
                                   recent=self.R, page_size=self.ps, sink_table=self.sink_table,
                                   ring_table=self.ring_table, topk_phys=slots, slot_table=self.buf_pages,
                                   choice=choice)
        r = self._lru_diff(layer, step, topk, valid, choice)
        return swap_in_copy_and_table(self._host_view, self._dev_view, layer, r.load_ids, r.load_slots, r.num_loads,
                                      step.rows, self.host_page_table, self.buf_pages, self.ps, topk, valid,
                                      step.num_pages, step.seq_lens, step.safe_rows, sink=self.sink, recent=self.R,
                                      sink_table=self.sink_table, ring_table=self.ring_table,
                                      device_slots=r.device_slots, choice=choice, **self._host_addressing())

    def _host_addressing(self) -> dict:
        """The copy kernels' host addressing: per page (none), or per token from the token
        table, with the engine's GPU residency (misses still on the GPU read from there)."""
        if not self.host_tokens:
            return {}
        return {"host_tokens": self.host_token_table[: self.max_num_reqs], "resident": self.resident}

    def _lru_diff(self, layer: int, step: DecodeStep, topk: torch.Tensor, valid: torch.Tensor,
                  choice: Optional[RowChoice] = None) -> LruDiffResult:
        """The layer's LRU diff for this step (outputs in the step's shared buffers)."""
        li = self.layer_index.get(layer)
        if li is None:
            raise ValueError(f"layer_id={layer} is not a sparse layer (sparse layers: {self.sparse_layers})")
        if step.checked:
            if self._diff_step.get(layer) == step.step:
                # A second diff with the same step would see its own hits as "used this step"
                # and corrupt the LRU state (and read stale load slots).
                raise ValueError(f"layer_id={layer} already ran its LRU diff in decode step {step.step}: each sparse "
                                 f"layer runs once per step (begin_decode starts the next step)")
            self._diff_step[layer] = step.step
        res, lu, so = self.lru.layer(li)
        B, K = topk.shape
        out = step.memo.get("lru_out")
        if out is None or out.shape[1:] != (B, K):
            # one set of diff outputs per step: a layer's copy reads them before the next
            # layer's diff is queued on the same stream
            out = step.memo["lru_out"] = torch.empty(3, B, K, dtype=torch.int32, device=topk.device)
        counts: StepCounts = step.memo["counts"]
        return lru_diff(topk, valid, res, lu, so, self.step_t, rows=step.rows,
                        out=LruDiffResult(out[0], out[1], out[2], counts.loads[li], counts.valid[li]), choice=choice)

    def _load_through_engine(self, layer: int, step: DecodeStep, r: LruDiffResult) -> None:
        rows = step.safe_rows[:, None]
        ok = r.load_ids >= 0
        hp = torch.where(ok, self.host_page_table[rows, r.load_ids.long().clamp(min=0)], -1)
        dp = torch.where(ok, self.buf_pages.long()[rows, r.load_slots.long().clamp(min=0)], -1)
        slots = torch.stack([hp, dp])[..., None] * self.ps + self._offsets
        slots = torch.where(torch.stack([ok, ok])[..., None], slots, -1).view(2, -1)
        self.transfer.load_layer_now(layer, slots[0], slots[1])
