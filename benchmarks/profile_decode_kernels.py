"""Device time per kernel of one bench_decode point's decode step, graph-replayed as the
runtime runs it: which kernels a step's time goes to (bench_decode's own split times
sections with events, which serialises them; this reads the kernels' own durations).

    PYTHONPATH=. python benchmarks/profile_decode_kernels.py --context 1048576 --mode sparse-hier-fp8
    PYTHONPATH=. python benchmarks/profile_decode_kernels.py --model dsv32-shape --context 32768 \
        --mode dense,sparse-hier --batch 1,30
    PYTHONPATH=. python benchmarks/profile_decode_kernels.py --quick     # CPU smoke run (no kernel times)

Each point is built as bench_decode builds it: llama-8b-shape with Quest (page 16) or
dsv32-shape with DSA (page 1), top-k 2048 tokens, buffer 4096, synthesised prefill, the
85 % query trace (with DSA it drives the indexer's queries too, as in bench_decode) at the
rho bench_decode calibrates for the model and context (``--rho calibrate``, the default: on
two requests with all KV on the device, or where those do not fit on each point's own
representations) or at the rho given with ``--rho``; ``--steps`` replays are profiled after
``--warmup`` ones and, in hierarchical modes, after the LRU buffers are full
(``benchmarks.decode.point.fill_buffers``).
``--mode`` and ``--batch`` take comma lists and every pair is profiled in one process.
Output: kernels by total device time per step, grouped by name, their sum and the device's
busy time (union of kernel intervals) beside the step's wall time, and the critical-path
misses per profiled step.
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
from benchmarks.decode.point import FILL_STEPS_MAX, fill_buffers, make_runner  # noqa: E402
from benchmarks.decode.sizing import device_room  # noqa: E402
from benchmarks.decode.traces import NothingToCalibrate, calibrate, calibrate_on, calibration_fits  # noqa: E402
from sparsehi.config import SparseConfig  # noqa: E402
from sparsehi.runtime.model_config import get_model_config  # noqa: E402
from sparsehi.runtime.synth import synth_prefill  # noqa: E402
from sparsehi.runtime.traces import QueryTrace  # noqa: E402
from sparsehi.runtime.weights import build_model  # noqa: E402

SYNTH_CHUNK = 65536
PROFILED_MODES = ("dense", "sparse-gpu") + tuple(m for m in ALL_MODES if is_hierarchical(m))
MODELS = ("llama-8b-shape", "dsv32-shape")


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


def device_busy_us(prof) -> tuple[float, float]:
    """``(busy, span)`` in us over the profiled steps: the union of the kernels' intervals
    and the time from the first kernel's start to the last one's end (span - busy: the
    device idle between kernels, e.g. launch gaps)."""
    iv = sorted((ev.time_range.start, ev.time_range.end) for ev in prof.events()
                if ev.device_type == torch.autograd.DeviceType.CUDA)
    if not iv:
        return 0.0, 0.0
    busy, (lo, hi) = 0.0, iv[0]
    for s, e in iv[1:]:
        if s > hi:
            busy += hi - lo
            lo, hi = s, e
        else:
            hi = max(hi, e)
    busy += hi - lo
    return busy, iv[-1][1] - iv[0][0]


def sparse_config(model_name: str, quick: bool) -> SparseConfig:
    """bench_decode's selection for the model: Quest over 16-token pages (GQA) or DSA over
    single tokens (MLA); top-k 2048 tokens and a buffer of twice that (64 with --quick)."""
    K = 64 if quick else 2048
    sink = 16 if quick else 64
    if model_name == "dsv32-shape":
        return SparseConfig(algorithm="dsa", top_k=K, device_buffer_size=2 * K, page_size=1, min_sparse_prompt_len=0,
                            sink_tokens=sink, recent_tokens=sink)
    return SparseConfig(algorithm="quest", top_k=K, device_buffer_size=2 * K, page_size=16, min_sparse_prompt_len=0,
                        sink_tokens=sink, recent_tokens=sink)


RHO_WITHOUT_SELECTION = 0.9893
"""The trace's rho where ``--rho calibrate`` finds nothing to calibrate on (a mode without a
selection algorithm, or a model whose every layer is dense): there the rho changes values
but no step's work."""


