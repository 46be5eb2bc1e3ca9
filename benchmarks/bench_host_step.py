"""Host time of a decode step outside the graph replay, every mode, across page boundaries.

The CUDA-graph decode step leaves the host three parts (``PendingStep.split``): ``prepare``
(the mode's host part: batch checks, pages for the rows that open one, vectorised, and
the step counter), ``launch`` (the step's inputs into the graph's static buffers, the
replay, the start of the tokens' read-back, the lengths) and ``after`` (recording the
tokens). The target is at most 1 ms of host time outside the replay per step at every
batch. Steps that open a page do the most host work, so each run decodes enough steps to
cross ``--boundaries`` page boundaries and reports the steps that open a page apart.

Two schedules (``--schedules``): ``overlap`` (the default of ``generate``, SGLang's overlap
scheduler: step t+1's host part runs while step t replays) and ``wait`` (every step is
waited for before the next is prepared). Per step the run records the host's own time
(``host_ms``) and, from CUDA events, how long the device sat idle between the end of one
replay and the start of the next step's input copy (``device_gap_ms``): the host time
that is really outside the replay. Under ``wait`` the gap holds the whole host part plus
the read-back; under ``overlap`` only what the host could not finish while the previous
step ran.

A fixed pure-Python probe is timed before and after every step (``cpu_probe``): when a slow
step sits beside a slow probe, the host thread itself ran slower in that window.

Model: the Llama-8B shape (random weights; host time does not depend on them), Quest,
page 16, K = 2048 tokens, buffer 2 x K, as ``bench_decode.py`` scenario a; prompts are
filled synthetically (``synth_prefill``) at ``--context`` tokens.

Usage: ``PYTHONPATH=. python benchmarks/bench_host_step.py`` on a GPU (``--quick``: tiny
model on CPU, eager, to check the script). Result: ``host_step.json``.
"""
from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.decode.point import make_runner  # noqa: E402
from benchmarks.common import write_result  # noqa: E402
from sparsehi.config import SparseConfig  # noqa: E402
from sparsehi.runtime.model_config import get_model_config  # noqa: E402
from sparsehi.runtime.synth import synth_prefill  # noqa: E402
from sparsehi.runtime.weights import build_model  # noqa: E402

MODES = ("dense", "sparse-gpu", "sparse-hier", "offload-full")
SCHEDULES = ("overlap", "wait")
TARGET_MS = 1.0


def _stats(xs: list[float]) -> Optional[dict[str, float]]:
    if not xs:
        return None
    return {"mean": round(statistics.mean(xs), 3), "p50": round(statistics.median(xs), 3), "max": round(max(xs), 3),
            "n": len(xs)}


def cpu_probe_us(n: int = 400) -> float:
    """Microseconds of a fixed piece of pure-Python work (no torch, no allocation).

    Timed right before and right after every step, it shows whether a slow step did more
    work or ran on a slower host: when the probe beside a slow step is slow by the same
    factor, the host thread itself ran slower in that window (the machine, not the step)."""
    t = time.perf_counter()
    acc = 0
    for i in range(n):
        acc += i * i % 7
    return 1e6 * (time.perf_counter() - t)


