"""Long-context decode throughput: dense vs sparse-gpu vs sparse-hier vs offload-full.

llama-8b-shape (all 32 layers; MLP 4096 wide instead of 14336, stated in the output) at
contexts 16k / 32k / 64k, Quest page 16, K = 2048 tokens, LRU buffer 2 x K; plus
dsv32-shape (8 of 61 layers, budgets scaled by 8/61) with DSA at 32k. Two memory scenarios:

  a  serving a large model: GPU KV budget 16 GiB (the rest of HBM stands for weights),
     host KV budget 96 GiB;
  b  the whole free HBM (after this run's weights, minus a working margin) for KV.

Per mode the batch is swept in powers of two up to what the mode holds (GPU budget for
dense / sparse-gpu; GPU and host budgets for sparse-hier / offload-full), computed from
per-request bytes. Prefill is synthesised (random KV written straight into the pools and
the algorithm's representations built from it; see sparsehi/runtime/synth.py): a decode
benchmark does not time prefill. Host modes share one prompt's host pages across the
batch (as prefix reuse would), so pinned memory fits the benchmark machine; every request
still has its own GPU buffer, representations, decode pages and loads.

Queries. ``trace85``: each sparse layer's selection query (GQA q; DSA index q) follows an
AR(1) drift whose rho is calibrated per context so that the algorithm's own adjacent-step
Top-k overlap on these representations is 85 % (003's figure for real models); every row
reports the overlap it measured (``topk_overlap``). ``model``: the random-weight model's
own queries (one sparse-hier row per context, for contrast).

Real weights. ``--model-path DIR`` (a local HF-layout Llama/Qwen2/Mistral checkpoint) replaces the
llama-shape model; its own-query rows are then ``real``, and the benchmark first RECORDS a
real trace: a real prefill of ``--trace-prompt`` (token ids; default fixed-seed random ids of
the largest context, capped at ``--trace-context``) and ``--trace-steps`` greedy decode
steps in sparse-gpu mode with the benchmark's SparseConfig, keeping every sparse layer's
selection per step; ``real_trace`` in the result holds the measured adjacent-step Top-k
overlap per layer (sink and recent window excluded).

Per step: tokens/s over the timed steps (eager PyTorch, no CUDA graphs: Python launch
overhead is part of every mode), then a profiled step split with CUDA events into
attention, lru_diff, io (host<->device), scoring (Quest bound / DSA indexer + top-k) and
other (projections, MLP, norms, selection bookkeeping, launch gaps).

    PYTHONPATH=. python benchmarks/bench_decode.py            # GPU run (~6 min)
    PYTHONPATH=. python benchmarks/bench_decode.py --quick    # tiny CPU smoke run
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
import traceback
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import RESULTS_DIR, device_info, hbm_copy_gbps, large_h2d_copy_gbps, write_result  # noqa: E402
from sparsehi.config import SparseConfig  # noqa: E402
from sparsehi.runtime.runtime_mode import Request  # noqa: E402
from sparsehi.runtime.model_config import get_model_config  # noqa: E402
from sparsehi.runtime.runtime_config import RuntimeConfig, round_up  # noqa: E402
from sparsehi.runtime.profiling import SPLIT_KEYS, wrap_method  # noqa: E402
from sparsehi.runtime.runner import ModelRunner  # noqa: E402
from sparsehi.runtime.synth import synth_prefill  # noqa: E402
from sparsehi.runtime.traces import QueryTrace, calibrate_rho, topk_overlap  # noqa: E402
from sparsehi.runtime.weights import build_model  # noqa: E402

GIB = 1 << 30
TRACE_SOURCES = {
    "trace85": "synthetic AR(1) drift of each layer's selection query (GQA q / DSA index q), rho calibrated per "
               "context so the algorithm's own adjacent-step Top-k overlap on the synthesised representations is "
               "0.85 (003's figure for real models); topk_overlap is what the row measured",
    "model": "the random-weight model's own queries (no trace)",
    "real": "the real-weight model's own queries (--model-path); real_trace holds the adjacent-step Top-k "
            "overlap measured on a real prefill + greedy decode",
}
PREFILL_NOTE = ("prefill synthesised: random KV written into the pools and the algorithm's representations built from "
                "it; host modes share one prompt's host pages across the batch (capacity computed per request)")
MODES = ("dense", "sparse-gpu", "sparse-hier", "offload-full")


class Deadline:
    def __init__(self, seconds: float) -> None:
        self.t0 = time.perf_counter()
        self.seconds = seconds

    def left(self) -> float:
        return self.seconds - (time.perf_counter() - self.t0)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ----------------------------------------------------------------------------- sizing
def representation_bytes_per_request(model, sc: SparseConfig, ctx: int, device) -> int:
    from sparsehi.algorithms.registry import create_algorithm

    algo = create_algorithm(replace(sc, sparse_extra_config=_extra(model, sc)), device)
    spec_heads, spec_dim = model.cfg.cache_heads, model.cfg.cache_head_dim
    algo.initialize_representation_pool(0, model.cfg.num_layers, 1, ctx, kv_heads=spec_heads, head_dim=spec_dim,
                                        dtype=next(model.parameters()).dtype)
    n = algo.representation_bytes()
    del algo
    return n


def _extra(model, sc: SparseConfig) -> dict:
    extra = dict(sc.sparse_extra_config)
    if model.cfg.family == "mla":
        extra.setdefault("index_head_dim", model.cfg.index_head_dim)
    extra["validate"] = False  # no host read-backs on the decode path
    return extra


def per_request_bytes(model, mode: str, ctx: int, sc: SparseConfig, steps: int, rep_bytes: int,
                      n_dense_layers: int, dtype) -> tuple[int, int]:
    """(GPU bytes, host bytes) one request of ``ctx`` tokens holds in ``mode``."""
    cfg = model.cfg
    es = torch.empty((), dtype=dtype).element_size()
    per_layer = cfg.cache_heads * cfg.cache_head_dim * es * (2 if cfg.family == "gqa" else 1)
    tb = per_layer * cfg.num_layers
    ps = sc.page_size
    tokens = round_up(ctx + steps + 1, ps) + ps
    if mode == "dense":
        return tokens * tb, 0
    if mode == "sparse-gpu":
        return tokens * tb + rep_bytes, 0
    if mode == "sparse-hier":
        buf = (sc.sink_units + sc.recent_units + sc.buffer_units + 1) * ps * tb
        return buf + n_dense_layers * per_layer * tokens + rep_bytes, tokens * tb
    return tokens * per_layer, tokens * tb  # offload-full: one-layer staging on GPU


LIMITS: dict[str, Optional[float]] = {"hbm_gbps": None, "h2d_gbps": None}
"""This run's measured limits (GB/s): device->device copy (bytes read + written) and one
large pinned host->device copy; the roofline of every row is taken against them."""


def weight_bytes(model) -> int:
    """Bytes of weights one decode step reads: every parameter except the embedding table
    (a step reads B of its rows) unless the LM head shares it."""
    emb = model.embed_tokens.weight
    tied = model.lm_head.weight is emb
    return sum(p.numel() * p.element_size() for p in model.parameters() if p is not emb or tied)


def step_traffic(model, mode: str, ctx: int, batch: int, sc: SparseConfig, n_dense_layers: int, rep_bytes: int,
                 misses_per_step: Optional[float], dtype) -> dict[str, float]:
    """Bytes one decode step must move: ``hbm`` (weights, the KV the mode reads, the
    selection's representations) and ``h2d`` (host->device: sparse-hier's missed pages,
    offload-full's whole context)."""
    cfg = model.cfg
    es = torch.empty((), dtype=dtype).element_size()
    per_tok = cfg.cache_heads * cfg.cache_head_dim * es * (2 if cfg.family == "gqa" else 1)  # one layer
    L = cfg.num_layers
    ps = sc.page_size
    sel_tokens = (sc.sink_units + sc.top_k_units + sc.recent_units) * ps
    w = weight_bytes(model)
    if mode == "dense":
        return {"hbm": w + batch * ctx * L * per_tok, "h2d": 0.0}
    if mode == "offload-full":
        # staged (written) and attended (read) on the device, loaded over PCIe
        return {"hbm": w + 2 * batch * ctx * L * per_tok, "h2d": batch * ctx * L * per_tok}
    kv = batch * (n_dense_layers * ctx + (L - n_dense_layers) * min(ctx, sel_tokens)) * per_tok
    hbm = w + kv + batch * rep_bytes
    h2d = 0.0
    if mode == "sparse-hier":
        page = ps * per_tok
        h2d = (misses_per_step or 0.0) * page
        hbm += h2d  # written into the buffer
    return {"hbm": hbm, "h2d": h2d}


def roofline_ms(traffic: dict[str, float]) -> Optional[float]:
    hbm, h2d = LIMITS["hbm_gbps"], LIMITS["h2d_gbps"]
    if not hbm or not h2d:
        return None
    return 1e3 * (traffic["hbm"] / (hbm * 1e9) + traffic["h2d"] / (h2d * 1e9))


def batches_up_to(cap: int, limit: Optional[int] = None) -> list[int]:
    if cap < 1:
        return []
    out = [1 << i for i in range(int(math.log2(cap)) + 1)]
    if out[-1] != cap:
        out.append(cap)
    if limit is not None:
        out = [b for b in out if b <= limit]
    return out


# ----------------------------------------------------------------------------- one point
HOST_POOLS: dict = {}


def shared_host_pool(model, sc: SparseConfig, n_tokens: int, device, dtype):
    """One pinned HostKVPool per model, reused by every point (pinning is slow)."""
    from hicache.device_pool import DeviceKVPool
    from hicache.host_pool import HostKVPool
    from sparsehi.runtime.runtime_mode import kv_spec_for

    key = model.cfg.name
    hp = HOST_POOLS.get(key)
    if hp is not None and hp.num_slots >= n_tokens:
        return hp
    HOST_POOLS.pop(key, None)
    _free(device)
    rt = RuntimeConfig(mode="sparse-hier", sparse=sc, dtype=dtype)
    spec = kv_spec_for(model.cfg, rt)
    ps = sc.page_size
    dummy = DeviceKVPool(spec, 2 * ps, device)
    n = round_up(max(n_tokens, 3 * ps), ps)
    hp = HostKVPool(dummy, hicache_ratio=n / dummy.num_slots + 1e-6, layout="layer_first")
    HOST_POOLS[key] = hp
    log(f"pinned host pool for {key}: {hp.nbytes() / GIB:.1f} GiB")
    return hp


CUDA_GRAPH = True
"""Decode steps replay CUDA graphs (``--no-cuda-graph``: the same step eagerly)."""


def make_runner(model, mode: str, ctx: int, batch: int, sc: SparseConfig, steps: int, device, dtype) -> ModelRunner:
    rt = RuntimeConfig(mode=mode, sparse=replace(sc, sparse_extra_config=_extra(model, sc)), device=str(device),
                       dtype=dtype, max_num_reqs=batch, max_context_len=ctx + steps + 2,
                       adaptor="auto" if torch.device(device).type == "cuda" else "none",
                       prefix_cache=False, validate=False, cuda_graph=CUDA_GRAPH)
    if mode in ("sparse-hier", "offload-full"):
        need = ctx + batch * round_up(steps + 2 * sc.page_size, sc.page_size) + 4 * sc.page_size
        rt.host_kv_tokens = need
        rt.host_pool = shared_host_pool(model, sc, need, device, dtype)
    return ModelRunner(model, rt)


def profiled_split(runner: ModelRunner, reqs: list[Request], steps: int) -> tuple[dict[str, float], float]:
    """Time ``steps`` decode steps with sections; returns (mean ms per section, mean step ms)."""
    import sparsehi.decode.decoder as decoder_mod

    mode = runner.mode
    timer = mode.timer
    undo = []
    coord = getattr(mode, "coord", None)
    orig_diff, orig_fused = decoder_mod.lru_diff, decoder_mod.swap_in_copy_and_table
    if coord is not None:
        undo.append(wrap_method(mode.algorithm, "retrieve_topk", timer, "scoring"))
        if coord.transfer is not None:
            undo.append(wrap_method(coord.transfer, "load_layer_now", timer, "io"))
        undo.append(wrap_method(coord.decoder, "backup_token", timer, "io"))

        def timed_diff(*a, **kw):
            with timer.section("lru_diff"):
                return orig_diff(*a, **kw)

        def timed_fused(*a, **kw):  # the copy of the misses (and the page table, same launch)
            with timer.section("io"):
                return orig_fused(*a, **kw)
        decoder_mod.lru_diff, decoder_mod.swap_in_copy_and_table = timed_diff, timed_fused
    timer.enabled = True
    graphs_on = runner.graphs.enabled
    runner.graphs.enabled = False  # section events need the eager step (same kernels as the graph)
    acc = {k: 0.0 for k in SPLIT_KEYS}
    total = 0.0
    try:
        for _ in range(steps):
            timer.collect()
            dev = mode.device
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
        for u in undo:
            u()
    n = max(1, steps)
    split = {k: acc.get(k, 0.0) / n for k in SPLIT_KEYS if k != "other"}
    split["other"] = max(0.0, total / n - sum(split.values()))
    return split, total / n


def run_point(model, mode: str, ctx: int, batch: int, sc: SparseConfig, trace_rho: Optional[float],
              warmup: int, timed: int, profiled: int, device, dtype) -> dict[str, Any]:
    steps_total = warmup + timed + profiled
    runner = make_runner(model, mode, ctx, batch, sc, steps_total, device, dtype)
    runtime_mode = runner.mode
    reqs = runner.new_requests([[0]] * batch)
    synth_prefill(runtime_mode, reqs, ctx, seed=1)
    dsa = model.cfg.family == "mla"
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
    if hasattr(runtime_mode, "coord"):
        runtime_mode.coord.reset_stats()
        runtime_mode.recorded.clear()
    _sync(device)
    host_ms, host_splits = [], []
    runner.graphs.time_device = True  # CUDA events around each step: the device's idle gaps
    t0 = time.perf_counter()
    runner.decode_steps(reqs, timed, on_step=lambda t, step: (host_ms.append(step.host_ms),
                                                             host_splits.append(step.split)))
    _sync(device)
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
        runtime_mode.record_layers = frozenset()
        if mode == "sparse-hier":
            st = runtime_mode.coord.stats()
            row["hit_rate"] = st["hit_rate"]
            row["misses_per_step"] = st["misses"] / max(1, st["steps"])
            row["mib_loaded_per_step"] = st["bytes_loaded"] / max(1, st["steps"]) / (1 << 20)
        rec = runtime_mode.recorded.get(rec_layer, [])
        if len(rec) >= 2:
            ps = sc.page_size
            lo = torch.full((batch,), sc.sink_units, device=rec[0].device)
            hi = torch.full((batch,), ctx // ps - sc.recent_units, device=rec[0].device)
            ov = [topk_overlap(a, b, lo, hi).mean().item() for a, b in zip(rec[:-1], rec[1:])]
            row["topk_overlap"] = sum(ov) / len(ov)
        runtime_mode.recorded.clear()
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
    mem = runtime_mode.memory()
    row["gpu_kv_gib"] = (mem.get("gpu_kv_bytes", 0) + mem.get("representation_bytes", 0)) / GIB
    row["gpu_kv_only_gib"] = mem.get("gpu_kv_bytes", 0) / GIB
    row["representation_gib"] = mem.get("representation_bytes", 0) / GIB
    del runner, runtime_mode, reqs
    _free(device)
    return row


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _free(device) -> None:
    import gc

    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------- real traces
def read_trace_prompt(path: str, vocab_size: int) -> list[int]:
    """Token ids from ``path``: a JSON list of ints, or ints separated by whitespace/commas."""
    text = Path(path).read_text()
    try:
        ids = json.loads(text)
    except json.JSONDecodeError:
        ids = [int(x) for x in text.replace(",", " ").split()]
    if not isinstance(ids, list) or not ids or any(isinstance(x, bool) or not isinstance(x, int) for x in ids):
        raise ValueError(f"--trace-prompt {path}: expected a non-empty list of integer token ids")
    if any(x < 0 or x >= vocab_size for x in ids):
        raise ValueError(f"--trace-prompt {path}: token ids must be in [0, {vocab_size})")
    return ids


def record_real_trace(model, sc: SparseConfig, prompt: list[int], steps: int, device, dtype,
                      model_path: Optional[str] = None) -> dict[str, Any]:
    """Real prefill of ``prompt`` plus ``steps`` greedy decode steps in sparse-gpu mode,
    recording every sparse layer's selection per step; returns the measured
    adjacent-step Top-k overlap per sparse layer (sink and recent window excluded, as in
    run_point) and the selections themselves (``selections[layer]``: per step
    ``[1, N] int`` logical unit ids, -1 padded)."""
    if steps < 2:
        raise ValueError(f"steps must be >= 2 to measure adjacent-step overlap, got {steps}")
    if len(prompt) < 1:
        raise ValueError("prompt must hold at least one token")
    runner = make_runner(model, "sparse-gpu", len(prompt), 1, sc, steps, device, dtype)
    mode = runner.mode
    sparse_layers = [layer for layer in range(model.cfg.num_layers) if mode.algorithm.is_sparse_layer(layer)]
    if not sparse_layers:
        raise ValueError(f"the model's {model.cfg.num_layers} layers are all dense under this SparseConfig: "
                         "nothing to record")
    mode.record_layers = frozenset(sparse_layers)
    mode.recorded.clear()
    try:
        runner.generate([prompt], steps)
    finally:
        mode.record_layers = frozenset()
    sel: dict[int, list[torch.Tensor]] = {layer: mode.recorded.get(layer, []) for layer in sparse_layers}
    per_layer = topk_overlap_per_layer(sel, len(prompt), sc)
    vals = list(per_layer.values())
    result = {"model_path": model_path, "context": len(prompt), "steps": steps,
              "topk_overlap_mean": sum(vals) / len(vals),
              "topk_overlap_per_layer": {str(k): v for k, v in per_layer.items()}, "source": "real",
              "selections": {layer: [t.cpu() for t in ts] for layer, ts in sel.items()}}
    del runner, mode
    _free(device)
    return result


def topk_overlap_per_layer(selections: dict[int, list[torch.Tensor]], ctx: int, sc: SparseConfig) -> dict[int, float]:
    """Mean adjacent-step Top-k overlap per layer of recorded selections (``[B, N] int``
    per step); the Top-k part is the units in ``[sink_units, ctx // page_size - recent_units)``."""
    out: dict[int, float] = {}
    for layer, rec in selections.items():
        if len(rec) < 2:
            raise ValueError(f"layer {layer}: {len(rec)} recorded steps, need >= 2")
        b = rec[0].shape[0]
        lo = torch.full((b,), sc.sink_units, device=rec[0].device)
        hi = torch.full((b,), ctx // sc.page_size - sc.recent_units, device=rec[0].device)
        ov = [topk_overlap(x, y, lo, hi).mean().item() for x, y in zip(rec[:-1], rec[1:])]
        out[layer] = sum(ov) / len(ov)
    return out


# ----------------------------------------------------------------------------- calibration
def calibrate(model, ctx: int, sc: SparseConfig, target: float, iters: int, device, dtype) -> tuple[float, float]:
    """rho of the query trace whose adjacent-step Top-k overlap (the algorithm's own, on
    synthesised representations, one sparse layer, 2 requests) is ``target``."""
    runner = make_runner(model, "sparse-gpu", ctx, 2, sc, 4, device, dtype)
    mode = runner.mode
    reqs = runner.new_requests([[0]] * 2)
    synth_prefill(mode, reqs, ctx, seed=1)
    algo = mode.algorithm
    layer = [x for x in range(model.cfg.num_layers) if algo.is_sparse_layer(x)][0]
    cfg = model.cfg
    dev = torch.device(device)
    B = len(reqs)
    ps = sc.page_size
    P = ctx // ps
    cs = torch.full((B,), sc.sink_units, dtype=torch.int32, device=dev)
    ce = torch.full((B,), P - sc.recent_units, dtype=torch.int32, device=dev)
    seq = torch.full((B,), ctx, dtype=torch.int32, device=dev)
    rpi = torch.tensor([r.req_pool_idx for r in reqs], device=dev)
    mask = torch.ones(B, dtype=torch.bool, device=dev)
    if cfg.family == "mla":
        shape = (B, cfg.index_n_heads, cfg.index_head_dim)
        w = torch.ones(B, cfg.index_n_heads, device=dev) * (cfg.index_n_heads ** -0.5)
    else:
        shape = (B, cfg.num_heads, cfg.head_dim)
        w = None

    def measure(rho: float) -> float:
        tr = QueryTrace(rho, seed=3)
        like = torch.empty(shape, device=dev, dtype=torch.float32)
        prev, ovs = None, []
        for _ in range(10):
            q = tr.next(layer, like).to(dtype)
            kw = {"weights": w} if w is not None else {}
            sel, _ = algo.retrieve_topk(q, layer, rpi, mask, seq_lens=seq, candidate_start=cs, candidate_end=ce,
                                        top_k=sc.top_k_units, **kw)
            if prev is not None:
                ovs.append(topk_overlap(prev, sel, cs, ce).mean().item())
            prev = sel
        return sum(ovs) / len(ovs)

    rho, got = calibrate_rho(measure, target, iters=iters)
    del runner, mode
    _free(device)
    return rho, got


# ----------------------------------------------------------------------------- plots
def plot(rows: list[dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    groups = sorted({(r["model"], r["context"]) for r in rows})
    if not groups:
        return
    fig, axes = plt.subplots(1, len(groups), figsize=(4.6 * len(groups), 4), squeeze=False)
    colors = {"dense": "C0", "sparse-gpu": "C1", "sparse-hier": "C2", "offload-full": "C3"}
    for ax, (model, ctx) in zip(axes[0], groups):
        for scen, style in (("a", "-"), ("b", "--")):
            for mode in MODES:
                pts = sorted((r["batch"], r["tokens_per_s"]) for r in rows
                             if r["model"] == model and r["context"] == ctx and r["scenario"] == scen
                             and r["mode"] == mode and r.get("trace_source") == "trace85")
                if pts:
                    ax.plot(*zip(*pts), style, marker="o", ms=3, color=colors[mode], label=f"{mode} ({scen})")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch")
        ax.set_ylabel("decode tokens/s")
        label = f"{ctx // 1024}k" if ctx % 1024 == 0 else str(ctx)
        ax.set_title(f"{model}, {label} context", fontsize=9)
        ax.legend(fontsize=6)
    fig.suptitle("decode throughput vs batch (a: 16 GiB GPU KV budget, solid; b: whole free HBM, dashed)",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------- targets
def targets(rows: list[dict], caps: dict, ctx: int, model: str) -> list[str]:
    sel = [r for r in rows if r["model"] == model and r["context"] == ctx and r["scenario"] == "a"
           and r.get("trace_source") == "trace85"]
    if not sel:
        return [f"no scenario-a rows at {ctx} tokens"]

    def best(mode):
        rs = [r for r in sel if r["mode"] == mode]
        return max(rs, key=lambda r: r["tokens_per_s"]) if rs else None

    out = []
    cap = caps.get((model, ctx, "a"), {})
    bd, bg, bh = best("dense"), best("sparse-gpu"), best("sparse-hier")
    if cap.get("dense") and cap.get("sparse-hier"):
        ratio = cap["sparse-hier"] / cap["dense"]
        out.append(f"batch held: sparse-hier {cap['sparse-hier']} vs dense {cap['dense']} = {ratio:.1f}x "
                   f"(target >= 6x): {'MET' if ratio >= 6 else 'MISSED'}")
    for name, other, goal in (("dense", bd, 3.0), ("sparse-gpu", bg, 1.5)):
        if bh and other:
            r = bh["tokens_per_s"] / other["tokens_per_s"]
            out.append(f"best tokens/s: sparse-hier {bh['tokens_per_s']:.0f} (B={bh['batch']}) vs {name} "
                       f"{other['tokens_per_s']:.0f} (B={other['batch']}) = {r:.2f}x (target >= {goal}x): "
                       f"{'MET' if r >= goal else 'MISSED'}")
    offl = {r["batch"]: r for r in sel if r["mode"] == "offload-full"}
    hier = {r["batch"]: r for r in sel if r["mode"] == "sparse-hier"}
    common = sorted(set(offl) & set(hier))
    if common:
        b = common[-1]
        r = hier[b]["tokens_per_s"] / offl[b]["tokens_per_s"]
        out.append(f"sparse-hier vs offload-full at B={b}: {r:.1f}x (target >= 5x): {'MET' if r >= 5 else 'MISSED'}")
    if bh and bh.get("hit_rate") is not None:
        out.append(f"sparse-hier hit rate at its best batch: {bh['hit_rate']:.3f} (target >= 0.90): "
                   f"{'MET' if bh['hit_rate'] >= 0.9 else 'MISSED'}; measured top-k overlap {bh.get('topk_overlap')}")
    if bh:
        sp = bh["split_ms"]
        bound = max(sp, key=sp.get)
        out.append("sparse-hier split at its best batch (ms/step): " + ", ".join(f"{k} {v:.2f}" for k, v in sp.items())
                   + f"; largest term: {bound}")
    return out


def summary(rows: list[dict], caps: dict, ctx: int, model: str, graphs: bool) -> dict[str, Any]:
    """Scenario a at ``ctx`` (the 64k run): best and batch-1 tokens/s per mode, rooflines,
    the largest host time per step, sparse-hier's hit rate at its best batch."""
    sel = [r for r in rows if r["model"] == model and r["context"] == ctx and r["scenario"] == "a"
           and r.get("trace_source") == "trace85"]

    def best(mode):
        rs = [r for r in sel if r["mode"] == mode]
        return max(rs, key=lambda r: r["tokens_per_s"]) if rs else None

    def b1(mode):
        return next((r for r in sel if r["mode"] == mode and r["batch"] == 1), None)

    def get(r, key):
        return None if r is None else r.get(key)

    out: dict[str, Any] = {"context": ctx, "graphs": graphs}
    for mode in ("dense", "sparse-gpu", "sparse-hier"):
        k = mode.replace("-", "_")
        out[f"{k}_best_tok_s"] = get(best(mode), "tokens_per_s")
        out[f"{k}_b1_tok_s"] = get(b1(mode), "tokens_per_s")
    out["sparse_hier_best_batch"] = get(best("sparse-hier"), "batch")
    out["dense_best_batch"] = get(best("dense"), "batch")
    out["dense_b1_frac_roofline"] = get(b1("dense"), "frac_roofline")
    out["sparse_hier_best_frac_roofline"] = get(best("sparse-hier"), "frac_roofline")
    hosts = [r["host_ms_per_step_max"] for r in sel if r.get("host_ms_per_step_max") is not None]
    out["host_ms_per_step_max"] = max(hosts) if hosts else None
    gaps = [r["device_gap_ms_max"] for r in sel if r.get("device_gap_ms_max") is not None]
    out["device_gap_ms_max"] = max(gaps) if gaps else None
    out["hit_rate"] = get(best("sparse-hier"), "hit_rate")
    cap = caps.get((model, ctx, "a"), {})
    out["batch_held"] = {m: cap.get(m) for m in MODES}
    return out


# ----------------------------------------------------------------------------- main
def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny models, tiny contexts: a CPU smoke run of every path")
    ap.add_argument("--time-budget", type=float, default=390.0, help="seconds; later points are skipped past it")
    ap.add_argument("--out", default=None, help="result directory (default benchmarks/results)")
    ap.add_argument("--skip-b", action="store_true", help="skip scenario b")
    ap.add_argument("--no-cuda-graph", action="store_true",
                    help="run decode steps eagerly (default: CUDA-graph replays, as the runtime does)")
    ap.add_argument("--modes", default=None, help="comma list of modes to sweep (default: all four)")
    ap.add_argument("--max-batch", type=int, default=None, help="largest batch swept per mode")
    ap.add_argument("--skip-dsv32", action="store_true", help="skip the dsv32-shape rows")
    ap.add_argument("--contexts", default=None, help="comma list overriding the llama contexts")
    ap.add_argument("--model-path", default=None,
                    help="local HF-layout Llama/Qwen2/Mistral checkpoint: real weights replace the llama-shape model "
                         "and a real query trace is recorded")
    ap.add_argument("--trace-prompt", default=None,
                    help="token-id file (JSON list or whitespace/comma separated) for the real trace; default "
                         "fixed-seed random ids of the largest context")
    ap.add_argument("--trace-context", type=int, default=None,
                    help="cap on the real trace's prompt length (default 8192; 256 with --quick)")
    ap.add_argument("--trace-steps", type=int, default=None,
                    help="greedy decode steps of the real trace (default 32; 6 with --quick)")
    args = ap.parse_args(argv)
    global CUDA_GRAPH
    CUDA_GRAPH = not args.no_cuda_graph
    sweep_modes = tuple(args.modes.split(",")) if args.modes else MODES
    bad = [m for m in sweep_modes if m not in MODES]
    if bad:
        raise SystemExit(f"--modes: {bad} unknown; allowed {MODES}")
    deadline = Deadline(args.time_budget)
    cuda = torch.cuda.is_available() and not args.quick
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    if not cuda:
        torch.set_num_threads(1)
    out_dir = Path(args.out or RESULTS_DIR)
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.quick:
        llama = get_model_config("tiny-gqa", num_layers=4)
        dsv = get_model_config("tiny-dsa", num_layers=2)
        contexts = [512, 1024]
        dsv_ctx = 512
        K, ps = 64, 16
        budget_a = (2 * (1024 + 64) * llama.kv_bytes_per_token(dtype), 16 * (1024 + 64) * llama.kv_bytes_per_token(dtype))
        warmup, timed, profiled = 1, 2, 1
        cal_iters = 3
        max_batch = 8
    else:
        llama = get_model_config("llama-8b-shape")
        dsv = get_model_config("dsv32-shape")
        contexts = [65536, 32768, 16384]
        dsv_ctx = 32768
        K, ps = 2048, 16
        budget_a = (16 * GIB, 96 * GIB)
        warmup, timed, profiled = 2, 8, 1
        cal_iters = 8
        max_batch = 256
    if args.contexts:
        contexts = [int(x) for x in args.contexts.split(",")]
    if args.max_batch:
        max_batch = args.max_batch
    trace_context = args.trace_context if args.trace_context is not None else (256 if args.quick else 8192)
    trace_steps = args.trace_steps if args.trace_steps is not None else (6 if args.quick else 32)
    if trace_context < 1:
        raise ValueError(f"--trace-context must be >= 1, got {trace_context}")
    if trace_steps < 2:
        raise ValueError(f"--trace-steps must be >= 2, got {trace_steps}")
    gqa = None
    if args.model_path:
        gqa = build_model(model_path=args.model_path, device=device, dtype=dtype)
        llama = gqa.cfg
    info = device_info()
    log(f"device {info['device']}; budget {args.time_budget:.0f}s")
    h2d = large_h2d_copy_gbps(1 << 30) if cuda else None
    hbm = hbm_copy_gbps(2 << 30) if cuda else None
    LIMITS.update(h2d_gbps=h2d, hbm_gbps=hbm)
    if h2d:
        log(f"pinned host->device copy: {h2d:.1f} GB/s; device->device copy (read + write): {hbm:.0f} GB/s")
    rows: list[dict] = []
    caps: dict = {}
    notes: list[str] = []
    calib: dict = {}
    real_trace: Optional[dict] = None

    def save(final: bool = False) -> None:
        payload = {
            "model": llama.name, "models": {llama.name: llama.note, dsv.name: dsv.note},
            "prefill": PREFILL_NOTE, "rows": rows, "capacity": {f"{m}|{c}|{s}": v for (m, c, s), v in caps.items()},
            "calibration": calib, "h2d_gbps": h2d, "hbm_gbps": hbm, "notes": notes, "trace_sources": TRACE_SOURCES,
            "summary": summary(rows, caps, max(contexts), llama.name, CUDA_GRAPH and cuda),
            "roofline": "roofline_ms = (weights + the KV the mode reads + selection representations + loaded "
                        "pages written) / hbm_gbps + host->device bytes (sparse-hier misses, offload-full's whole "
                        "context) / h2d_gbps, both limits measured in this run; frac_roofline = roofline_ms / step_ms",
            "host_time": "host_ms_per_step: host time of a decode step outside the device's work (host part, input "
                         "copy, graph launch or eager launches, bookkeeping after the tokens came back), mean and max "
                         "over the timed steps; with the overlap schedule it runs while the previous step replays, "
                         "and device_gap_ms_max is what the device waited between two steps (CUDA events)",
            "settings": {"graphs": CUDA_GRAPH and cuda, "top_k_tokens": K, "buffer_tokens": 2 * K, "page_size_gqa": ps, "sink_tokens": 64,
                         "recent_tokens": 64, "warmup_steps": warmup, "timed_steps": timed,
                         "profiled_steps": profiled, "quick": args.quick,
                         "scenario_a": {"gpu_kv_gib": budget_a[0] / GIB, "host_kv_gib": budget_a[1] / GIB}},
            "complete": final,
        }
        if real_trace is not None:
            payload["real_trace"] = real_trace
        write_result("decode.json", payload, out_dir)

    def sweep(model, ctx: int, sc: SparseConfig, scen: str, gpu_budget: float, host_budget: float,
              modes=MODES, scale: float = 1.0, real: bool = False) -> None:
        cfg = model.cfg
        steps = warmup + timed + profiled
        rep = representation_bytes_per_request(model, sc, ctx + steps + 2, device)
        probe = create_probe(model, sc)
        n_dense = len(probe.dense_layers())
        cap: dict[str, int] = {}
        for mode in modes:
            g, h = per_request_bytes(model, mode, ctx, sc, steps, rep, n_dense, dtype)
            c = int(gpu_budget // g)
            if h:
                c = min(c, int(host_budget // h))
            cap[mode] = c
        caps[(cfg.name, ctx, scen)] = {**cap, "gpu_budget_gib": gpu_budget / GIB, "host_budget_gib": host_budget / GIB}
        log(f"{cfg.name} {ctx} scenario {scen}: capacity {cap}")
        rho = calib.get(f"{cfg.name}|{ctx}", {}).get("rho")
        if rho is None:
            rho, got = calibrate(model, ctx, sc, 0.85, cal_iters, device, dtype)
            calib[f"{cfg.name}|{ctx}"] = {"rho": rho, "calibrated_overlap": got}
            log(f"trace calibrated: rho={rho:.5f} -> overlap {got:.3f}")
        plan: list[tuple[str, int, Optional[float]]] = []
        for mode in modes:
            limit = 4 if mode == "offload-full" else max_batch
            for b in batches_up_to(cap[mode], limit):
                plan.append((mode, b, rho))
        if scen == "a" and cap.get("sparse-hier"):
            plan.append(("sparse-hier", batches_up_to(cap["sparse-hier"], max_batch)[-1], None))
        for mode, b, r in plan:
            if deadline.left() < 20:
                notes.append(f"skipped {cfg.name} {ctx} {scen} {mode} B={b}: time budget")
                continue
            t = time.perf_counter()
            try:
                t_steps = timed if mode != "offload-full" else max(2, timed // 4)
                row = run_point(model, mode, ctx, b, sc, r, warmup if mode != "offload-full" else 1, t_steps,
                                profiled if mode != "offload-full" else 1, device, dtype)
            except Exception as e:  # a point that does not fit or fails is reported, not fatal
                notes.append(f"{cfg.name} {ctx} {scen} {mode} B={b} failed: {type(e).__name__}: {e}")
                log(notes[-1])
                traceback.print_exc()
                _free(device)
                continue
            src = "trace85" if r is not None else ("real" if real else "model")
            row.update({"scenario": scen, "model": cfg.name, "trace_source": src,
                        "host_kv_gib": per_request_bytes(model, mode, ctx, sc, steps, rep, n_dense, dtype)[1] * b / GIB,
                        "capacity": cap[mode], "budget_scale": scale})
            rows.append(row)
            sp = row["split_ms"]
            log(f"{scen} {cfg.name} {ctx:>6} {mode:>12} B={b:<4} {row['tokens_per_s']:9.1f} tok/s  "
                f"step {row['step_ms']:.1f} ms  hit {row['hit_rate']}  ov {row['topk_overlap']}  "
                f"split " + " ".join(f"{k}={v:.2f}" for k, v in sp.items()) + f"  ({time.perf_counter() - t:.1f}s)")
            save()

    def create_probe(model, sc):
        from sparsehi.algorithms.registry import create_algorithm

        return create_algorithm(replace(sc, sparse_extra_config=_extra(model, sc)), device)

    if gqa is None:
        gqa = build_model(config=llama, device=device, dtype=dtype)
    sc_gqa = SparseConfig(algorithm="quest", top_k=K, device_buffer_size=2 * K, page_size=ps, min_sparse_prompt_len=0,
                          sink_tokens=64 if not args.quick else 16, recent_tokens=64 if not args.quick else 16)
    free_b = None
    steps_all = warmup + timed + profiled
    shared_host_pool(gqa, sc_gqa, max(contexts) + max_batch * round_up(steps_all + 2 * ps, ps) + 4 * ps, device, dtype)
    real = args.model_path is not None
    if real:
        if args.trace_prompt:
            prompt = read_trace_prompt(args.trace_prompt, llama.vocab_size)[:trace_context]
        else:
            g = torch.Generator().manual_seed(0)
            prompt = torch.randint(0, llama.vocab_size, (min(max(contexts), trace_context),), generator=g).tolist()
        t = time.perf_counter()
        rt_full = record_real_trace(gqa, sc_gqa, prompt, trace_steps, device, dtype, model_path=args.model_path)
        real_trace = {k: v for k, v in rt_full.items() if k != "selections"}
        real_trace["prompt"] = args.trace_prompt or f"fixed-seed random token ids (seed 0), {len(prompt)} tokens"
        del rt_full
        log(f"real trace: {len(prompt)} tokens, {trace_steps} steps, Top-k overlap mean "
            f"{real_trace['topk_overlap_mean']:.3f} ({time.perf_counter() - t:.1f}s)")
        notes.append(f"real trace recorded from {args.model_path}: real prefill of {len(prompt)} tokens and "
                     f"{trace_steps} greedy decode steps in sparse-gpu mode (benchmark SparseConfig); measured "
                     f"adjacent-step Top-k overlap {real_trace['topk_overlap_mean']:.3f} (mean over sparse layers; "
                     "per layer in real_trace) vs the 0.85 the trace85 rows are calibrated to")
        save()
    for ctx in contexts:
        sweep(gqa, ctx, sc_gqa, "a", *budget_a, modes=sweep_modes, real=real)
    if not args.skip_dsv32 and deadline.left() > 60:
        del gqa
        _free(device)
        HOST_POOLS.clear()
        _free(device)
        mla = build_model(config=dsv, device=device, dtype=dtype)
        scale = dsv.num_layers / 61 if not args.quick else 1.0
        sc_dsa = SparseConfig(algorithm="dsa", top_k=K if not args.quick else 64,
                              device_buffer_size=2 * (K if not args.quick else 64), page_size=1,
                              min_sparse_prompt_len=0, sink_tokens=64 if not args.quick else 8,
                              recent_tokens=64 if not args.quick else 8)
        notes.append(f"dsv32-shape: {dsv.num_layers} of 61 layers, so its GPU/host budgets are scaled by "
                     f"{scale:.3f} (capacity as for the full model)")
        shared_host_pool(mla, sc_dsa, dsv_ctx + max_batch * (steps_all + 4) + 8, device, dtype)
        sweep(mla, dsv_ctx, sc_dsa, "a", budget_a[0] * scale, budget_a[1] * scale, modes=sweep_modes, scale=scale)
        del mla
        HOST_POOLS.clear()
        _free(device)
        gqa = None
    if not args.skip_b and deadline.left() > 60:
        if gqa is None:
            gqa = build_model(model_path=args.model_path, config=llama, device=device, dtype=dtype)
        shared_host_pool(gqa, sc_gqa, max(contexts) + max_batch * round_up(steps_all + 2 * ps, ps) + 4 * ps,
                         device, dtype)
        if cuda:
            free_b = torch.cuda.mem_get_info()[0] - 8 * GIB
        else:
            free_b = 4 * budget_a[0]
        notes.append(f"scenario b: GPU KV budget = free HBM after weights minus an 8 GiB working margin = "
                     f"{free_b / GIB:.1f} GiB; host budget 96 GiB")
        notes.append("scenario b has no offload-full rows: offload-full keeps its KV in host memory and "
                     "stages one layer on the GPU, so a larger GPU budget changes nothing for it; its rows "
                     "in scenario a stand for both scenarios")
        for ctx in contexts:
            sweep(gqa, ctx, sc_gqa, "b", free_b, budget_a[1],
                  modes=tuple(m for m in sweep_modes if m != "offload-full"), real=real)
    notes.append("offload-full is swept only up to batch 4 (its capacity is larger): it loads every page "
                 "every step, so its step time grows linearly with batch (PCIe-bound) and its tokens/s is "
                 "flat past batch 2; larger batches would spend the time budget without changing the picture")
    if real:
        notes.append("query traces: 'trace85' (synthetic, calibrated to 85 % adjacent-step Top-k overlap) and "
                     "'real' (the real-weight model's own queries); the dsv32-shape rows keep random weights "
                     "('model'); real_trace holds the recorded real trace's measured overlap")
    else:
        notes.append("query traces: 'trace85' (synthetic, calibrated to 85 % adjacent-step Top-k overlap) and "
                     "'model' (the random-weight model's own queries); no real-weight traces were recorded "
                     "(no --model-path given)")
    lines = []
    for ctx in contexts:
        lines += [f"[{llama.name} {ctx}] " + t for t in targets(rows, caps, ctx, llama.name)]
    notes.extend(lines)
    for line in lines:
        log(line)
    save(final=True)
    plot(rows, out_dir / "decode.png")
    log(f"wrote {out_dir / 'decode.json'} and decode.png; {deadline.left():.0f}s of budget left")
    return 0


if __name__ == "__main__":
    sys.exit(main())