def point_rho(runner, reqs, model, ctx: int, sc: SparseConfig, a, device) -> tuple[float, str]:
    """``(rho, how it was found)`` of a point's query trace: ``a.rho`` where the run has one;
    else calibrated to 85 % overlap on the point's own representations (prefilled), or
    ``RHO_WITHOUT_SELECTION`` for a mode without a selection algorithm."""
    if a.rho is not None:
        return a.rho, a.rho_source
    if getattr(runner.mode, "algorithm", None) is None:
        return RHO_WITHOUT_SELECTION, "fixed (no selection algorithm to calibrate on)"
    try:
        rho, got = calibrate_on(runner.mode, reqs, model, ctx, sc, 0.85, a.calibration_iters, device,
                                next(model.parameters()).dtype)
    except NothingToCalibrate as e:
        return RHO_WITHOUT_SELECTION, f"fixed ({e})"
    return rho, f"calibrated on this point's representations (overlap {got:.3f})"


def profile_point(model, mode: str, ctx: int, batch: int, sc: SparseConfig, a, device, cuda: bool) -> dict:
    """One point's kernels per step (largest first) and its profiled wall time."""
    runner = make_runner(model, mode, ctx, batch, sc, a.warmup + a.steps + 2 + FILL_STEPS_MAX, device,
                         next(model.parameters()).dtype)
    reqs = runner.new_requests([[0]] * batch)
    synth_prefill(runner.mode, reqs, ctx, seed=1, chunk_tokens=SYNTH_CHUNK)
    # bench_decode's trace: with DSA it drives the indexer's queries too (without them the
    # indexer's picks drift at random and nearly every selected token misses)
    rho, rho_source = point_rho(runner, reqs, model, ctx, sc, a, device)
    runner.mode.query_hook = QueryTrace(rho, seed=2, dsa=model.cfg.family == "mla")
    for _ in range(a.warmup):
        runner.decode_step(reqs)
    if is_hierarchical(mode):  # bench_decode's steady state: the LRU buffers full
        fill_buffers(runner, reqs, FILL_STEPS_MAX)
    coord = getattr(runner.mode, "coord", None)
    if coord is not None:
        coord.reset_stats()
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
    busy, span = device_busy_us(prof) if cuda else (0.0, 0.0)
    misses = None
    if coord is not None and is_hierarchical(mode):
        st = coord.stats()
        misses = st["misses"] / max(1, st["steps"])
    result = {"model": model.cfg.name, "mode": mode, "context": ctx, "batch": batch,
              "lookahead_pages": modes.LOOKAHEAD_PAGES if loads_ahead(mode) else 0,
              "rho": rho, "rho_source": rho_source, "profiled_steps": a.steps, "graphs": runner.graphs.enabled,
              "step_wall_ms_profiled": wall_ms, "kernel_us_per_step_sum": total,
              "device_busy_us_per_step": busy / a.steps, "device_span_us_per_step": span / a.steps,
              "misses_per_step": misses, "warmup_steps": a.warmup, "kernels": kernels[:40]}
    print(f"== {model.cfg.name} {mode} ctx={ctx} batch={batch}", flush=True)
    for k in kernels[:25]:
        print(f"{k['us_per_step']:10.1f} us/step {k['calls_per_step']:7.1f} calls  {k['name'][:110]}")
    print(f"kernels: {total / 1e3:.2f} ms/step of device time (busy {busy / a.steps / 1e3:.2f} ms of a "
          f"{span / a.steps / 1e3:.2f} ms span); step wall (profiled) {wall_ms:.2f} ms; misses/step {misses}",
          flush=True)
    del runner, reqs
    if cuda:
        torch.cuda.empty_cache()
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama-8b-shape", help=f"one of {MODELS}")
    ap.add_argument("--context", type=int, default=65536)
    ap.add_argument("--mode", default="sparse-hier-fp8", help=f"comma list of {PROFILED_MODES}")
    ap.add_argument("--batch", default="1", help="comma list of batch sizes")
    ap.add_argument("--lookahead-pages", type=int, default=None,
                    help=f"pages the -ahead modes load ahead per layer (default {modes.LOOKAHEAD_PAGES}; "
                         "2 with --quick)")
    ap.add_argument("--rho", default="calibrate",
                    help="query trace rho: a float, or 'calibrate' (default): bench_decode's calibration to 85 %% "
                         "adjacent-step top-k overlap for this model and context")
    ap.add_argument("--warmup", type=int, default=3,
                    help="decode steps before the profiled ones (hierarchical modes then decode until their LRU "
                         "buffers are full, as bench_decode does)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="tiny model on CPU: the path only")
    ap.add_argument("--out", type=Path, default=None, help="JSON result file")
    a = ap.parse_args(argv)
    mode_list = a.mode.split(",")
    bad = [m for m in mode_list if m not in PROFILED_MODES]
    if bad:
        ap.error(f"--mode must be a comma list of {PROFILED_MODES}, got {bad}")
    if a.model not in MODELS:
        ap.error(f"--model must be one of {MODELS}, got {a.model!r}")
    try:
        batches = [int(b) for b in a.batch.split(",")]
    except ValueError:
        ap.error(f"--batch must be a comma list of positive ints, got {a.batch!r}")
    if any(b < 1 for b in batches):
        ap.error(f"--batch must be a comma list of positive ints, got {a.batch!r}")
    if a.rho != "calibrate":
        try:
            a.rho = float(a.rho)
        except ValueError:
            ap.error(f"--rho must be a float or 'calibrate', got {a.rho!r}")
        if not 0.0 <= a.rho <= 1.0:
            ap.error(f"--rho must be a float in [0, 1] or 'calibrate', got {a.rho}")
        a.rho_source = "given (--rho)"
    if a.lookahead_pages is not None or a.quick:
        modes.LOOKAHEAD_PAGES = a.lookahead_pages if a.lookahead_pages is not None else 2
    cuda = torch.cuda.is_available() and not a.quick
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    if a.quick:
        cfg = get_model_config("tiny-dsa" if a.model == "dsv32-shape" else "tiny-gqa", num_layers=2)
    else:
        cfg = get_model_config(a.model)
    ctx = 1024 if a.quick else a.context
    sc = sparse_config(a.model, a.quick)
    model = build_model(config=cfg, device=device, dtype=dtype)
    a.calibration_iters = 3 if a.quick else 8  # bench_decode's
    if a.rho == "calibrate":
        a.rho = None
        if calibration_fits(model, ctx, dtype, device_room(device)):
            try:
                a.rho, got = calibrate(model, ctx, sc, 0.85, a.calibration_iters, device, dtype)
                a.rho_source = f"calibrated on two requests, all KV on the device (overlap {got:.3f})"
                print(f"trace calibrated: rho={a.rho:.5f} -> overlap {got:.3f}", flush=True)
            except NothingToCalibrate as e:
                a.rho, a.rho_source = RHO_WITHOUT_SELECTION, f"fixed ({e})"
    points = [profile_point(model, m, ctx, b, sc, a, device, cuda) for m in mode_list for b in batches]
    if a.out is not None:
        # one point keeps the file's earlier form (the point's keys at the top level)
        result = points[0] if len(points) == 1 else {"points": points}
        write_result(a.out.name, result, a.out.parent)  # device and date added
    return 0


if __name__ == "__main__":
    sys.exit(main())
