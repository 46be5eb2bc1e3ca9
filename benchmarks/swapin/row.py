"""One row of bench_swapin: a (shape, batch, overlap) configuration warmed up, timed
(graph replay or eager), split per kernel, checked after every step."""
from __future__ import annotations

import gc
import statistics
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Callable, Optional

import torch

from benchmarks.swapin.hisparse import HiSparsePeer
from benchmarks.swapin.steps import SplitGraphs, SwapInParts, SwapInStep, capture, gpu_intervals, sync
from benchmarks.swapin.workload import (LAYER, SelectionTrace, ShapePools, open_requests, selection_holds_host_data,
                                        warmup_steps)
from sparsehi.kernels.selection_table import SelectionTable
from sparsehi.kv_manager import SparseKVCacheManager

ROW_KEYS = ("kind", "layout", "host_kv_dtype", "B", "overlap", "K", "S", "us", "hisparse_us", "io_limit_us",
            "misses_per_step", "correct", "eager_host_us")


@dataclass
class RowSteps:
    """What one row's steps measured (us) and whether every check after them held."""

    host_us: list[float] = field(default_factory=list)  # eager warm-up: host time of the call
    wall_us: list[float] = field(default_factory=list)  # eager warm-up: until the device finished
    times: list[float] = field(default_factory=list)  # timed steps: the layer's swap-in
    setup_times: list[float] = field(default_factory=list)  # timed steps: begin_step (graphs only)
    misses: list[int] = field(default_factory=list)
    peer_times: list[float] = field(default_factory=list)
    peer_misses: list[int] = field(default_factory=list)
    correct: bool = True
    peer_correct: bool = True


def run_configuration(pools: ShapePools, batch: int, overlap: float, *, timed: int, split_steps: int,
                      warm_min: int, graphs: bool, hisparse_fn: Optional[Callable], seed: int = 0,
                      copy_variants: tuple[tuple[int, bool, Optional[int]], ...] = ()) -> dict:
    """Measure one (shape, batch, overlap) row; see the module docstring."""
    shape = pools.shape
    dev = pools.device_pool.device
    cfg = shape.sparse_config()
    k_units, s_units = cfg.top_k_units, cfg.buffer_units
    n_prompt = shape.context // shape.page_size
    trace = SelectionTrace(batch, k_units, cfg.sink_units, n_prompt - cfg.recent_units, overlap, seed)
    warm = warmup_steps(k_units, s_units, trace.keep, warm_min)
    pools.reset()
    mgr = SparseKVCacheManager(cfg, pools.device_pool, mode="hierarchical", host_pool=pools.host_pool,
                               sparse_layers=(LAYER,), max_num_reqs=batch,
                               max_context_len=shape.context + warm + timed + split_steps * (1 + len(copy_variants)) + 1, validate=False)
    host_slots = open_requests(pools, mgr, batch)
    s = SwapInStep(mgr, batch, k_units, shape.context)
    peer = HiSparsePeer(hisparse_fn, pools, host_slots, k_units, s_units) if hisparse_fn is not None else None
    # s.topk is the step's static Top-k input, refilled in place each step
    check = partial(selection_holds_host_data, pools, topk=s.topk, host_slots=host_slots, sink=mgr.sizes.sink,
                    recent=mgr.sizes.recent)
    st = RowSteps()
    _warm_up(s, trace, warm, dev, check, peer, host_slots, st)
    _timed_steps(s, trace, timed, graphs, dev, check, peer, host_slots, st)
    split, variant_us = None, {}
    if graphs and split_steps:
        split, variant_us = _split_steps(s, trace, pools, split_steps, copy_variants, check, st)
    row = _row(pools, batch, overlap, st, graphs, dev, warm, timed, split)
    if variant_us:
        row["copy_variant_us"] = variant_us
    if peer is not None:
        row.update(hisparse_correct=bool(st.peer_correct), hisparse_misses_per_step=round(statistics.mean(st.peer_misses), 1),
                   hisparse_timing=peer.timing)
    del peer, s, mgr, check
    gc.collect()
    return row


def _warm_up(s: SwapInStep, trace: SelectionTrace, warm: int, dev: torch.device,
             check: Callable[[SelectionTable], bool], peer: Optional[HiSparsePeer], host_slots: torch.Tensor,
             st: RowSteps) -> None:
    """Eager steps: they fill the buffers, compile, and give the eager host time."""
    for _ in range(warm):
        topk = trace.next()
        s.prepare(topk)
        sync(dev)
        t0 = time.perf_counter()
        _, tab = s.body()
        t1 = time.perf_counter()
        sync(dev)
        st.host_us.append((t1 - t0) * 1e6)
        st.wall_us.append((time.perf_counter() - t0) * 1e6)
        st.correct &= check(tab)
        if peer is not None:
            peer.topk.copy_(s.topk)
            peer.call()
    if peer is not None:
        sync(dev)
        st.peer_correct &= peer.holds_host_data(s.topk, host_slots)


