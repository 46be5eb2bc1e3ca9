"""One measured point of bench_decode: a runner of one mode, context and batch over a
synthesised prefill, its timed steps (tokens/s, host time, device gaps), its profiled
step split, its hit rate, Top-k overlap and roofline."""
from __future__ import annotations

import os
import resource
import time
from dataclasses import replace
from typing import Any, Callable, Optional

import torch

from benchmarks.decode import modes
from benchmarks.decode.modes import (ALL_MODES, FP8_MODE, MODES, is_hierarchical,  # noqa: F401
                                     kv_cache_dtype_of, loads_ahead, runtime_mode_of)
from benchmarks.decode.sizing import GIB, roofline_ms, sparse_extra_config, step_traffic
from sparsehi.config import SparseConfig
from sparsehi.runtime.runtime_mode import Request
from sparsehi.runtime.runtime_config import RuntimeConfig, round_up
from sparsehi.runtime.profiling import SPLIT_KEYS, wrap_method
from sparsehi.runtime.runner import ModelRunner
from sparsehi.runtime.synth import synth_prefill
from sparsehi.runtime.traces import QueryTrace, topk_overlap



SYNTH_CHUNK_TOKENS = 65536
"""The host modes synthesise a longer prompt chunk after chunk through a device staging
area of this many tokens (``synth_prefill``'s ``chunk_tokens``), so the device pool holds
the requests' buffers and one chunk, not the whole prompt."""

Calibrate = Callable[[Any, list], tuple[float, float]]
"""``(runtime mode, requests) -> (rho, overlap)``: calibrates the query trace on a point's
own representations (contexts whose sparse-gpu calibration does not fit the device)."""


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


HOST_POOLS: dict = {}


def shared_host_pool(model, sc: SparseConfig, n_tokens: int, device, dtype):
    """One pinned HostKVPool per KV shape and host KV dtype, reused by every point (pinning
    is slow); a pool of another shape in the same host dtype and KV cache format is dropped
    first."""
    from hicache.device_pool import DeviceKVPool
    from hicache.host_pool import HostKVPool
    from sparsehi.runtime.runtime_mode import kv_spec_for

    fp8 = sc.host_kv_dtype == "fp8_e4m3"  # FP8 page records live in page_first
    rt = RuntimeConfig(mode="sparse-hier", sparse=sc, dtype=dtype, host_layout="page_first" if fp8 else "layer_first")
    spec = kv_spec_for(model.cfg, rt)
    key = (spec, sc.host_kv_dtype)
    hp = HOST_POOLS.get(key)
    if hp is not None and hp.num_slots >= n_tokens:
        return hp
    for k in [k for k in HOST_POOLS if k[1] == sc.host_kv_dtype and k[0].fp8_latent_rows == spec.fp8_latent_rows]:
        HOST_POOLS.pop(k)
    free_memory(device)
    ps = sc.page_size
    dummy = DeviceKVPool(spec, 2 * ps, device)
    n = round_up(max(n_tokens, 3 * ps), ps)
    hp = HostKVPool(dummy, hicache_ratio=n / dummy.num_slots + 1e-6, layout="page_first" if fp8 else "layer_first",
                    host_kv_dtype=sc.host_kv_dtype)
    HOST_POOLS[key] = hp
    log(f"pinned host pool for {model.cfg.name} ({hp.kv_format.namespace_tag}): {hp.nbytes() / GIB:.1f} GiB")
    return hp


CUDA_GRAPH = True
"""Decode steps replay CUDA graphs (``--no-cuda-graph``: the same step eagerly)."""


def make_runner(model, mode: str, ctx: int, batch: int, sc: SparseConfig, steps: int, device, dtype) -> ModelRunner:
    ahead = modes.LOOKAHEAD_PAGES * sc.page_size if loads_ahead(mode) else 0
    kv_cache_dtype = kv_cache_dtype_of(mode)
    mode, host_kv_dtype = runtime_mode_of(mode)
    sc = replace(sc, host_kv_dtype=host_kv_dtype, lookahead_tokens=ahead, kv_cache_dtype=kv_cache_dtype,
                 sparse_extra_config=sparse_extra_config(model, sc))
    # FP8 latent rows are read only by the sparse MLA decode kernel's adapter (its torch
    # reference off CUDA); elsewhere the CPU runs the runner's torch fallback
    on_cuda = torch.device(device).type == "cuda"
    rt = RuntimeConfig(mode=mode, sparse=sc, device=str(device),
                       dtype=dtype, max_num_reqs=batch, max_context_len=ctx + steps + 2,
                       adapter="auto" if on_cuda or kv_cache_dtype != "auto" else "none",
                       prefix_cache=False, validate=False, cuda_graph=CUDA_GRAPH,
                       host_layout="page_first" if host_kv_dtype == "fp8_e4m3" else "layer_first")
    if mode in ("sparse-hier", "offload-full"):
        need = ctx + batch * round_up(steps + 2 * sc.page_size, sc.page_size) + 4 * sc.page_size
        rt.host_kv_tokens = need
        rt.host_pool = shared_host_pool(model, sc, need, device, dtype)
        if ctx > SYNTH_CHUNK_TOKENS:  # the buffers (sparse-hier) and one chunk of the synthesised prompt
            buffers = batch * rt.buffer_tokens_per_request() if mode == "sparse-hier" else 0
            rt.device_kv_tokens = buffers + SYNTH_CHUNK_TOKENS + 4 * sc.page_size
    return ModelRunner(model, rt)


