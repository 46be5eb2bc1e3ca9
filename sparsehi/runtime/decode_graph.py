"""The decode step in CUDA graphs: one graph per batch-size bucket, static input buffers.

As SGLang's CUDA-graph runner: batches are padded up to a bucket (1, 2, 4, 8, then steps
of 8 up to the maximum batch); padding rows carry ``req_pool_index = -1`` and every part of
the step treats them as empty. The step's inputs (token ids, positions, request rows,
sequence lengths) are copied into static buffers with one host->device copy; everything
from them to the next tokens — the mode's per-step tables, selection, LRU diff, host loads,
page tables, attention, the new token's backup, representation updates, logits, argmax —
is one graph replay. Outside the graph stays only what must: the mode's host bookkeeping
(``ModeBackend.prepare_decode``: new pages at page boundaries) and the input copy.

The eager path (``cuda_graph=False``, and every CPU run) executes the very same body with
the same padding, so a captured step reproduces its eager step bit for bit.

Capture runs the body a few times eagerly on a padding-only batch first (Triton compiles,
lazily built caches), which is safe by the padding contract: padding rows write their KV to
the reserved padding page 0, load and back up nothing, and change no buffer state.
"""
from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Optional

import numpy as np
import torch

logger = logging.getLogger(__name__)

ENTRY_ROWS = 12
"""Packed-input rows holding page entries: 3 entries of 4 int64 per batch row."""

DecodeBody = Callable[["DecodeInputs", int, Hashable], dict]
"""``body(inputs, nb, variant) -> outputs``: one decode step over the first ``nb`` rows of
the static inputs; writes ``inputs.next_tokens[:nb]``; returns other static outputs."""


def batch_buckets(max_batch: int) -> list[int]:
    """Graph batch sizes: 1, 2, 4, 8, then every multiple of 8 up to ``max_batch`` (which
    is always included)."""
    if not isinstance(max_batch, int) or max_batch < 1:
        raise ValueError(f"max_batch={max_batch!r} is invalid: an integer >= 1")
    out = [b for b in (1, 2, 4, 8) if b < max_batch]
    out += list(range(16, max_batch, 8))
    out.append(max_batch)
    return sorted(set(out))


@dataclass
class DecodeInputs:
    """Static per-step inputs of ``N`` rows (the largest bucket) and the step's output.

    input_ids, positions, req_pool_indices, seq_lens: ``[N] int64`` views of one packed
    device buffer (padding rows: id 0, position 0, row -1, length 1); page_entries
    ``[3N, 4] int64`` the same buffer's tail: the device-table entries of the pages this
    step's rows open (``sparsehi.kernels.table_scatter`` format, table ``-1`` when unused),
    written by the step itself so that no launch or copy of its own happens on the host;
    next_tokens ``[N] int64`` greedy tokens the step wrote.
    """

    packed: torch.Tensor
    staging: torch.Tensor
    next_tokens: torch.Tensor

    @classmethod
    def allocate(cls, n: int, device: torch.device) -> "DecodeInputs":
        pin = device.type == "cuda"
        packed = torch.zeros(4 + ENTRY_ROWS, n, dtype=torch.int64, device=device)
        staging = torch.zeros(4 + ENTRY_ROWS, n, dtype=torch.int64, pin_memory=pin)
        for t in (packed, staging):  # entry slots start unused
            t[4:].view(-1, 4)[:, 0] = -1
        return cls(packed, staging, torch.zeros(n, dtype=torch.int64, device=device))

    def __post_init__(self) -> None:
        self._host = self.staging.numpy()  # writes through NumPy: no tensor per step
        self._entries_live = True  # the device copy of the entry slots may hold entries

    @property
    def input_ids(self) -> torch.Tensor:
        return self.packed[0]

    @property
    def positions(self) -> torch.Tensor:
        return self.packed[1]

    @property
    def req_pool_indices(self) -> torch.Tensor:
        return self.packed[2]

    @property
    def seq_lens(self) -> torch.Tensor:
        return self.packed[3]

    @property
    def page_entries(self) -> torch.Tensor:
        return self.packed[4:].view(-1, 4)

    def fill(self, ids: list[int], positions: list[int], rows: list[int], seq_lens: list[int], nb: int,
             page_entries: Optional[np.ndarray] = None) -> None:
        """Rows ``[0, B)`` from the lists, ``[B, nb)`` padding, the page entries (``[E, 4]``,
        ``E <= 3N``; none: every slot unused); one host->device copy."""
        b = len(rows)
        h = self._host
        h[0, b:nb], h[1, b:nb], h[2, b:nb], h[3, b:nb] = 0, 0, -1, 1
        if b:
            h[0, :b], h[1, :b], h[2, :b], h[3, :b] = ids, positions, rows, seq_lens
        ents = h[4:].reshape(-1, 4)
        e = 0 if page_entries is None else len(page_entries)
        if e > ents.shape[0]:
            raise ValueError(f"{e} page entries exceed the step's {ents.shape[0]} slots (3 per row)")
        if e:
            ents[:e] = page_entries
        ents[e:, 0] = -1
        # the previous step's copy has finished: its tokens were read back
        if e or self._entries_live:
            self.packed.copy_(self.staging, non_blocking=True)
        else:
            self.packed[:4, :nb].copy_(self.staging[:4, :nb], non_blocking=True)
        self._entries_live = e > 0

    def fill_padding(self, nb: int) -> None:
        self.fill([], [], [], [], nb)


