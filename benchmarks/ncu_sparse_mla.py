"""Occupancy and throughput of the sparse MLA decode kernels under Nsight Compute.

For each variant (kernel x KV dtype x head count, at B=64, top-2048, one query token) ncu
profiles one launch of the decode kernel in its own process (``--launch VARIANT``) with the
SpeedOfLight, Occupancy, LaunchStats and WarpStateStats sections and the per-reason stall
metrics, clocks left alone (``--clock-control none``). The metrics kept per variant:
duration, achieved and theoretical occupancy, registers per thread, shared memory per block,
the DRAM / SM / L1 / L2 throughput as fractions of their peaks, the warp cycles per issued
instruction and the largest stall reasons (warps stalled per issue, by reason); written to
``attention_mla_ncu.json`` with the device and date.

Usage (on the GPU machine): ``PYTHONPATH=. python benchmarks/ncu_sparse_mla.py [--variants V,..]
[--commit SHA] [--out DIR]``
"""
from __future__ import annotations

import argparse
import csv
import io
import json
import subprocess
import sys
from datetime import date
from pathlib import Path

import torch

from benchmarks.common import RESULTS_DIR, write_result
from sparsehi.kernels.mla_fp8_latents import dequantize_mla_latents, quantize_mla_latents
from sparsehi.kernels.sparse_mla_decode import (MlaGluonConfig, default_mla_fp8_config, sparse_mla_decode_triton)

B, K, DL, DR = 64, 2048, 512, 64
KINDS = ("bf16_gluon", "fp8_gluon", "fp8_gluon_8warp", "fp8_fused")
NARROW_KINDS = ("bf16_token_rows", "fp8_token_rows")
DEFAULT_KINDS = ("bf16_default", "fp8_default")
VARIANTS = {f"{kind}_h{h}": (kind, h) for h in (128, 16) for kind in KINDS + DEFAULT_KINDS}
VARIANTS.update({f"{kind}_h16": (kind, 16) for kind in NARROW_KINDS})
# bf16_gluon: the 8-warp kernel over bf16 rows; fp8_gluon: the warp-specialised kernel over
# FP8 rows; fp8_gluon_8warp: producer_warps=0; *_token_rows: the token-rows kernel (by shape
# one or two MMA warpgroups); *_default: what the default dispatch (config=None) runs
KERNELS = {"bf16_gluon": "_mla_gluon_kernel", "fp8_gluon": "_mla_gluon_ws_kernel",
           "fp8_gluon_8warp": "_mla_gluon_fp8_kernel", "fp8_fused": "_mla_stage1",
           "bf16_token_rows": "_mla_gluon_narrow_kernel", "fp8_token_rows": "_mla_gluon_narrow_kernel"}
DEFAULT_KERNELS = {("bf16_default", 128): "_mla_gluon_ws_kernel", ("bf16_default", 16): "_mla_gluon_narrow_kernel",
                   ("fp8_default", 128): "_mla_gluon_ws_kernel", ("fp8_default", 16): "_mla_gluon_narrow_kernel"}
KEEP = {
    "Duration": "duration_us",
    "Achieved Occupancy": "achieved_occupancy_pct",
    "Theoretical Occupancy": "theoretical_occupancy_pct",
    "Registers Per Thread": "registers_per_thread",
    "Dynamic Shared Memory Per Block": "dynamic_smem_per_block",
    "Block Limit Shared Mem": "block_limit_shared_mem",
    "Block Limit Registers": "block_limit_registers",
    "DRAM Throughput": "dram_throughput_pct",
    "Compute (SM) Throughput": "sm_throughput_pct",
    "L1/TEX Cache Throughput": "l1_throughput_pct",
    "L2 Cache Throughput": "l2_throughput_pct",
    "Grid Size": "grid_size",
    "Waves Per SM": "waves_per_sm",
    "Warp Cycles Per Issued Instruction": "warp_cycles_per_issued_instruction",
}
STALL_PREFIX = "smsp__average_warps_issue_stalled_"
STALL_METRICS = f"regex:^{STALL_PREFIX}.*_per_issue_active\\.ratio$"


def launch(variant: str) -> None:
    """One launch of ``variant``'s kernel (compiled by a first call outside ncu's filter)."""
    kind, heads = VARIANTS[variant]
    g = torch.Generator(device="cuda").manual_seed(0)
    span = K + K // 4
    packed = quantize_mla_latents(torch.randn(B * span, DL + DR, device="cuda", generator=g), kv_lora_rank=DL)
    kv = dequantize_mla_latents(packed, kv_lora_rank=DL)
    q = torch.randn(B, heads, DL + DR, device="cuda", generator=g, dtype=torch.bfloat16)
    idx = torch.stack([torch.randperm(span, device="cuda", generator=g)[:K] + r * span for r in range(B)]).int()
    buf, cfg = {"bf16_gluon": (kv, MlaGluonConfig()), "fp8_gluon": (packed, MlaGluonConfig()),
                "fp8_gluon_8warp": (packed, MlaGluonConfig(producer_warps=0)),
                "bf16_token_rows": (kv, MlaGluonConfig(token_rows=True)),
                "fp8_token_rows": (packed, MlaGluonConfig(token_rows=True)),
                "bf16_default": (kv, None), "fp8_default": (packed, None),
                "fp8_fused": (packed, default_mla_fp8_config(q.device, heads, B))}[kind]
    sparse_mla_decode_triton(q, buf, idx, kv_lora_rank=DL, sm_scale=0.1, config=cfg)
    torch.cuda.synchronize()


