#!/usr/bin/env python
"""Run one soak mode and record it in benchmarks/results/soak.json (replacing the run of the
same mode and device).

    python scripts/soak.py --mode ci                      # 2,000 requests, CPU
    python scripts/soak.py --mode long --max-seconds 600  # up to 50,000, stops admitting at 10 min
    python scripts/soak.py --mode long --device cuda      # decode steps CUDA-graph captured

The run is ``tests/soak/harness.py``: sparse-hier with the HiRadixTree and a file L3 wrapped in
the fault injector; it fails (exit 1) on any mismatched token or leaked slot.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.common import cpu_model  # noqa: E402

from hicache.storage.fault_injection import FaultPlan  # noqa: E402
from soak.harness import SoakConfig, run_soak  # noqa: E402
from soak.test_soak import CI_FAULTS  # noqa: E402

DATE = "2026-11-25"
MODES = {"ci": 2_000, "long": 50_000}


def device_name(device: str) -> str:
    if torch.device(device).type == "cuda":
        return f"cuda: {torch.cuda.get_device_name(torch.device(device))}"
    return f"cpu: {cpu_model()} ({os.cpu_count()} cores visible, {torch.get_num_threads()} torch thread(s))"


def record(path: Path, run: dict) -> None:
    data = json.loads(path.read_text()) if path.exists() else {"date": DATE, "runs": []}
    data["date"] = DATE
    data["runs"] = [r for r in data.get("runs", []) if (r["mode"], r["device"]) != (run["mode"], run["device"])]
    data["runs"].append(run)
    data["runs"].sort(key=lambda r: (r["mode"], r["device"]))
    path.write_text(json.dumps(data, indent=2) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=tuple(MODES), default="ci")
    ap.add_argument("--requests", type=int, default=None, help="default: 2,000 (ci) or 50,000 (long)")
    ap.add_argument("--max-seconds", type=float, default=None, help="stop admitting requests after this long")
    ap.add_argument("--device", default="cpu", help="cpu or cuda[:n]")
    ap.add_argument("--no-cuda-graph", action="store_true", help="CUDA: decode eagerly instead of graph replays")
    ap.add_argument("--no-faults", action="store_true", help="no fault injection")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    ap.add_argument("--output", type=Path, default=ROOT / "benchmarks" / "results" / "soak.json")
    ap.add_argument("--note", default=None, help="a remark stored with the run (e.g. why it stopped short)")
    ap.add_argument("--no-record", action="store_true", help="print the run, do not write the results file")
    a = ap.parse_args(argv)
    requests = a.requests if a.requests is not None else MODES[a.mode]
    if requests < 1:
        ap.error(f"--requests must be >= 1, got {requests}")
    torch.set_num_threads(a.threads)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
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
    if a.note:
        run["note"] = a.note
    print(json.dumps(run, indent=2))
    if not a.no_record:
        record(a.output, run)
    ok = res.mismatched_tokens == 0 and res.leaked_slots == 0 and res.faults_served_as_miss == res.faults_reaching_read
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