class DecodeGraphRunner:
    """Captures ``body`` per (bucket, variant) on first use and replays it.

    ``variant`` is a hashable host fact the body's shapes depend on (e.g. whether a batch
    holds a densely decoded row); most modes have one. ``enabled`` False runs the body
    eagerly (same padding, same kernels).
    """

    def __init__(self, body: DecodeBody, max_batch: int, device: torch.device, enabled: bool) -> None:
        self.body = body
        self.device = torch.device(device)
        self.enabled = bool(enabled) and self.device.type == "cuda"
        self.buckets = batch_buckets(max_batch)
        self.inputs = DecodeInputs.allocate(self.buckets[-1], self.device)
        self._graphs: dict[tuple[int, Hashable], tuple[torch.cuda.CUDAGraph, dict]] = {}
        self._pool = None
        self.warmup_runs = 2

    def bucket(self, batch: int) -> int:
        if batch < 1 or batch > self.buckets[-1]:
            raise ValueError(f"decode batch of {batch} rows is outside [1, {self.buckets[-1]}] (max_num_reqs)")
        return self.buckets[bisect.bisect_left(self.buckets, batch)]

    def run(self, ids: list[int], positions: list[int], rows: list[int], seq_lens: list[int],
            variant: Hashable = None, page_entries: Optional[np.ndarray] = None) -> tuple[torch.Tensor, dict]:
        """One step: returns ``(next_tokens [nb] int64, outputs)`` (device, static when
        graphed: read them before the next step). ``page_entries``: the step's new
        device-table entries (``DecodeInputs.page_entries``), applied by the body."""
        nb = self.bucket(len(rows))
        if not self.enabled:
            self.inputs.fill(ids, positions, rows, seq_lens, nb, page_entries)
            out = self.body(self.inputs, nb, variant)
            return self.inputs.next_tokens[:nb], out
        key = (nb, variant)
        if key not in self._graphs:
            self._graphs[key] = self._capture(nb, variant)
        graph, out = self._graphs[key]
        self.inputs.fill(ids, positions, rows, seq_lens, nb, page_entries)
        graph.replay()
        return self.inputs.next_tokens[:nb], out

    def warm(self, batch: int, variant: Hashable = None) -> None:
        """Capture the graph ``run`` will replay for a batch of ``batch`` rows and this
        variant now (as SGLang captures at start-up): capture is seconds of work that must
        not land in a timed decode step. A no-op when graphs are off or already captured."""
        if not self.enabled:
            return
        key = (self.bucket(batch), variant)
        if key not in self._graphs:
            self._graphs[key] = self._capture(*key)

    def _capture(self, nb: int, variant: Hashable) -> tuple[torch.cuda.CUDAGraph, dict]:
        self.inputs.fill_padding(nb)
        torch.cuda.synchronize(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(self.warmup_runs):
                self.body(self.inputs, nb, variant)
        torch.cuda.current_stream(self.device).wait_stream(side)
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = self.body(self.inputs, nb, variant)
        self._pool = graph.pool()
        torch.cuda.synchronize(self.device)
        logger.info("decode step captured in a CUDA graph: batch bucket %d, variant %r", nb, variant)
        return graph, out

    @property
    def captured(self) -> list[tuple[int, Any]]:
        return sorted(self._graphs, key=lambda k: (k[0], repr(k[1])))

    def reset(self) -> None:
        """Drop every captured graph (the backend's static tables were rebuilt)."""
        self._graphs.clear()
        self._pool = None
