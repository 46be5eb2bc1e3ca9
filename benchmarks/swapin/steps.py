"""bench_swapin's timed swap-in: one sparse layer's decode-step swap-in as the runtime
issues it, its kernels one by one, CUDA-graph capture and GPU intervals by CUDA events."""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from benchmarks.swapin.workload import LAYER
from hicache.device_pool import DeviceKVPool
from hicache.host_pool import HostKVPool
from hicache.kernels.kv_copy import word_rows
from sparsehi.decode import SparseDecoder
from sparsehi.kernels.lru_diff import LruDiffResult, lru_diff
from sparsehi.kernels.selection_table import SelectionTable, selection_table
from sparsehi.kernels.swap_in_copy import swap_in_copy
from sparsehi.kernels.swap_in_fp8 import swap_in_fp8_copy
from sparsehi.kv_manager import SparseKVCacheManager

SPIN_CYCLES = 200_000  # ~100 us of GPU spin ahead of the first event: covers the host's submit


def gpu_intervals(fns: list[Callable[[], Any]]) -> list[float]:
    """GPU us of each of ``fns`` (graph replays) run back to back on the current stream; a
    spin kernel queued first keeps the GPU busy while the host submits them, so the
    intervals hold GPU time only."""
    torch.cuda._sleep(SPIN_CYCLES)
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(len(fns) + 1)]
    ev[0].record()
    for fn, e in zip(fns, ev[1:]):
        fn()
        e.record()
    ev[-1].synchronize()
    return [a.elapsed_time(z) * 1000.0 for a, z in zip(ev, ev[1:])]


def capture(fn: Callable[[], Any]) -> tuple[torch.cuda.CUDAGraph, Any]:
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn()
    torch.cuda.synchronize()
    return g, out


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class SwapInStep:
    """One sparse layer's decode-step swap-in, as the runtime issues it: static inputs
    (rows ``[B] int64``, lengths ``[B] int32``, Top-k ``[B, K] int32``, valid ``[B] int32``),
    ``begin`` = begin_step (once per step), ``layer`` = swap_in + selection_table (per
    sparse layer), ``body`` = both."""

    def __init__(self, mgr: SparseKVCacheManager, batch: int, k_units: int, context: int) -> None:
        dev = mgr.device
        self.mgr = mgr
        self.dec = SparseDecoder.over(mgr)
        self.batch = batch
        self.rows_l = list(range(batch))
        self.seq_len = context
        self.rows = torch.arange(batch, dtype=torch.int64, device=dev)
        self.seq = torch.full((batch,), context, dtype=torch.int32, device=dev)
        self.topk = torch.full((batch, k_units), -1, dtype=torch.int32, device=dev)
        self.valid = torch.full((batch,), k_units, dtype=torch.int32, device=dev)

    def prepare(self, topk: torch.Tensor) -> None:
        """Host part of the next step (outside any graph) and its inputs."""
        self.seq_len += 1
        self.mgr.prepare_decode(self.rows_l, [self.seq_len] * self.batch)
        self.seq.fill_(self.seq_len)
        self.topk.copy_(topk)

    def table(self, step, slots: torch.Tensor) -> SelectionTable:
        z, t = self.mgr.sizes, self.mgr.tables
        return selection_table(self.topk, self.valid, step.num_pages, step.seq_lens, step.safe_rows, sink=z.sink,
                               recent=z.recent, page_size=z.page_size, sink_table=t.sink_pages, ring_table=t.ring_pages,
                               slot_table=t.lru_pages, topk_phys=slots)

    def begin(self):
        return self.dec.begin_step(self.rows, self.seq, False, self.mgr.step)

    def layer(self, step) -> SelectionTable:
        return self.dec.build_table(LAYER, step, self.topk, self.valid)

    def body(self):
        step = self.begin()
        return step, self.layer(step)