def host_memory_gib() -> tuple[float, float]:
    """``(resident set now, its peak)`` of this process in GiB (pinned host pools are
    resident: their pages are locked)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB  # ru_maxrss: KiB on Linux
    try:
        with open("/proc/self/statm") as f:
            now = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / GIB
    except OSError:  # pragma: no cover - not Linux
        now = peak
    # the kernel's high-water mark trails the resident set it last accounted; the peak is at
    # least what is resident now
    return now, max(peak, now)


def profiled_split(runner: ModelRunner, reqs: list[Request], steps: int) -> tuple[dict[str, float], float]:
    """Time ``steps`` decode steps with sections; returns (mean ms per section, mean step ms)."""
    import sparsehi.decode.decoder as decoder_mod

    runtime_mode = runner.mode
    timer = runtime_mode.timer
    undo = []
    coord = getattr(runtime_mode, "coord", None)
    orig_diff, orig_fused = decoder_mod.lru_diff, decoder_mod.swap_in_copy_and_table
    orig_fp8 = decoder_mod.swap_in_fp8_copy_and_table
    if coord is not None:
        undo.append(wrap_method(runtime_mode.algorithm, "retrieve_topk", timer, "scoring"))
        algo = runtime_mode.algorithm
        # an algorithm with its own lookahead selects there (the lookahead set runs on the side
        # stream: other); the base class's calls retrieve_topk, timed already
        if coord.decoder.load_ahead is not None and "retrieve_topk_and_lookahead" in type(algo).__dict__:
            undo.append(wrap_method(algo, "retrieve_topk_and_lookahead", timer, "scoring"))
        if coord.transfer is not None:
            undo.append(wrap_method(coord.transfer, "load_layer_now", timer, "io"))
        undo.append(wrap_method(coord.decoder, "backup_token", timer, "io"))

        def timed_diff(*a, **kw):
            with timer.section("lru_diff"):
                return orig_diff(*a, **kw)

        def timed_fused(*a, **kw):  # the copy of the misses (and the page table, same launch)
            with timer.section("io"):
                return orig_fused(*a, **kw)
        def timed_fp8(*a, **kw):  # FP8 host pages: the misses' dequantising copy (and the page table)
            with timer.section("io"):
                return orig_fp8(*a, **kw)
        decoder_mod.lru_diff, decoder_mod.swap_in_copy_and_table = timed_diff, timed_fused
        decoder_mod.swap_in_fp8_copy_and_table = timed_fp8
    timer.enabled = True
    graphs_on = runner.graphs.enabled
    runner.graphs.enabled = False  # section events need the eager step (same kernels as the graph)
    acc = {k: 0.0 for k in SPLIT_KEYS}
    total = 0.0
    try:
        for _ in range(steps):
            timer.collect()
            dev = runtime_mode.device
            if dev.type == "cuda":
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                runner.decode_step(reqs)
                b.record()
                torch.cuda.synchronize()
                step_ms = a.elapsed_time(b)
            else:
                t = time.perf_counter()
                runner.decode_step(reqs)
                step_ms = (time.perf_counter() - t) * 1e3
            parts = timer.collect()
            for k, v in parts.items():
                acc[k] = acc.get(k, 0.0) + v
            total += step_ms
    finally:
        timer.enabled = False
        runner.graphs.enabled = graphs_on
        decoder_mod.lru_diff, decoder_mod.swap_in_copy_and_table = orig_diff, orig_fused
        decoder_mod.swap_in_fp8_copy_and_table = orig_fp8
        for u in undo:
            u()
    n = max(1, steps)
    split = {k: acc.get(k, 0.0) / n for k in SPLIT_KEYS if k != "other"}
    split["other"] = max(0.0, total / n - sum(split.values()))
    return split, total / n


FILL_STEPS_MAX = 96
"""Most warm-up steps a hierarchical point takes to fill its LRU buffers (``fill_buffers``)."""
FILL_STEPS_AFTER = 2
"""Steps decoded after every buffer is full, before the timed ones."""


def fill_buffers(runner, reqs, max_steps: int = FILL_STEPS_MAX, check_every: int = 4) -> tuple[int, float]:
    """Decode until every sparse layer's LRU buffer of every request is full, then
    ``FILL_STEPS_AFTER`` more steps: the timed steps then see the steady state's misses
    (a buffer still filling misses more: dsv32-shape at 32k, batch 30, steps 3-10 missed
    1.4x as often as steps 21-28). Stops after ``max_steps`` steps (at least
    ``FILL_STEPS_AFTER``). Returns ``(steps decoded, the least buffer fill reached before
    the last FILL_STEPS_AFTER of them)``."""
    coord = runner.mode.coord
    rows = torch.tensor([r.req_pool_idx for r in reqs], dtype=torch.int64)
    steps, fill = 0, coord.buffer_fill(rows)
    while fill < 1.0 and steps + check_every <= max_steps - FILL_STEPS_AFTER:
        for _ in range(check_every):
            runner.decode_step(reqs)
        steps += check_every
        fill = coord.buffer_fill(rows)
    for _ in range(FILL_STEPS_AFTER):
        runner.decode_step(reqs)
    return steps + FILL_STEPS_AFTER, fill


def run_point(model, mode: str, ctx: int, batch: int, sc: SparseConfig, trace_rho: Optional[float],
              warmup: int, timed: int, profiled: int, device, dtype,
              calibrate: Optional[Calibrate] = None, fill_max: int = FILL_STEPS_MAX) -> dict[str, Any]:
    """One row. ``calibrate``: find the trace's rho on this point's representations first
    (the row then carries ``trace_rho`` and ``calibrated_overlap``) instead of ``trace_rho``.
    Hierarchical modes decode up to ``fill_max`` more warm-up steps, until their LRU
    buffers are full (``fill_buffers``); 0 times the buffers' first steps as they come."""
    cuda = torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    fill_max = fill_max if is_hierarchical(mode) else 0
    steps_total = warmup + timed + profiled + fill_max
    runner = make_runner(model, mode, ctx, batch, sc, steps_total, device, dtype)
    runtime_mode = runner.mode
    reqs = runner.new_requests([[0]] * batch)
    t_synth = time.perf_counter()
    synth_prefill(runtime_mode, reqs, ctx, seed=1, chunk_tokens=SYNTH_CHUNK_TOKENS)
    sync_device(device)
    t_synth = time.perf_counter() - t_synth
    dsa = model.cfg.family == "mla"
    calibrated = calibrate(runtime_mode, reqs) if calibrate is not None else None
    if calibrated is not None:
        trace_rho = calibrated[0]
    if trace_rho is not None:
        runtime_mode.query_hook = QueryTrace(trace_rho, seed=2, dsa=dsa)
    rec_layer = None
    if hasattr(runtime_mode, "coord"):
        sparse_layers = [layer for layer in range(model.cfg.num_layers) if runtime_mode.algorithm.is_sparse_layer(layer)]
        rec_layer = sparse_layers[0] if sparse_layers else None
    if hasattr(runtime_mode, "coord"):
        # set before the warm-up: what a step records is part of its graph (captured then)
        runtime_mode.record_layers = frozenset() if rec_layer is None else frozenset({rec_layer})
    for _ in range(warmup):
        runner.decode_step(reqs)
    fill_steps, fill = 0, None
    if fill_max > 0:
        fill_steps, fill = fill_buffers(runner, reqs, fill_max)
    if hasattr(runtime_mode, "coord"):
        runtime_mode.coord.reset_stats()
        runtime_mode.recorded.clear()
    sync_device(device)
    host_ms, host_splits = [], []
    runner.graphs.time_device = True  # CUDA events around each step: the device's idle gaps
    t0 = time.perf_counter()
    runner.decode_steps(reqs, timed, on_step=lambda t, step: (host_ms.append(step.host_ms),
                                                             host_splits.append(step.split)))
    sync_device(device)
    gaps = runner.graphs.device_gaps_ms()
    runner.graphs.time_device = False
    worst = max(range(len(host_ms)), key=host_ms.__getitem__)
    dt = time.perf_counter() - t0
    row: dict[str, Any] = {"mode": mode, "context": ctx, "batch": batch, "tokens_per_s": batch * timed / dt,
                           "step_ms": 1e3 * dt / timed, "hit_rate": None, "topk_overlap": None,
                           "graphs": runner.graphs.enabled, "host_ms_per_step": sum(host_ms) / len(host_ms),
                           "host_ms_per_step_max": max(host_ms),
                           "host_ms_split_of_max": {k: round(v, 3) for k, v in host_splits[worst].items()},
                           "host_ms_max_at_seq_len": reqs[0].seq_len - (timed - 1 - worst),
                           "overlap_schedule": runner.rt.overlap_schedule,
                           "device_gap_ms_max": max(gaps) if gaps else None}
    if hasattr(runtime_mode, "coord"):
        row.update(_selection_fields(runtime_mode, mode, rec_layer, ctx, batch, sc))
    if mode == "offload-full":
        row["mib_loaded_per_step"] = runtime_mode.step_bytes[-1] / (1 << 20)
    n_dense = len(runtime_mode.algorithm.dense_layers()) if hasattr(runtime_mode, "algorithm") else 0
    rep = int(runtime_mode.algorithm.representation_bytes() / batch) if hasattr(runtime_mode, "algorithm") else 0
    traffic = step_traffic(model, mode, ctx, batch, sc, n_dense, rep, row.get("misses_per_step"), dtype)
    row["step_bytes_hbm"], row["step_bytes_h2d"] = traffic["hbm"], traffic["h2d"]
    rl = roofline_ms(traffic)
    row["roofline_ms"] = rl
    row["frac_roofline"] = rl / row["step_ms"] if rl else None
    split, prof_ms = profiled_split(runner, reqs, profiled)
    row["split_ms"] = split
    row["profiled_step_ms"] = prof_ms
    row.update(synth_s=t_synth, timed_steps=timed, warmup_steps=warmup + fill_steps, buffer_fill_at_timing=fill)
    if calibrated is not None:
        row.update(trace_rho=calibrated[0], calibrated_overlap=calibrated[1])
    row.update(_memory_fields(runtime_mode, device))
    del runner, runtime_mode, reqs
    free_memory(device)
    return row