def profile(variant: str) -> dict:
    """ncu over one launch of ``variant`` (the last matching launch, after the compiling one);
    without the stall metrics if this ncu refuses them."""
    got = _profile(variant, stalls=True)
    return got if "duration_us" in got else _profile(variant, stalls=False)


def _profile(variant: str, stalls: bool) -> dict:
    """One ncu run over ``variant``: its kept metrics, or an ``error`` with ncu's last output."""
    kind, heads = VARIANTS[variant]
    kernel = DEFAULT_KERNELS.get((kind, heads)) or KERNELS[kind]
    cmd = ["ncu", "--clock-control", "none", "--csv", "--page", "details", "-k", f"regex:^{kernel}$",
           "--launch-skip", "1", "--launch-count", "1", "--section", "SpeedOfLight", "--section", "Occupancy",
           "--section", "LaunchStats", "--section", "WarpStateStats"]
    cmd += ["--metrics", STALL_METRICS] if stalls else []
    cmd += [sys.executable, __file__, "--launch", variant, "--twice"]
    got = {"variant": variant, "kernel": kernel, "heads": VARIANTS[variant][1], "B": B, "K": K}
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as e:
        return {**got, "error": repr(e)}
    stall = {}
    for r in csv.DictReader(io.StringIO(_csv_part(res.stdout))):
        name, value = r.get("Metric Name") or "", _number(r.get("Metric Value") or "")
        key = KEEP.get(name)
        if key:
            got[key] = value
            got.setdefault("units", {})[key] = r.get("Metric Unit") or ""
        elif name.startswith(STALL_PREFIX) and isinstance(value, float):
            stall[name[len(STALL_PREFIX):].replace("_per_issue_active.ratio", "")] = value
    if stall:
        got["stalls_per_issue_top"] = dict(sorted(stall.items(), key=lambda item: -item[1])[:8])
    if "duration_us" not in got:
        got["error"] = (res.stderr or res.stdout)[-800:]
    elif got["units"].get("duration_us") in ("nsecond", "ns"):
        got["duration_us"] = round(got["duration_us"] / 1e3, 2)
    elif got["units"].get("duration_us") in ("msecond", "ms"):
        got["duration_us"] = round(got["duration_us"] * 1e3, 2)
    return got


def kept_rows(path: Path, chosen: list[str]) -> list[dict]:
    """The rows of the result file ``path`` for variants not in ``chosen``, each with the
    file's date where it has none of its own."""
    try:
        old = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    return [{"date": old.get("date"), **r} for r in old.get("rows", []) if r.get("variant") not in chosen]


def _csv_part(text: str) -> str:
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), len(lines))
    return "\n".join(lines[start:])


def _number(s: str) -> float | str:
    try:
        return float(s.replace(",", ""))
    except ValueError:
        return s


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--launch", choices=sorted(VARIANTS), help="(inside ncu) launch one variant")
    ap.add_argument("--twice", action="store_true", help="(inside ncu) compile with a first launch")
    ap.add_argument("--variants", default=None,
                    help="comma-separated variants to profile (default all); the committed file's rows of the "
                         "others are kept, with their date")
    ap.add_argument("--commit", default=None, help="the commit profiled, recorded in each new row")
    ap.add_argument("--out", default=None, help="result dir (default benchmarks/results)")
    args = ap.parse_args(argv)
    if args.launch:
        for _ in range(2 if args.twice else 1):
            launch(args.launch)
        return 0
    if torch.cuda.get_device_capability()[0] != 9:
        raise SystemExit("the Gluon kernels profiled here need a Hopper GPU (sm_90)")
    chosen = args.variants.split(",") if args.variants else list(VARIANTS)
    unknown = sorted(set(chosen) - set(VARIANTS))
    if unknown:
        raise SystemExit(f"--variants: unknown {unknown}; choose from {sorted(VARIANTS)}")
    rows = [{**profile(v), "commit": args.commit, "date": date.today().isoformat()} for v in chosen]
    for r in rows:
        print(r)
    if args.variants:
        rows = kept_rows(RESULTS_DIR / "attention_mla_ncu.json", chosen) + rows
    out = write_result("attention_mla_ncu.json", {
        "device": torch.cuda.get_device_name(), "what": __doc__.split("\n\n")[1].replace("\n", " "),
        "rows": rows}, Path(args.out or RESULTS_DIR))
    print("wrote", out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
