#!/usr/bin/env python
"""Run one soak mode and record it in benchmarks/results/soak.json (replacing the run of the
same mode and device).

    python scripts/soak.py --mode ci                      # 2,000 requests, CPU
    python scripts/soak.py --mode long --max-seconds 600  # up to 50,000, ends by 10 min
    python scripts/soak.py --mode long --device cuda      # decode steps CUDA-graph captured
    python scripts/soak.py --mode gpu-realistic --device cuda --max-seconds 480 --out DIR
                                                          # 5,400 requests at users' sizes
    python scripts/soak.py --mode gpu-realistic --device cuda --concurrent --mps --out DIR
                                                          # sub-runs at once, kernels sharing the SMs
    python scripts/soak.py --mode gpu-realistic --scale 0.03 --requests 60   # the same, tiny, CPU

``ci`` and ``long`` are ``tests/soak/harness.py``: sparse-hier with the HiRadixTree and a file
L3 wrapped in the fault injector. ``gpu-realistic`` is ``tests/soak/realistic.py``: the same
harness in three sub-runs (Quest at page sizes 16 and 64, DSA) with 1k-32k-token prompts,
64-512 decode steps and 64 requests decoding together; ``--max-seconds`` is split across
the sub-runs so that the whole run ends by it. Every mode fails (exit 1) on any mismatched
token, leaked slot or fault not served as a miss.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

STARTED = time.perf_counter()
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.common import cpu_model  # noqa: E402
from benchmarks.cuda_mps import cuda_mps  # noqa: E402

from soak import realistic  # noqa: E402
from soak.harness import SoakConfig, run_soak  # noqa: E402
from soak.test_soak import CI_FAULTS  # noqa: E402

DATE = "2026-11-25"
MODES = {"ci": 2_000, "long": 50_000, realistic.MODE: realistic.REQUESTS}
RESULTS = ROOT / "benchmarks" / "results" / "soak.json"


def device_name(device: str) -> str:
    if torch.device(device).type == "cuda":
        return f"cuda: {torch.cuda.get_device_name(torch.device(device))}"
    return f"cpu: {cpu_model()} ({os.cpu_count()} cores visible, {torch.get_num_threads()} torch thread(s))"


def record(path: Path, run: dict, base: Path = RESULTS) -> None:
    """Write ``path`` = its runs (or ``base``'s when it does not exist yet) with ``run``
    replacing the run of the same (mode, device)."""
    src = path if path.exists() else base
    data = json.loads(src.read_text()) if src.exists() else {"date": DATE, "runs": []}
    data["date"] = DATE
    data["runs"] = [r for r in data.get("runs", []) if (r["mode"], r["device"]) != (run["mode"], run["device"])]
    data["runs"].append(run)
    data["runs"].sort(key=lambda r: (r["mode"], r["device"]))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")


def run_harness_mode(a, requests: int) -> tuple[dict, bool]:
    long = a.mode == "long"
    with tempfile.TemporaryDirectory(prefix="soak-l3-") as l3dir:
        cfg = SoakConfig(requests=requests, seed=a.seed, device=a.device, cuda_graph=not a.no_cuda_graph,
                         # long mode: more distinct prompts, so the tree and L3 keep turning over
                         num_prefixes=8 if long else 6, suffixes_per_prefix=48 if long else 16,
                         storage="file", storage_extra={"file_path": l3dir},
                         faults=None if a.no_faults else CI_FAULTS, max_seconds=a.max_seconds,
                         check_every=1000 if long else 200)
        res = run_soak(cfg)
    d = res.as_dict()
    run = {"mode": a.mode, "device": device_name(a.device),
           **{k: d[k] for k in ("requests", "mismatched_tokens", "leaked_slots", "faults_injected",
                                "faults_served_as_miss", "peak_host_mib", "elapsed_s")},
           "requests_asked": requests, "cuda_graph": bool(a.device.startswith("cuda") and not a.no_cuda_graph),
           "faults_reaching_read": d["faults_reaching_read"], "fault_counts": d["fault_counts"],
           "tokens_checked": d["tokens_checked"], "distinct_prompts": d["distinct_prompts"],
           "reference_s": d["reference_s"], "prefix_hit_tokens": d["prefix_hit_tokens"],
           "l3_hit_tokens": d["l3_hit_tokens"], "l3_pages_written": d["l3_pages_written"],
           "quiescent_checks": d["quiescent_checks"], "rss_growth_mib": d["rss_growth_mib"]}
    ok = res.mismatched_tokens == 0 and res.leaked_slots == 0 and res.faults_served_as_miss == res.faults_reaching_read
    return run, ok


def run_realistic_mode(a, requests: int) -> tuple[dict, bool]:
    budget = a.max_seconds if a.max_seconds is not None else realistic.DEFAULT_BUDGET_S
    l3_root = tempfile.mkdtemp(prefix="soak-l3-", dir=a.l3_dir or realistic.default_l3_parent())
    try:
        subs = realistic.plan(requests, a.scale, a.device, a.seed, faults=not a.no_faults, l3_root=l3_root,
                              max_batch=a.max_batch, copies=a.copies)
        for s in subs:
            s.cfg.cuda_graph = not a.no_cuda_graph
        # the budget counts from the process start (imports, CUDA start-up) to the record
        left = budget - (time.perf_counter() - STARTED) - 5.0
        with cuda_mps(a.mps) as mps:
            if a.concurrent:
                records = realistic.run_plan_concurrently(subs, left, threads=a.threads, progress=print,
                                                          on_started=mps.servers)
            else:
                records = realistic.run_plan(subs, left, progress=print)
    finally:
        shutil.rmtree(l3_root, ignore_errors=True)
    run = realistic.summary(records, device_name(a.device), budget, time.perf_counter() - STARTED, requests)
    run["scale"] = a.scale
    run["concurrent"] = a.concurrent
    run["copies"] = a.copies
    run["device_sharing"] = mps.sharing
    if a.mps:
        run["mps_servers_seen"] = len(mps.servers_seen)
        if mps.why_not:
            run["mps_why_not"] = mps.why_not
    run["triton_f32_default"] = os.environ.get("TRITON_F32_DEFAULT")
    run["cuda_graph"] = bool(a.device.startswith("cuda") and not a.no_cuda_graph)
    ok = all(r.result["mismatched_tokens"] == 0 and r.result["leaked_slots"] == 0
             and r.result["faults_served_as_miss"] == r.result["faults_reaching_read"] for r in records)
    return run, ok


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=tuple(MODES), default="ci")
    ap.add_argument("--requests", type=int, default=None,
                    help="default: 2,000 (ci), 50,000 (long), 5,400 (gpu-realistic, split across its sub-runs)")
    ap.add_argument("--max-seconds", type=float, default=None,
                    help="wall-time budget: no request is admitted that could end past it (gpu-realistic: from "
                         f"the process start, split across the sub-runs; default {realistic.DEFAULT_BUDGET_S:.0f})")
    ap.add_argument("--scale", type=float, default=1.0,
                    help="gpu-realistic: multiplies every token count (prompts, decode lengths, Top-k, buffers), "
                         "e.g. 0.03 for a CPU run; page sizes stay")
    ap.add_argument("--max-batch", type=int, default=None,
                    help="gpu-realistic: requests decoding together (default 64 at scale 1)")
    ap.add_argument("--concurrent", action="store_true",
                    help="gpu-realistic: run the sub-runs at once, a process each, sharing the device, each with "
                         "the whole budget (default: one after another, the budget split)")
    ap.add_argument("--copies", type=int, default=1,
                    help=f"{realistic.MODE}: sub-runs per shape (own seeds and L3 directories; with --concurrent, a "
                         "process each)")
    ap.add_argument("--mps", action="store_true",
                    help="with --concurrent on CUDA: run the sub-runs' processes under a CUDA MPS daemon started for "
                         "the run, so their kernels share the SMs instead of taking turns (time-sliced, logged, "
                         "where the daemon cannot start)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda[:n]")
    ap.add_argument("--no-cuda-graph", action="store_true", help="CUDA: decode eagerly instead of graph replays")
    ap.add_argument("--no-faults", action="store_true", help="no fault injection")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    ap.add_argument("--l3-dir", default=None, help="where the L3 file store's temporary directory goes (default: "
                                                   "gpu-realistic /dev/shm where writable, else the system's "
                                                   "temporary directory)")
    ap.add_argument("--output", type=Path, default=RESULTS, help="results file")
    ap.add_argument("--out", type=Path, default=None,
                    help="directory: write DIR/soak.json (benchmarks/results/soak.json's runs plus this one) "
                         "instead of --output")
    ap.add_argument("--note", default=None, help="a remark stored with the run (e.g. why it stopped short)")
    ap.add_argument("--no-record", action="store_true", help="print the run, do not write the results file")
    a = ap.parse_args(argv)
    requests = a.requests if a.requests is not None else MODES[a.mode]
    if requests < 1:
        ap.error(f"--requests must be >= 1, got {requests}")
    if not 0 < a.scale <= 1:
        ap.error(f"--scale must be in (0, 1], got {a.scale}")
    if a.copies < 1 or (a.copies != 1 and a.mode != realistic.MODE):
        ap.error(f"--copies must be >= 1 and applies to --mode {realistic.MODE} only, got {a.copies}")
    if a.scale != 1.0 and a.mode != realistic.MODE:
        ap.error(f"--scale applies to --mode {realistic.MODE} only")
    if a.mps and not (a.concurrent and a.device.startswith("cuda")):
        ap.error("--mps needs --concurrent and --device cuda")
    torch.set_num_threads(a.threads)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if a.mode == realistic.MODE:
        run, ok = run_realistic_mode(a, requests)
    else:
        run, ok = run_harness_mode(a, requests)
    if a.note:
        run["note"] = a.note
    print(json.dumps(run, indent=2))
    if not a.no_record:
        record(a.out / "soak.json" if a.out is not None else a.output, run)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