class SwapInParts:
    """The swap-in's kernels one by one, on ``SwapInStep``'s static inputs: begin_step, the
    LRU diff, the copy of the misses (FP8 host pages: the dequantising copy), the selection
    table. The diff and the copy are called as ``SparseDecoder.swap_in`` calls them (public
    kernels over the manager's public tables); the checks after each step hold them to the
    same results."""

    def __init__(self, s: SwapInStep, host_pool: HostKVPool, device_pool: DeviceKVPool) -> None:
        m = self.mgr = s.mgr
        self.s = s
        b, k = s.topk.shape
        out = torch.empty(3, b, k, dtype=torch.int32, device=m.device)
        self.res = LruDiffResult(out[0], out[1], out[2], torch.zeros(b, dtype=torch.int32, device=m.device))
        self.fp8 = (host_pool.fp8_values, host_pool.fp8_scales) if host_pool.kv_format.quantized else None
        self.views = (None if self.fp8 else host_pool.paged_view()), device_pool.paged_view()
        self.state = s.dec.lru.layer(s.dec.sparse_index[LAYER])

    def begin(self, rows: torch.Tensor):
        return self.s.dec.begin_step(rows, self.s.seq, False, self.mgr.step)

    def diff(self, step) -> None:
        lru_diff(self.s.topk, self.s.valid, *self.state, self.mgr.step_counter, rows=step.rows, out=self.res)

    def copy(self, step, variant: Optional[tuple[int, bool, Optional[int]]] = None) -> None:
        r, m = self.res, self.mgr
        if self.fp8 is not None:
            if variant is not None:
                raise ValueError("copy variants are the bf16 copy's launch shapes: FP8 rows take none")
            swap_in_fp8_copy(*self.fp8, self.views[1], LAYER, r.load_ids, r.load_slots, r.num_loads, step.rows,
                             m.tables.host_pages, m.tables.lru_pages)
            return
        kw = {}
        if variant is not None:
            bb, rm, pif = variant
            kw = {"block_bytes": bb, "row_major": rm}
            if pif is not None:  # programs in flight per SM over the batch
                nseg = word_rows(*self.views).nseg * self.views[0].shape[3]
                kw["programs_per_row"] = max(1, pif * torch.cuda.get_device_properties(m.device).multi_processor_count
                                             // (self.s.batch * nseg))
        swap_in_copy(*self.views, LAYER, r.load_ids, r.load_slots, r.num_loads, step.rows, m.tables.host_pages,
                     m.tables.lru_pages, m.sizes.page_size, **kw)

    def table(self, step) -> SelectionTable:
        return self.s.table(step, self.res.device_slots)

    def run(self, rows: Optional[torch.Tensor] = None) -> SelectionTable:
        """All four eagerly (``rows`` default: the step's rows)."""
        step = self.begin(self.s.rows if rows is None else rows)
        self.diff(step)
        self.copy(step)
        return self.table(step)


class SplitGraphs:
    """``SwapInParts`` each in a graph of its own; ``replay`` times the diff, the copy (the
    default, or a variant ``(block_bytes, row_major)``) and the table (begin_step runs
    first, untimed)."""

    def __init__(self, parts: SwapInParts, variants: tuple[tuple[int, bool, Optional[int]], ...] = ()) -> None:
        # once eagerly on padding rows (they select nothing and change no state), as the
        # runtime warms a graph, so that nothing compiles during capture
        pad = torch.full_like(parts.s.rows, -1)
        parts.run(pad)
        for v in variants:
            parts.copy(parts.begin(pad), v)
        self.g_begin, step = capture(lambda: parts.begin(parts.s.rows))
        self.g_diff, _ = capture(lambda: parts.diff(step))
        self.g_copy, _ = capture(lambda: parts.copy(step))
        self.g_table, self.tab = capture(lambda: parts.table(step))
        self.g_variants = {v: capture(lambda v=v: parts.copy(step, v))[0] for v in variants}

    def replay(self, variant: Optional[tuple[int, bool, Optional[int]]] = None) -> dict[str, float]:
        self.g_begin.replay()
        g_copy = self.g_copy if variant is None else self.g_variants[variant]
        d, c, t = gpu_intervals([self.g_diff.replay, g_copy.replay, self.g_table.replay])
        return {"diff": d, "copy": c, "table": t}
