"""Device time per kernel of one bench_decode point's decode step, graph-replayed as the
runtime runs it: which kernels a step's time goes to (bench_decode's own split times
sections with events, which serialises them; this reads the kernels' own durations).

    PYTHONPATH=. python benchmarks/profile_decode_kernels.py --context 1048576 --mode sparse-hier-fp8
    PYTHONPATH=. python benchmarks/profile_decode_kernels.py --quick     # CPU smoke run (no kernel times)

The point is built as bench_decode builds it (llama-8b-shape, Quest, top-k 2048 tokens,
buffer 4096, page 16, synthesised prefill, the calibrated 85 % query trace's rho given with
``--rho``); ``--steps`` replays are profiled after ``--warmup`` ones. Output: kernels by
total device time per step, grouped by name, and their sum beside the step's wall time.
"""
from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import write_result  # noqa: E402
from benchmarks.decode import modes  # noqa: E402
from benchmarks.decode.modes import ALL_MODES, is_hierarchical, loads_ahead  # noqa: E402
from benchmarks.decode.point import make_runner  # noqa: E402
from sparsehi.config import SparseConfig  # noqa: E402
from sparsehi.runtime.model_config import get_model_config  # noqa: E402
from sparsehi.runtime.synth import synth_prefill  # noqa: E402
from sparsehi.runtime.traces import QueryTrace  # noqa: E402
from sparsehi.runtime.weights import build_model  # noqa: E402

SYNTH_CHUNK = 65536
PROFILED_MODES = ("sparse-gpu",) + tuple(m for m in ALL_MODES if is_hierarchical(m))


def kernel_times(prof, steps: int) -> list[dict]:
    """``[{name, us_per_step, calls_per_step}]`` of the device kernels, largest first."""
    us: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            us[ev.name] += ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
            calls[ev.name] += 1
    out = [{"name": n, "us_per_step": t / steps, "calls_per_step": calls[n] / steps} for n, t in us.items()]
    return sorted(out, key=lambda r: -r["us_per_step"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--context", type=int, default=65536)
    ap.add_argument("--mode", default="sparse-hier-fp8", help=f"one of {PROFILED_MODES}")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--lookahead-pages", type=int, default=None,
                    help=f"pages the -ahead modes load ahead per layer (default {modes.LOOKAHEAD_PAGES}; 2 with --quick)")
    ap.add_argument("--rho", type=float, default=0.9893, help="query trace rho (bench_decode's calibration)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="tiny model on CPU: the path only")
    ap.add_argument("--out", type=Path, default=None, help="JSON result file")
    a = ap.parse_args(argv)
    if a.mode not in PROFILED_MODES:
        ap.error(f"--mode must be one of {PROFILED_MODES}, got {a.mode!r}")
    if a.lookahead_pages is not None or a.quick:
        modes.LOOKAHEAD_PAGES = a.lookahead_pages if a.lookahead_pages is not None else 2
    cuda = torch.cuda.is_available() and not a.quick
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    cfg = get_model_config("tiny-gqa", num_layers=2) if a.quick else get_model_config("llama-8b-shape")
    ctx = 1024 if a.quick else a.context
    K, ps = (64, 16) if a.quick else (2048, 16)
    sc = SparseConfig(algorithm="quest", top_k=K, device_buffer_size=2 * K, page_size=ps, min_sparse_prompt_len=0,
                      sink_tokens=16 if a.quick else 64, recent_tokens=16 if a.quick else 64)
    model = build_model(config=cfg, device=device, dtype=dtype)
    steps = a.warmup + a.steps + 2
    runner = make_runner(model, a.mode, ctx, a.batch, sc, steps, device, dtype)
    reqs = runner.new_requests([[0]] * a.batch)
    synth_prefill(runner.mode, reqs, ctx, seed=1, chunk_tokens=SYNTH_CHUNK)
    runner.mode.query_hook = QueryTrace(a.rho, seed=2)
    for _ in range(a.warmup):
        runner.decode_step(reqs)
    if cuda:
        torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    t = time.perf_counter()
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(a.steps):
            runner.decode_step(reqs)
        if cuda:
            torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - t) * 1e3 / a.steps
    kernels = kernel_times(prof, a.steps) if cuda else []
    total = sum(k["us_per_step"] for k in kernels)
    result = {"mode": a.mode, "context": ctx, "batch": a.batch,
              "lookahead_pages": modes.LOOKAHEAD_PAGES if loads_ahead(a.mode) else 0,
              "rho": a.rho, "profiled_steps": a.steps, "graphs": runner.graphs.enabled,
              "step_wall_ms_profiled": wall_ms, "kernel_us_per_step_sum": total, "kernels": kernels[:40]}
    for k in kernels[:25]:
        print(f"{k['us_per_step']:10.1f} us/step {k['calls_per_step']:7.1f} calls  {k['name'][:110]}")
    print(f"kernels: {total / 1e3:.2f} ms/step of device time; step wall (profiled) {wall_ms:.2f} ms")
    if a.out is not None:
        write_result(a.out.name, result, a.out.parent)  # device and date added
    return 0


if __name__ == "__main__":
    sys.exit(main())
