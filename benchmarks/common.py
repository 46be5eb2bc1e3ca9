"""Shared benchmark plumbing: device description, GPU timing, the large-copy limits
measured in the same run, result files.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
from pathlib import Path
from typing import Any, Callable

import torch

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo`` where there is one, else the platform's)."""
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:  # pragma: no cover - non-Linux
        pass
    return model


def device_info() -> dict[str, Any]:
    """What ran the benchmark: GPU name and memory, torch/triton versions, host CPU."""
    info: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else f"cpu ({platform.processor() or platform.machine()})",
        "date": _dt.date.today().isoformat(),
        "torch": torch.__version__,
        "host_cpus": os.cpu_count(),
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:  # pragma: no cover
        pass
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info["gpu_mem_gib"] = round(props.total_memory / 2**30, 1)
        info["sms"] = props.multi_processor_count
    return info


def cuda_time_us(fn: Callable[[], Any], iters: int = 50, warmup: int = 5, graph: bool = False) -> float:
    """Median GPU time of ``fn`` in microseconds, measured with CUDA events.

    graph=True captures ``iters`` calls in one CUDA graph and reports replay time / iters,
    which removes Python launch overhead (the way a CUDA-graph decode step runs).
    """
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    if graph:
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn()
            torch.cuda.synchronize()
            with torch.cuda.graph(g, stream=s):
                for _ in range(iters):
                    fn()
        torch.cuda.current_stream().wait_stream(s)
        times = []
        for _ in range(5):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            g.replay()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b) * 1000.0 / iters)
        times.sort()
        return times[len(times) // 2]
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1000.0)
    times.sort()
    return times[len(times) // 2]


def graph_replay_best_us(fn: Callable[[], Any], per_graph: int = 1, reps: int = 200, rounds: int = 5) -> float:
    """Microseconds of one ``fn`` call: ``per_graph`` calls captured in one CUDA graph (after
    three warm-up calls on a side stream), the best of ``rounds`` timings of ``reps`` replays."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(per_graph):
            fn()
    for _ in range(10):
        g.replay()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(rounds):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps):
            g.replay()
        b.record()
        torch.cuda.synchronize()
        best = min(best, a.elapsed_time(b) * 1000.0 / reps / per_graph)
    return best


def large_h2d_copy_gbps(nbytes: int = 1 << 30) -> float:
    """One large pinned-host -> device copy, GB/s (1e9): the PCIe limit of this run."""
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    us = cuda_time_us(lambda: dst.copy_(src, non_blocking=True), iters=10, warmup=2)
    return nbytes / (us * 1e-6) / 1e9


def large_d2h_copy_gbps(nbytes: int = 1 << 30) -> float:
    """One large device -> pinned-host copy, GB/s."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    us = cuda_time_us(lambda: dst.copy_(src, non_blocking=True), iters=10, warmup=2)
    return nbytes / (us * 1e-6) / 1e9


def hbm_copy_gbps(nbytes: int = 2 << 30) -> float:
    """Device -> device copy, GB/s counting bytes read + written: the HBM roofline."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    us = cuda_time_us(lambda: dst.copy_(src), iters=10, warmup=2)
    return 2 * nbytes / (us * 1e-6) / 1e9


def bf16_gemm_tflops(n: int = 8192) -> float:
    """``n^3`` bf16 matmul on random data, TFLOP/s: the tensor-core ceiling as the library
    reaches it on this device (the compute side of a roofline)."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    us = cuda_time_us(lambda: a @ b, iters=10, warmup=3, graph=True)
    return 2 * n ** 3 / (us * 1e-6) / 1e12


def write_result(name: str, payload: dict[str, Any], out_dir: str | os.PathLike | None = None) -> Path:
    """Write ``payload`` (device and date added when missing) as JSON to ``out_dir``
    (default: benchmarks/results) and return the path."""
    base = Path(out_dir or RESULTS_DIR)
    base.mkdir(parents=True, exist_ok=True)
    info = device_info()
    payload = {"device": info["device"], "date": info["date"], **payload}
    payload.setdefault("env", info)
    path = base / name
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path


def finish_checked_run(name: str, payload: dict[str, Any], bad: int, what_differs: str, timed: bool,
                       out_dir: str | os.PathLike | None = None) -> int:
    """The end of a benchmark whose rows are checked as they are timed: says how many
    ``bad`` rows ``what_differs``, writes ``payload`` as ``name`` when the run was ``timed``
    (a --quick CPU run writes nothing) and returns the exit code (1 if any row is bad)."""
    if bad:
        print(f"{bad} {what_differs}", flush=True)
    if timed:
        print(f"wrote {write_result(name, payload, out_dir)}", flush=True)
    return 1 if bad else 0


def result_parser(doc: str) -> argparse.ArgumentParser:
    """An argument parser described by ``doc``'s first line, with ``--commit`` (the commit of
    the kernels timed, recorded in the result) and ``--out`` (the result directory)."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--commit", default=None, help="commit of the kernels timed (recorded)")
    ap.add_argument("--out", default=None, help="result directory (default benchmarks/results)")
    return ap
