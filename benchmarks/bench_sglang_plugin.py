"""The SGLang plugin's decode step: SGLang's dense attention against the plugin's
hierarchical sparse path, eager and recorded in SGLang-style decode CUDA graphs.

SGLang cannot be installed on the GPU machine, so the run uses the stand-ins of
``benchmarks/sglang_standins.py`` (SGLang's pools, batch, layer fields, its FlashAttention
decode contract on this package's paged kernel, and its decode graph runner's protocol)
with the plugin's real hooks. The model is attention layers only (q / k / v given per step,
no projections or MLP), so the step time is what the plugin changes: SGLang's KV write and
attention, against the plugin's host part, selection, swap-in from host, sparse attention,
backup and update (plus SGLang's attention over one token for our rows).

Per batch size, three runs of the same steps: ``dense`` (sparsehi off, graphs: SGLang's
decode), ``sparse_graph`` (sparsehi on, graphs) and ``sparse_eager`` (sparsehi on, no
graphs). Each decodes ``--steps`` steps after one registering step (the prompts' offload),
crossing page boundaries; queries drift slowly from step to step (``q = base + 0.3 noise``)
so selections overlap as in a real decode. The scheduler's batches are built before the
timed loop; in it the host runs ahead of the device, as in SGLang's overlap scheduler.
Reported per run: wall ms per step (synchronised only at the ends), the host's own ms per
step (the loop before the final wait; it includes waits on the device, e.g. for a pinned
staging slot), for graphed runs ``replay_ms`` (the last step's graph replayed alone: the
device time of a step), the hit rate, and the ratios measured in the same run. Shape:
Llama-8B's attention (32 layers, 32 query / 8 KV heads of 128, bf16), page 64, Quest with
its dense layers 0 and 1, K = 2048 tokens, buffer 2 K. ``dense_roofline_ms``: the dense KV
bytes of a step over the device-to-device copy bandwidth measured in the same run.
``--profile`` prints the host's cProfile of each timed loop.

Usage: ``PYTHONPATH=. python benchmarks/bench_sglang_plugin.py`` on a GPU (``--quick``: tiny
shapes on CPU, to check the script). Result: ``sglang_plugin.json``.
"""
from __future__ import annotations

import argparse
import cProfile
import gc
import io
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import cuda_time_us, device_info, hbm_copy_gbps, write_result  # noqa: E402
from benchmarks.sglang_standins import SGLangWorld, Shape  # noqa: E402
from sparsehi.config import SparseConfig  # noqa: E402

RUNS = ("dense", "sparse_graph", "sparse_eager")


def _config(page: int, top_k: int, batch: int) -> SparseConfig:
    return SparseConfig(algorithm="quest", backend="flashattention", top_k=top_k, device_buffer_size=2 * top_k,
                        page_size=page, sink_tokens=page, recent_tokens=page, min_sparse_prompt_len=2 * top_k,
                        host_to_device_ratio=2.0, dense_layers=(0, 1), max_sparse_requests=batch)