def _selection_fields(runtime_mode, mode: str, rec_layer: Optional[int], ctx: int, batch: int,
                      sc: SparseConfig) -> dict[str, Any]:
    """A coordinator mode's row fields after its timed steps: hit rate and loads
    (sparse-hier), the recorded layer's adjacent-step Top-k overlap."""
    out: dict[str, Any] = {}
    runtime_mode.record_layers = frozenset()
    if is_hierarchical(mode):
        st = runtime_mode.coord.stats()
        steps = max(1, st["steps"])
        out["hit_rate"] = st["hit_rate"]
        out["misses_per_step"] = st["misses"] / steps
        out["mib_loaded_per_step"] = st["bytes_loaded"] / steps / (1 << 20)
        if "ahead_loads" in st:  # pages loaded ahead: off the critical path
            out["lookahead_pages"] = modes.LOOKAHEAD_PAGES
            out["ahead_pages_per_step"] = st["ahead_loads"] / steps
            out["ahead_mib_loaded_per_step"] = st["ahead_bytes_loaded"] / steps / (1 << 20)
            out["hidden_misses_per_step"] = st["hidden_misses"] / steps
            out["prefetch_hidden_frac"] = st["hidden_frac"]
            out["ahead_precision"] = st["ahead_precision"]
    rec = runtime_mode.recorded.get(rec_layer, [])
    if len(rec) >= 2:
        ps = sc.page_size
        lo = torch.full((batch,), sc.sink_units, device=rec[0].device)
        hi = torch.full((batch,), ctx // ps - sc.recent_units, device=rec[0].device)
        ov = [topk_overlap(a, b, lo, hi).mean().item() for a, b in zip(rec[:-1], rec[1:])]
        out["topk_overlap"] = sum(ov) / len(ov)
    runtime_mode.recorded.clear()
    return out


def _memory_fields(runtime_mode, device) -> dict[str, Any]:
    """A row's memory: the mode's peak KV and representation bytes, the device's peak
    allocation over the row (``torch.cuda.max_memory_allocated``: weights, pools,
    synthesis staging, graphs; None off CUDA), the pinned host pool and the process's
    resident set (now and its peak; it includes the pinned pool)."""
    mem = runtime_mode.memory()
    out = {"gpu_kv_gib": (mem.get("gpu_kv_bytes", 0) + mem.get("representation_bytes", 0)) / GIB,
           "gpu_kv_only_gib": mem.get("gpu_kv_bytes", 0) / GIB,
           "representation_gib": mem.get("representation_bytes", 0) / GIB,
           "gpu_peak_gib": (torch.cuda.max_memory_allocated(device) / GIB
                            if torch.device(device).type == "cuda" else None)}
    host = getattr(runtime_mode, "host", None)
    out["host_pinned_pool_gib"] = host.nbytes() / GIB if host is not None else 0.0
    out["host_rss_gib"], out["host_rss_peak_gib"] = host_memory_gib()
    return out


def sync_device(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def free_memory(device) -> None:
    import gc

    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