def _timed_steps(s: SwapInStep, trace: SelectionTrace, timed: int, graphs: bool, dev: torch.device,
                 check: Callable[[SelectionTable], bool], peer: Optional[HiSparsePeer], host_slots: torch.Tensor,
                 st: RowSteps) -> None:
    """The timed steps: graph replays (begin_step's graph, then the layer's) timed by CUDA
    events, or eager wall clock; HiSparse's call on the same selection after each."""
    graph = g_begin = None
    if graphs:
        g_begin, step = capture(s.begin)
        graph, tab = capture(lambda: s.layer(step))
        if peer is not None:
            peer.try_capture()
    for _ in range(timed):
        topk = trace.next()
        s.prepare(topk)
        if graph is not None:
            t_setup, t_layer = gpu_intervals([g_begin.replay, graph.replay])
            st.setup_times.append(t_setup)
            st.times.append(t_layer)
        else:
            sync(dev)
            t0 = time.perf_counter()
            step, tab = s.body()
            sync(dev)
            st.times.append((time.perf_counter() - t0) * 1e6)
        st.misses.append(int(step.counts.loads[s.dec.sparse_index[LAYER]].sum()))
        st.correct &= check(tab)
        if peer is not None:
            peer.topk.copy_(s.topk)
            before = peer.dbuf_tokens.clone()
            st.peer_times.append(gpu_intervals([peer.run])[0])
            st.peer_misses.append(int((peer.dbuf_tokens != before).sum()))
            st.peer_correct &= peer.holds_host_data(s.topk, host_slots)


def _split_steps(s: SwapInStep, trace: SelectionTrace, pools: ShapePools, split_steps: int,
                 copy_variants: tuple[tuple[int, bool, Optional[int]], ...],
                 check: Callable[[SelectionTable], bool], st: RowSteps) -> tuple[dict, dict]:
    """Each kernel in a graph of its own, the copy variants taking the steps in turn.
    Returns (median us per kernel, median copy us per variant)."""
    parts = SplitGraphs(SwapInParts(s, pools.host_pool, pools.device_pool), copy_variants)
    got, by_variant = [], {v: [] for v in copy_variants}
    turns = (None,) + copy_variants
    for i in range(split_steps * len(turns)):
        v = turns[i % len(turns)]
        s.prepare(trace.next())
        t = parts.replay(v)
        (got if v is None else by_variant[v]).append(t)
        st.correct &= check(parts.tab)
    split = {key: round(statistics.median(g[key] for g in got), 1) for key in got[0]}
    variant_us = {variant_name(v): round(statistics.median(t["copy"] for t in ts), 1) for v, ts in by_variant.items()}
    del parts
    return split, variant_us


def _row(pools: ShapePools, batch: int, overlap: float, st: RowSteps, graphs: bool, dev: torch.device, warm: int,
         timed: int, split: Optional[dict]) -> dict:
    """The row of the module docstring's keys from what its steps measured."""
    shape = pools.shape
    page_bytes = pools.host_page_bytes
    miss_mean = statistics.mean(st.misses)
    skip = 1 if len(st.host_us) > 1 else 0  # the first eager call compiles
    return {
        "kind": shape.kind, "layout": shape.layout, "host_kv_dtype": shape.host_kv_dtype, "B": batch,
        "overlap": overlap,
        "K": shape.top_k, "S": shape.buffer, "page_size": shape.page_size, "context": shape.context,
        "us": round(statistics.median(st.times), 1),
        "step_setup_us": round(statistics.median(st.setup_times), 1) if st.setup_times else None,
        "hisparse_us": round(statistics.median(st.peer_times), 1) if st.peer_times else None,
        "io_limit_us": None,
        "misses_per_step": round(miss_mean, 1),
        "bytes_per_step": int(round(miss_mean * page_bytes)),
        "correct": bool(st.correct),
        "eager_host_us": round(statistics.median(st.host_us[skip:]), 1),
        "eager_wall_us": round(statistics.median(st.wall_us[skip:]), 1),
        "timing": "graph replay, CUDA events" if graphs else f"eager wall clock ({dev.type})",
        "warmup_steps": warm, "timed_steps": timed,
        "split_us": split,
    }


def variant_name(v: tuple[int, bool, Optional[int]]) -> str:
    bb, rm, pif = v
    return f"{bb}/{'row' if rm else 'batch'}" + (f"/{pif}" if pif is not None else "")
