"""Loading ahead: the pages a sparse layer ranked just after its selection, copied into the
layer's GPU buffer while the step goes on, for the next step to find resident.

After a layer's selection is resident (its LRU diff and the misses' copy, on the step's
stream), ``LoadAhead.launch`` queues on a side stream:

1. the Top-``top_k + lookahead`` set of the same ranking (the algorithm's
   ``retrieve_topk_and_lookahead``), which contains the selection;
2. an LRU diff of that set with the step's own stamp: the selection's pages are its hits,
   so its victims are slots this step did not select, and the pages it installs are the
   runners-up that were not resident (the kernel and its reference agree on a second diff
   of a step whose set contains the first; tests/test_load_ahead.py);
3. the copy of those pages from host (the swap-in's copy kernel, without a table, in a
   few looping programs: ``COPY_PROGRAMS_PER_ROW``);
4. the counters: the selection's hits that an earlier load ahead brought in (``hidden``,
   misses taken off the critical path) and this step's loads ahead, through per-row marks
   (``sparsehi/kernels/lookahead_marks.py``).

Nothing on the step's stream reads what the side stream writes before ``join`` (the
attention of this layer reads only the selection's slots, which the second diff never
evicts), and ``join`` makes the step's stream wait for it: ``end_step`` calls it, inside the
step's CUDA graph, so a replay holds both streams. Tensors the side stream reads are held
until the join, so no allocation of the step reuses their memory while it runs. Without
CUDA the same work runs in order on the one stream.
"""
from __future__ import annotations

from contextlib import nullcontext
from typing import Callable, Optional

import torch

from sparsehi.decode.state import DecodeState
from sparsehi.kernels.lookahead_marks import fold_lookahead_marks
from sparsehi.kernels.lru_diff import LruDiffResult, lru_diff

__all__ = ["LoadAhead"]

CopyMisses = Callable[..., None]
"""``copy(layer, state, diff, programs)``: the host -> GPU copy of a diff's loads in about
``programs`` programs (the decoder's)."""

COPY_PROGRAMS_PER_ROW, COPY_PROGRAMS_MIN = 8, 32
"""The copy ahead runs in about ``max(COPY_PROGRAMS_MIN, COPY_PROGRAMS_PER_ROW x B)``
programs (``B`` batch rows), each looping over misses. The copy waits on host memory most
of its time; a program per page (as the critical path's copy has) would fill the GPU's
slots and delay the step's own kernels beside it, while a few looping programs hold few
slots and still finish within the layers that follow (measurements: docs/load_ahead.md)."""


class LoadAhead:
    """The side stream's work of every sparse layer (module docstring). Owns the marks
    ``[n_sparse, R, M] uint8`` (pages loaded ahead and not selected since) and the side
    stream."""

    def __init__(self, lookahead: int, n_sparse: int, max_num_reqs: int, max_pages: int, device: torch.device,
                 copy: CopyMisses) -> None:
        if lookahead <= 0:
            raise ValueError(f"lookahead={lookahead} is invalid: pages loaded ahead per layer, an integer > 0")
        self.lookahead = lookahead
        """Pages ranked after the selection that each sparse layer loads ahead (at most)."""
        self.copy = copy
        self.marks = torch.zeros(n_sparse, max_num_reqs, max_pages, dtype=torch.uint8, device=device)
        self.stream: Optional[torch.cuda.Stream] = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._held: list = []
        self._pending = False

    def reset_rows(self, rows: torch.Tensor) -> None:
        """A new request in ``rows`` (``[n] int64``): nothing of it is marked."""
        self.marks[:, rows] = 0

    def launch(self, li: int, layer: int, state: DecodeState, planes: tuple[torch.Tensor, ...],
               step_counter: torch.Tensor, selected: torch.Tensor, num_selected: torch.Tensor,
               missed: LruDiffResult, lookahead: Callable[[], tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Queue sparse layer ``layer`` (sparse index ``li``)'s load ahead after the work the
        step's stream has queued so far.

        planes: the layer's ``(resident, last_used, slot_of)``; selected / num_selected:
        the selection the layer's LRU diff took (``[B, K] int32``, ``[B] int32``; rows that
        do not use it are told by ``state.candidates.uses_selection``); missed: that diff's
        result; lookahead: returns the Top-(K + lookahead) set (``[B, Ka] int32``, ``[B]``)."""
        uses = state.candidates.uses_selection
        self._held.append((selected, num_selected, missed, lookahead))
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
            self._pending = True
        with torch.cuda.stream(self.stream) if self.stream is not None else nullcontext():
            ids, valid = lookahead()
            ids = ids.to(torch.int32).contiguous()
            valid = torch.where(uses, valid.to(torch.int32), 0)
            if state.checked:
                check_contains(ids, valid, selected, torch.where(uses, num_selected, 0))
            counts = state.counts
            b, ka = ids.shape
            out = torch.empty(3, b, ka, dtype=torch.int32, device=ids.device)
            ahead = lru_diff(ids, valid, *planes, step_counter, rows=state.rows,
                             out=LruDiffResult(out[0], out[1], out[2], counts.ahead_loads[li]))
            self.copy(layer, state, ahead, max(COPY_PROGRAMS_MIN, COPY_PROGRAMS_PER_ROW * b))
            fold_lookahead_marks(self.marks[li], state.rows, selected, num_selected, uses, missed.load_ids,
                                 missed.num_loads, ahead.load_ids, ahead.num_loads, counts.hidden[li])
            self._held.append((ids, valid, out))

    def join(self) -> None:
        """The step's stream waits for every load ahead queued since the last join."""
        try:
            if self._pending:
                torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)
        finally:
            self._pending = False
            self._held.clear()


def check_contains(ids: torch.Tensor, valid: torch.Tensor, selected: torch.Tensor, num_selected: torch.Tensor) -> None:
    """Host check (a sync; checked eager steps only): each row's first ``num_selected`` ids
    of ``selected`` are among its first ``valid`` ids of ``ids``."""
    cols_a = torch.arange(ids.shape[1], device=ids.device)[None, :]
    cols_s = torch.arange(selected.shape[1], device=ids.device)[None, :]
    have = torch.where(cols_a < valid[:, None], ids, -2)
    need = cols_s < num_selected[:, None]
    found = (selected[:, :, None] == have[:, None, :]).any(2)
    if bool((need & ~found).any()):
        raise ValueError("retrieve_topk_and_lookahead's lookahead set must contain every selected id (the Top-k is "
                         "a cut of the same ranking): a selected page outside it could be evicted by the load ahead "
                         "while the layer attends it")