def run_point(model, mode: str, ctx: int, batch: int, sc: SparseConfig, steps: int, device, dtype,
              schedule: str = "overlap") -> dict[str, Any]:
    """Decode ``steps`` steps (after two warm-up steps) in ``schedule``; host ms and device
    idle ms per step."""
    runner = make_runner(model, mode, ctx, batch, sc, steps + 2, device, dtype)
    runner.rt.overlap_schedule = schedule == "overlap"
    reqs = runner.new_requests([[0]] * batch)
    synth_prefill(runner.mode, reqs, ctx, seed=1)
    runner.graphs.warm(batch, runner.mode.decode_graph_key(reqs))
    for _ in range(2):
        runner.decode_step(reqs)
    ps = sc.page_size
    opening, other = [], []
    worst: dict[str, Any] = {"ms": -1.0}
    probes: list[float] = []  # per step: the mean of the probe before and the one after
    host: list[float] = []
    first_pos = reqs[0].seq_len  # position of the token the first timed step writes
    state = {"before": cpu_probe_us()}

    def on_step(t: int, step) -> None:
        after = cpu_probe_us()
        probe = 0.5 * (state["before"] + after)
        state["before"] = after
        ms = step.host_ms
        probes.append(probe)
        host.append(ms)
        opens = (first_pos + t) % ps == 0
        (opening if opens else other).append(ms)
        if ms > worst["ms"]:
            worst.update({"ms": round(ms, 3), "opens_page": opens, "probe_us": round(probe, 1),
                          "split": {k: round(v, 3) for k, v in step.split.items()}})

    runner.graphs.time_device = device.type == "cuda"
    runner.decode_steps(reqs, steps, on_step=on_step)
    gaps = runner.graphs.device_gaps_ms()
    runner.graphs.time_device = False
    allv = opening + other
    p50 = statistics.median(probes)
    slow = [p / p50 for p, ms in zip(probes, host) if ms > TARGET_MS]
    worst["probe_over_median"] = round(worst["probe_us"] / p50, 2)
    row = {"mode": mode, "batch": batch, "context": ctx, "steps": steps, "schedule": schedule,
           "graphs": runner.graphs.enabled,
           "host_ms": _stats(allv), "host_ms_opening_steps": _stats(opening), "host_ms_other_steps": _stats(other),
           "device_gap_ms": _stats(gaps), "worst_step": worst,
           "meets_1ms": (max(gaps) if gaps else max(allv)) <= TARGET_MS,
           "cpu_probe": {"p50_us": round(p50, 1), "max_over_median": round(max(probes) / p50, 2),
                         "steps_over_target": len(slow),
                         "over_target_probe_over_median": round(statistics.median(slow), 2) if slow else None}}
    del runner
    gc.collect()  # the runner's pools and graphs hold GPU memory until its cycles are collected
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def main(argv: Optional[list[str]] = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny model on CPU (eager): checks the script")
    ap.add_argument("--out", default=None, help="result directory (default benchmarks/results)")
    ap.add_argument("--context", type=int, default=8192, help="prompt tokens (host time barely depends on it)")
    ap.add_argument("--batches", default="1,8,32", help="comma list of batch sizes")
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma list of modes from {MODES}")
    ap.add_argument("--boundaries", type=int, default=3, help="page boundaries each run crosses")
    ap.add_argument("--schedules", default="overlap,wait", help=f"comma list of schedules from {SCHEDULES}")
    args = ap.parse_args(argv)
    schedules = [x for x in args.schedules.split(",") if x]
    if not schedules or any(x not in SCHEDULES for x in schedules):
        ap.error(f"--schedules={args.schedules!r} is invalid: a comma list from {SCHEDULES}")
    modes = [m for m in args.modes.split(",") if m]
    bad = [m for m in modes if m not in MODES]
    if bad:
        ap.error(f"--modes has {bad}: allowed {MODES}")
    try:
        batches = [int(b) for b in args.batches.split(",") if b]
    except ValueError:
        ap.error(f"--batches={args.batches!r} is invalid: comma-separated integers >= 1")
    if not batches or min(batches) < 1:
        ap.error(f"--batches={args.batches!r} is invalid: comma-separated integers >= 1")
    cuda = torch.cuda.is_available() and not args.quick
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    if args.quick:
        cfg, k, ps, ctx, batches = get_model_config("tiny-gqa", num_layers=2), 64, 16, 256, batches[:2]
    else:
        cfg, k, ps, ctx = get_model_config("llama-8b-shape"), 2048, 16, args.context
    model = build_model(config=cfg, device=device, dtype=dtype)
    sc = SparseConfig(algorithm="quest", top_k=k, device_buffer_size=2 * k, page_size=ps, min_sparse_prompt_len=0,
                      sink_tokens=64 if not args.quick else 16, recent_tokens=64 if not args.quick else 16)
    steps = args.boundaries * ps + 1
    rows = []
    t0 = time.perf_counter()
    for schedule in schedules:
        for mode in modes:
            for b in batches:
                try:
                    row = run_point(model, mode, ctx, b, sc, steps, device, dtype, schedule)
                except (RuntimeError, ValueError) as e:  # e.g. out of device memory for the dense KV
                    row = {"mode": mode, "batch": b, "context": ctx, "schedule": schedule,
                           "skipped": f"{type(e).__name__}: {e}"[:300]}
                    if cuda:
                        torch.cuda.empty_cache()
                rows.append(row)
                print(f"[{time.perf_counter() - t0:6.1f} s] {schedule:>7} {mode:>12} B={b:<3} "
                      f"host={row.get('host_ms') or row.get('skipped')} gap={row.get('device_gap_ms')} "
                      f"worst={row.get('worst_step')}", flush=True)
    measured = [r for r in rows if "host_ms" in r]

    def worst_of(key: str, schedule: str) -> Optional[float]:
        vals = [r[key]["max"] for r in measured if r["schedule"] == schedule and r.get(key)]
        return max(vals) if vals else None

    payload = {
        "what": "per decode step, every mode and schedule: the host's time outside the device's work (prepare + "
                "launch + after) and the device's idle time between one replay's end and the next step's input copy "
                "(CUDA events); steps that open a page apart",
        "target": f"<= {TARGET_MS} ms of host time outside the replay per step, at every batch: the device idle "
                  "gap between steps (meets_1ms)",
        "model": cfg.name, "context": ctx, "page_size": ps, "top_k": k,
        "max_host_ms": {s_: worst_of("host_ms", s_) for s_ in schedules},
        "max_device_gap_ms": {s_: worst_of("device_gap_ms", s_) for s_ in schedules},
        "all_meet_target": {s_: all(r["meets_1ms"] for r in measured if r["schedule"] == s_) for s_ in schedules},
        "cpu_probe": "a fixed piece of pure-Python work timed before and after every step (cpu_probe_us): "
                     "over_target_probe_over_median > 1 says the host ran slower beside the steps over the target",
        "rows": rows,
    }
    path = write_result("host_step.json", payload, args.out)
    print(f"wrote {path}; max host ms/step {payload['max_host_ms']}, max device gap ms "
          f"{payload['max_device_gap_ms']}, all <= {TARGET_MS} ms: {payload['all_meet_target']}", flush=True)
    return payload


if __name__ == "__main__":
    main()
