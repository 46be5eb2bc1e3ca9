"""Which of SGLang's virtual KV pages are on the GPU for the bridge: pins over rows'
positions, prefix hits brought back from host, and pins that follow the slots SGLang's
tree swaps in at a checkpoint."""
from __future__ import annotations

from typing import Any, Optional

import numpy as np
import torch

from sparsehi.sglang_plugin import sglang_api
from sparsehi.sglang_plugin.bridge_memory import round_up


class GpuPagePins:
    """The bridge's page pins (a base of ``SGLangSparseBridge``, whose set-up makes what
    these methods read: ``residency``, ``transfer``, ``req_to_token_pool``, ``sgl_ps``, the
    per-row ``pinned_len`` / ``registered`` / ``slot_of_row`` / ``open_pos`` and ``coord``)."""

    def _row_positions(self, rows: np.ndarray, starts: np.ndarray, ends: np.ndarray,
                       every_token: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """(rows, positions) over ``[start, end)`` of each row: every position with
        ``every_token``, else the positions that start a page (one per page: a row's pins
        cover the pages of ``[0, n)`` named by their first positions)."""
        out_r, out_p = [], []
        step = 1 if every_token else self.sgl_ps
        for r, a, b in zip(rows, starts, ends):
            first = int(a) if every_token else round_up(int(a), self.sgl_ps)
            p = np.arange(first, int(b), step, dtype=np.int64)
            out_r.append(np.full(len(p), r, dtype=np.int64))
            out_p.append(p)
        if not out_r:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
        return np.concatenate(out_r), np.concatenate(out_p)

    def _page_start(self, pos: np.ndarray) -> np.ndarray:
        return pos - pos % self.sgl_ps

    def _vids(self, rows: np.ndarray, pos: np.ndarray) -> torch.Tensor:
        """``req_to_token[rows, pos]`` as int64 on the device (call under ``residency.ordered``)."""
        rtt = self.req_to_token_pool.req_to_token
        r = torch.from_numpy(rows).to(rtt.device, non_blocking=True)
        p = torch.from_numpy(pos).to(rtt.device, non_blocking=True)
        return rtt[r, p].long()

    def _vpages(self, vids: torch.Tensor) -> torch.Tensor:
        return vids if self.sgl_ps == 1 else torch.div(vids, self.sgl_ps, rounding_mode="floor")

    def _pin(self, rows: np.ndarray, starts: np.ndarray, ends: np.ndarray, delta: int = 1,
             counted: bool = False) -> None:
        """Add (``delta`` 1) or remove (-1: pages left with no pins leave the GPU) one pin on
        each page of ``[start, end)`` of each row. ``counted``: a give-back SGLang's
        admission should hear of (``KVResidency.frees_pending``)."""
        r, p = self._row_positions(rows, starts, ends)
        if not len(r):
            return
        with self.residency.ordered():
            pages = self._vpages(self._vids(r, p))
        if delta > 0:
            self.residency.pin(pages)
        else:
            self.residency.demote(pages, unpin=True, counted=counted)

    def _map_and_load(self, vids: torch.Tensor, missing: torch.Tensor, upper: int) -> None:
        """Give the virtual pages of ``vids`` ([N] int64 token slots) GPU pages (at most
        ``upper`` new ones) and load from host the tokens whose page was not on the GPU
        (``missing`` [N] bool)."""
        self.residency.map(self._vpages(vids), upper=upper)
        self.residency.ready()
        phys = self.residency.physical_slots(vids, self.sgl_ps)
        host = torch.where(missing & (phys >= 0), vids, -1)
        with self.residency.ordered():
            self.transfer.load(host, torch.where(host >= 0, phys, -1), allow_padding=True).wait()

    def _bring_back(self, rows: np.ndarray, prefix: np.ndarray) -> None:
        """Prefix hits: the prefix pages of ``rows`` that are only in host memory get GPU
        pages and their KV, before the extend forward reads them."""
        r, p = self._row_positions(rows, np.zeros_like(prefix), prefix, every_token=True)
        if not len(r):
            return
        pages = round_up(int(prefix.sum()), 1) if self.sgl_ps == 1 else int(sum(-(-int(x) // self.sgl_ps) + 1
                                                                                  for x in prefix))
        if self.residency.free_pages_lower_bound() < pages and self.residency.settle(exact=True) < pages:
            raise RuntimeError(f"sparsehi: {pages} GPU pages needed to bring a prefix hit back, "
                               f"{self.residency.free_pages_lower_bound()} free (admission should have kept them)")
        with self.residency.ordered():
            vids = self._vids(r, p)
            missing = self.residency.v2p[self._vpages(vids)] == 0
        self._map_and_load(vids, missing, upper=pages)

    # ------------------------------------------------------------------ tree checkpoints
    def before_checkpoint(self, req: Any) -> Optional[tuple[int, int, torch.Tensor]]:
        """Before SGLang's tree checkpoints ``req``: its stream waits for our reads of the
        row; returns what ``after_checkpoint`` compares (None: a row of no interest)."""
        self.residency.ready()
        row = sglang_api.req_row(req)
        if row is None or not (self.pinned_len[row] > 0 or self.registered[row]):
            return None
        start = sglang_api.req_protected_len(req)
        with self.residency.ordered():
            old = self.req_to_token_pool.req_to_token[row, start:].clone()
        return row, start, old

    def after_checkpoint(self, req: Any, token: Optional[tuple[int, int, torch.Tensor]]) -> None:
        """After SGLang's tree checkpointed ``req``: positions whose slots it replaced by the
        tree's own (a prefix another request inserted first, same KV) are followed — pins
        move to the new slots (brought back to the GPU if needed), a registered row's token
        table takes them."""
        if token is None:
            return
        row, start, old = token
        end = sglang_api.req_protected_len(req)
        if end <= start:
            return
        rtt = self.req_to_token_pool.req_to_token
        if self.registered[row]:
            slot = int(self.slot_of_row[row])
            p = int(self.open_pos[row])
            with self.residency.ordered():
                self.coord.rewrite_host_tokens(slot, start, end, rtt[row, start:end])
                if start <= p < end:  # the page the row pins (its newest token's) may be the tree's now
                    now = rtt[row, p:p + 1].long()
                    moved = torch.where(now != old[p - start:p - start + 1].long(), self._vpages(now), 0)
            if start <= p < end:
                self.residency.pin(moved)  # the old page's pin goes with its slots (freed as a duplicate)
            return
        n = min(end, int(self.pinned_len[row]))
        if n <= start:
            return
        pos = np.arange(start, n, dtype=np.int64)
        with self.residency.ordered():
            new = rtt[row, start:n].long()
            changed = new != old[: n - start].long()
            vids = torch.where(changed, new, 0)
        # GPU pages the rewrite may take: at most one per page of [start, n), known on the
        # host; where fewer are free, the pages that really take one (changed positions
        # whose tree copy is not on the GPU, usually none) are counted instead (a host
        # read, only when GPU pages are short)
        need = -(-n // self.sgl_ps) - start // self.sgl_ps
        if self.residency.free_pages_lower_bound() < need:
            self.residency.settle(exact=True)
        with self.residency.ordered():
            missing = (self.residency.v2p[self._vpages(vids)] == 0) & (vids > 0)
            if self.residency.free_pages_lower_bound() < need:
                need = int(torch.unique(self._vpages(vids[missing])).numel())
        self._map_and_load(vids, missing, upper=need)
        opens = torch.from_numpy((pos % self.sgl_ps == 0) | (pos == start)).to(vids.device)
        self.residency.pin(torch.where(changed & opens, self._vpages(vids), 0))

