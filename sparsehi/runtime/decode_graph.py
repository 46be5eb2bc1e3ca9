"""The decode step in CUDA graphs: one graph per batch-size bucket, static input buffers.

As SGLang's CUDA-graph runner: batches are padded up to a bucket (1, 2, 4, 8, then steps
of 8 up to the maximum batch); padding rows carry ``req_pool_index = -1`` and every part of
the step treats them as empty. The step's inputs (token ids, positions, request rows,
sequence lengths) are copied into static buffers with one host->device copy; everything
from them to the next tokens — the mode's per-step tables, selection, LRU diff, host loads,
page tables, attention, the new token's backup, representation updates, logits, argmax —
is one graph replay. Outside the graph stays only what must: the mode's host bookkeeping
(``RuntimeMode.prepare_decode``: new pages at page boundaries) and the input copy.

The eager path (``cuda_graph=False``, and every CPU run) executes the very same body with
the same padding, so a captured step reproduces its eager step bit for bit.

Overlap (``ModelRunner.launch_decode``, as SGLang's overlap scheduler): the host part of
step ``t + 1`` runs while step ``t`` replays. Its token ids then come from step ``t``'s
``next_tokens`` on the device (``fill(ids_on_device=True)``), its tokens are read back
through a pinned ring slot and an event (``read_tokens``), and the pinned staging buffer
alternates between two copies, so the host never writes a buffer whose copy to the device
may still be pending.

Capture runs the body a few times eagerly on a padding-only batch first (Triton compiles,
lazily built caches), which is safe by the padding contract: padding rows write their KV to
the reserved padding page 0, load and back up nothing, and change no buffer state.
"""
from __future__ import annotations

import bisect
import gc
import logging
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Optional

import numpy as np
import torch

logger = logging.getLogger(__name__)

ENTRY_ROWS = 12
"""Packed-input rows holding page entries: 3 entries of 4 int64 per batch row."""

DecodeBody = Callable[["DecodeInputs", int, Hashable], dict]
"""``body(inputs, nb, graph_key) -> outputs``: one decode step over the first ``nb`` rows of
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
    staging: tuple[torch.Tensor, torch.Tensor]
    """Two pinned copies of ``packed``'s layout, used by turns (see the module docstring)."""
    next_tokens: torch.Tensor

    @classmethod
    def allocate(cls, n: int, device: torch.device) -> "DecodeInputs":
        pin = device.type == "cuda"
        packed = torch.zeros(4 + ENTRY_ROWS, n, dtype=torch.int64, device=device)
        staging = tuple(torch.zeros(4 + ENTRY_ROWS, n, dtype=torch.int64, pin_memory=pin) for _ in range(2))
        for t in (packed, *staging):  # entry slots start unused
            t[4:].view(-1, 4)[:, 0] = -1
        return cls(packed, staging, torch.zeros(n, dtype=torch.int64, device=device))

    def __post_init__(self) -> None:
        self._hosts = tuple(t.numpy() for t in self.staging)  # writes through NumPy: no tensor per step
        self._turn = 0
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

    def fill(self, ids: Optional[list[int]], positions: list[int], rows: list[int], seq_lens: list[int], nb: int,
             page_entries: Optional[np.ndarray] = None, ids_on_device: bool = False) -> None:
        """Rows ``[0, B)`` from the lists, ``[B, nb)`` padding, the page entries (``[E, 4]``,
        ``E <= 3N``; none: every slot unused); one host->device copy. ``ids_on_device``:
        the token ids of rows ``[0, B)`` are the previous step's ``next_tokens`` (same rows
        in the same order), copied on the device after it (``ids`` is ignored)."""
        b = len(rows)
        stage = self.staging[self._turn]
        h = self._hosts[self._turn]
        self._turn ^= 1
        h[0, b:nb], h[1, b:nb], h[2, b:nb], h[3, b:nb] = 0, 0, -1, 1
        if b:
            h[1, :b], h[2, :b], h[3, :b] = positions, rows, seq_lens
            h[0, :b] = 0 if ids_on_device else ids
        ents = h[4:].reshape(-1, 4)
        e = 0 if page_entries is None else len(page_entries)
        if e > ents.shape[0]:
            raise ValueError(f"{e} page entries exceed the step's {ents.shape[0]} slots (3 per row)")
        if e:
            ents[:e] = page_entries
        ents[e:, 0] = -1
        # this staging copy's last transfer belongs to the step before the previous one,
        # whose tokens were read back: it has finished
        if e or self._entries_live:
            self.packed.copy_(stage, non_blocking=True)
        else:
            self.packed[:4, :nb].copy_(stage[:4, :nb], non_blocking=True)
        if ids_on_device and b:
            self.packed[0, :b].copy_(self.next_tokens[:b])
        self._entries_live = e > 0

    def fill_padding(self, nb: int) -> None:
        self.fill([], [], [], [], nb)


