"""Where a decode step's GPU time goes: the kernels of one step, by total device time.

Builds one runtime point as bench_decode does (synthesised prefill, a query trace of fixed
rho), times graph replays, then profiles the same step eagerly with the torch profiler (the
graph holds the same kernels) and prints the kernels that take the most device time.

    PYTHONPATH=. python benchmarks/profile_decode_step.py --mode sparse-hier --context 65536 --batch 1
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.decode.point import MODES, make_runner  # noqa: E402
from sparsehi.config import SparseConfig  # noqa: E402
from sparsehi.runtime.model_config import get_model_config  # noqa: E402
from sparsehi.runtime.synth import synth_prefill  # noqa: E402
from sparsehi.runtime.traces import QueryTrace  # noqa: E402
from sparsehi.runtime.weights import build_model  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", default="sparse-hier", choices=MODES)
    ap.add_argument("--model", default="llama-8b-shape")
    ap.add_argument("--context", type=int, default=65536)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--rho", type=float, default=0.9995, help="query trace drift (bench_decode calibrates it)")
    ap.add_argument("--steps", type=int, default=8, help="timed graph replays")
    ap.add_argument("--top", type=int, default=25, help="kernels listed")
    ap.add_argument("--top-k", type=int, default=2048, help="selected tokens per step")
    ap.add_argument("--buffer", type=int, default=4096, help="device buffer tokens per request")
    args = ap.parse_args(argv)
    device, dtype = torch.device("cuda"), torch.bfloat16
    cfg = get_model_config(args.model)
    model = build_model(config=cfg, device=device, dtype=dtype)
    if cfg.family == "mla":
        sc = SparseConfig(algorithm="dsa", top_k=args.top_k, device_buffer_size=args.buffer, page_size=1, min_sparse_prompt_len=0,
                          sink_tokens=64, recent_tokens=64)
    else:
        sc = SparseConfig(algorithm="quest", top_k=args.top_k, device_buffer_size=args.buffer, page_size=16,
                          min_sparse_prompt_len=0, sink_tokens=64, recent_tokens=64)
    runner = make_runner(model, args.mode, args.context, args.batch, sc, 64, device, dtype)
    mode = runner.mode
    reqs = runner.new_requests([[0]] * args.batch)
    synth_prefill(mode, reqs, args.context, seed=1)
    mode.query_hook = QueryTrace(args.rho, seed=2, dsa=cfg.family == "mla")
    for _ in range(3):
        runner.decode_step(reqs)
    torch.cuda.synchronize()
    t = time.perf_counter()
    host, parts = [], {}
    for _ in range(args.steps):
        runner.decode_step(reqs)
        host.append(runner.last_host_ms)
        for k, v in runner.last_host_split.items():
            parts[k] = parts.get(k, 0.0) + v / args.steps
    torch.cuda.synchronize()
    step_ms = 1e3 * (time.perf_counter() - t) / args.steps
    print(f"{args.mode} {args.model} ctx={args.context} B={args.batch} graphs={runner.graphs.enabled}: "
          f"{step_ms:.2f} ms/step, host {sum(host) / len(host):.3f} ms/step (max {max(host):.3f}; "
          + ", ".join(f"{k} {v:.3f}" for k, v in parts.items()) + ")")
    runner.graphs.enabled = False
    runner.decode_step(reqs)
    torch.cuda.synchronize()
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        runner.decode_step(reqs)
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        us = getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)
        if us:
            rows.append((us, e.count, e.key))
    rows.sort(reverse=True)
    total = sum(r[0] for r in rows)
    print(f"eager step, device time of its kernels: {total / 1e3:.2f} ms in {sum(r[1] for r in rows)} launches")
    for us, n, key in rows[: args.top]:
        print(f"{us / 1e3:9.3f} ms {n:6d}x  {key[:110]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