def _buffer_tokens(page: int, top_k: int) -> int:
    """GPU tokens of one sparse request's buffer (sink, recent ring, LRU region, a page)."""
    return (3 + 2 * top_k // page) * page


def run_one(kind: str, shape: Shape, batch: int, context: int, steps: int, top_k: int, dev: torch.device,
            seed: int, profile: bool = False, sel_page: int = 64) -> dict:
    cfg = None if kind == "dense" else _config(sel_page, top_k, batch)
    graphs = kind != "sparse_eager" and dev.type == "cuda"
    gen = torch.Generator(device=dev).manual_seed(seed)
    hd = shape.head_dim
    qw, kw = shape.q_heads * hd, shape.kv_heads * hd
    base = [tuple(torch.randn(batch, w, generator=gen, device=dev, dtype=shape.dtype) for w in (qw, kw, kw))
            for _ in range(shape.layers)]

    def layer_inputs(x: torch.Tensor) -> list:
        """The model's q / k / v of each layer from the step's input (a slow drift)."""
        b = x.shape[0]
        return [(bq[:b] + x, bk[:b] + x[:, :kw], bv[:b] + x[:, kw:2 * kw]) for bq, bk, bv in base]

    world = SGLangWorld(cfg, dev, graphs=graphs, shape=shape, buckets=(batch,), max_running_requests=batch,
                        layer_inputs=layer_inputs, input_width=qw)
    rows = list(range(1, batch + 1))
    for row in rows:
        k = [torch.randn(context, kw, generator=gen, device=dev, dtype=shape.dtype) for _ in range(shape.layers)]
        v = [torch.randn_like(x) for x in k]
        world.prompt(row, k, v)
        del k, v
    per_step = [0.3 * torch.randn(batch, qw, generator=gen, device=dev, dtype=shape.dtype) for _ in range(steps + 1)]
    # the scheduler's batches, built before the timed loop (building one copies its rows
    # to the device, which waits for the device)
    batches = []
    for t in range(steps + 1):
        batches.append(world.batch(rows, [context + 1 + t] * batch))

    world.forward(batches[0], per_step[0])  # registers the prompts (offload to host) at their first decode
    if world.bridge is not None:
        world.bridge.coord.reset_stats()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    prof = cProfile.Profile() if profile else None
    t0 = time.perf_counter()
    if prof is not None:
        prof.enable()
    for t in range(1, steps + 1):
        world.forward(batches[t], per_step[t])
    if prof is not None:
        prof.disable()
    host = time.perf_counter() - t0
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    ms = (time.perf_counter() - t0) * 1000.0 / steps
    if prof is not None:
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
        print(f"--- host profile: {kind}, batch {batch} ---\n{text.getvalue()}", flush=True)
    out = {"run": kind, "batch": batch, "graphs": graphs, "ms_per_step": round(ms, 4),
           "host_ms_per_step": round(host * 1000.0 / steps, 4)}
    if graphs:  # the device time of one step: the last step's graph replayed alone
        graph = world.captured[batch][0]
        out["replay_ms"] = round(cuda_time_us(graph.replay, iters=20, warmup=2) / 1000.0, 4)
    if world.bridge is not None:
        st = world.bridge.coord.stats()
        out["hit_rate"] = round(st["hit_rate"], 4)
        out["bytes_loaded_per_step"] = st["bytes_loaded"] // max(1, st["steps"])
    del world, per_step, base, batches
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny shapes on CPU: checks the script")
    ap.add_argument("--out", default=None, help="result directory (default benchmarks/results)")
    ap.add_argument("--context", type=int, default=32768, help="prompt tokens per request")
    ap.add_argument("--batches", default="1,4", help="comma list of batch sizes")
    ap.add_argument("--layers", type=int, default=32, help="attention layers")
    ap.add_argument("--steps", type=int, default=96, help="timed decode steps (after the registering one)")
    ap.add_argument("--top-k", type=int, default=2048, help="tokens selected per step and layer")
    ap.add_argument("--runs", default=",".join(RUNS), help=f"comma list of runs from {RUNS}")
    ap.add_argument("--profile", action="store_true", help="print the host's cProfile of each timed loop")
    args = ap.parse_args(argv)
    if args.quick:
        dev = torch.device("cpu")
        shape_kw = dict(layers=2, q_heads=4, kv_heads=2, head_dim=16, dtype=torch.float32)
        sel_page = 4
        args.context, args.steps, args.top_k, batches = 64, 6, 8, [1, 2]
    else:
        if not torch.cuda.is_available():
            raise SystemExit("needs a GPU (or --quick)")
        dev = torch.device("cuda")
        shape_kw = dict(layers=args.layers, q_heads=32, kv_heads=8, head_dim=128, dtype=torch.bfloat16)
        sel_page = 64
        batches = [int(x) for x in args.batches.split(",")]
    kinds = [k for k in args.runs.split(",") if k]
    bad = [k for k in kinds if k not in RUNS]
    if bad or not kinds:
        ap.error(f"--runs={args.runs!r}: a comma list of {RUNS}")
    results = []
    for b in batches:
        ctx = -(-(args.context + args.steps + 2) // sel_page) * sel_page
        # SGLang's pool at --page-size 1: every prompt is on the GPU while it is prefilled,
        # plus (sparse) the requests' buffers and representations
        pool = b * (ctx + 2 * _buffer_tokens(sel_page, args.top_k) + sel_page)
        shape = Shape(context=ctx, rows=b + 1, pool_tokens=pool, **shape_kw)
        runs = {kind: run_one(kind, shape, b, args.context, args.steps, args.top_k, dev, seed=b,
                               profile=args.profile, sel_page=sel_page) for kind in kinds}
        dense_bytes = 2 * shape.layers * b * (args.context + args.steps) * shape.kv_heads * shape.head_dim * \
            torch.finfo(shape.dtype).bits // 8
        row = {"batch": b, "runs": list(runs.values()), "dense_kv_bytes_per_step": dense_bytes}
        for other in ("dense", "sparse_eager"):
            if other in runs and "sparse_graph" in runs:
                row[f"sparse_graph_speedup_vs_{other.split('_')[-1]}"] = round(
                    runs[other]["ms_per_step"] / runs["sparse_graph"]["ms_per_step"], 3)
        results.append(row)
        print(row, flush=True)
    payload = {**device_info(), "shape": {k: str(v) for k, v in shape_kw.items()}, "context": args.context,
               "steps": args.steps, "top_k": args.top_k, "results": results}
    if dev.type == "cuda":
        bw = hbm_copy_gbps()
        payload["hbm_copy_gbps"] = round(bw, 1)
        for row in results:
            row["dense_roofline_ms"] = round(row["dense_kv_bytes_per_step"] / (bw * 1e9) * 1e3, 4)
    path = write_result("sglang_plugin.json", payload, args.out)
    print(f"wrote {path}")
    return payload


if __name__ == "__main__":
    main()