class DecodeGraphRunner:
    """Captures ``body`` per (bucket, graph key) on first use and replays it.

    ``graph_key`` is a hashable host fact the body's shapes depend on (e.g. whether a batch
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
        pin = self.device.type == "cuda"
        self._ring = tuple(torch.zeros(self.buckets[-1], dtype=torch.int64, pin_memory=pin) for _ in range(2))
        self._ring_turn = 0
        self.time_device = False
        """Record CUDA events around every step (``device_gaps_ms``): benchmarks only."""
        self._marks: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def bucket(self, batch: int) -> int:
        if batch < 1 or batch > self.buckets[-1]:
            raise ValueError(f"decode batch of {batch} rows is outside [1, {self.buckets[-1]}] (max_num_reqs)")
        return self.buckets[bisect.bisect_left(self.buckets, batch)]

    def run(self, ids: Optional[list[int]], positions: list[int], rows: list[int], seq_lens: list[int],
            graph_key: Hashable = None, page_entries: Optional[np.ndarray] = None,
            ids_on_device: bool = False) -> tuple[torch.Tensor, dict]:
        """One step: returns ``(next_tokens [nb] int64, outputs)`` (device, static when
        graphed: read them before the next step). ``page_entries``: the step's new
        device-table entries (``DecodeInputs.page_entries``), applied by the body.
        ``ids_on_device``: see ``DecodeInputs.fill``."""
        nb = self.bucket(len(rows))
        start = self._mark()
        if not self.enabled:
            self.inputs.fill(ids, positions, rows, seq_lens, nb, page_entries, ids_on_device)
            out = self.body(self.inputs, nb, graph_key)
        else:
            key = (nb, graph_key)
            if key not in self._graphs:
                self._graphs[key] = self._capture(nb, graph_key)
            graph, out = self._graphs[key]
            self.inputs.fill(ids, positions, rows, seq_lens, nb, page_entries, ids_on_device)
            graph.replay()
        if start is not None:
            self._marks.append((start, self._mark()))
        return self.inputs.next_tokens[:nb], out

    def read_tokens(self, n: int) -> tuple[torch.Tensor, Optional[torch.cuda.Event]]:
        """Start reading the last step's first ``n`` tokens back: ``(host [n] int64, event)``;
        the values are there once the event completed (None: already, on CPU). Two ring
        slots: a slot is written again two reads later, so read it before that."""
        host = self._ring[self._ring_turn][:n]
        self._ring_turn ^= 1
        host.copy_(self.inputs.next_tokens[:n], non_blocking=True)
        if self.device.type != "cuda":
            return host, None
        ev = torch.cuda.Event()
        ev.record()
        return host, ev

    def _mark(self) -> Optional[torch.cuda.Event]:
        if not self.time_device or self.device.type != "cuda":
            return None
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def device_gaps_ms(self) -> list[float]:
        """Milliseconds the device sat between the end of one recorded step and the start of
        the next one's work (its input copy: the host had not issued it yet), for every pair
        of consecutive steps since the last call; syncs. Needs ``time_device``."""
        if not self._marks:
            return []
        self._marks[-1][1].synchronize()
        gaps = [prev[1].elapsed_time(cur[0]) for prev, cur in zip(self._marks, self._marks[1:])]
        self._marks.clear()
        return gaps

    def warm(self, batch: int, graph_key: Hashable = None) -> None:
        """Capture the graph ``run`` will replay for a batch of ``batch`` rows and this
        graph_key now (as SGLang captures at start-up): capture is seconds of work that must
        not land in a timed decode step. A no-op when graphs are off or already captured."""
        if not self.enabled:
            return
        key = (self.bucket(batch), graph_key)
        if key not in self._graphs:
            self._graphs[key] = self._capture(*key)

    def _capture(self, nb: int, graph_key: Hashable) -> tuple[torch.cuda.CUDAGraph, dict]:
        # The padding runs below write next_tokens; the previous step's tokens there are the
        # next step's ids when it takes them from the device (overlap schedule): keep them.
        kept_tokens = self.inputs.next_tokens.clone()
        self.inputs.fill_padding(nb)
        torch.cuda.synchronize(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(self.warmup_runs):
                self.body(self.inputs, nb, graph_key)
        torch.cuda.current_stream(self.device).wait_stream(side)
        torch.cuda.synchronize(self.device)
        # An unreachable graph (a dropped runner's, freed only by the cycle collector) must
        # not be destroyed while this one records: CUDA refuses that and the capture fails.
        gc.collect()
        gc_was_on = gc.isenabled()
        gc.disable()
        try:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                out = self.body(self.inputs, nb, graph_key)
        finally:
            if gc_was_on:
                gc.enable()
        self._pool = graph.pool()
        self.inputs.next_tokens.copy_(kept_tokens)
        torch.cuda.synchronize(self.device)
        logger.info("decode step captured in a CUDA graph: batch bucket %d, graph key %r", nb, graph_key)
        return graph, out

    @property
    def captured(self) -> list[tuple[int, Any]]:
        return sorted(self._graphs, key=lambda k: (k[0], repr(k[1])))

    def reset(self) -> None:
        """Drop every captured graph (the mode's static tables were rebuilt)."""
        self._graphs.clear()
        self._pool = None
