"""Time the FP8 latent store's quantisation at decode batch sizes: the torch reference
``quantize_mla_latents`` (about fifteen launches) against the one-launch ``mla_fp8_quantize``.

    PYTHONPATH=. python benchmarks/mla_fp8_quantize_time.py --out benchmarks/results/mla_fp8_quantize.json

Each is captured 8 times in a CUDA graph; the best of 5 x 50 replays gives microseconds per
quantisation of ``[B, 1, 576]`` bf16 rows."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from sparsehi.kernels.mla_fp8_latents import quantize_mla_latents
from sparsehi.kernels.mla_fp8_quantize import mla_fp8_quantize_triton


def time_graph(fn, per_graph: int = 8, reps: int = 50) -> float:
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
    best = float("inf")
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps):
            g.replay()
        b.record()
        torch.cuda.synchronize()
        best = min(best, a.elapsed_time(b) * 1000 / reps / per_graph)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batches", default="1,7,39,64")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    res = {}
    for b in (int(x) for x in args.batches.split(",")):
        kv = (torch.randn(b, 1, 576, device="cuda") * 3).to(torch.bfloat16)
        res[f"B{b}_torch_reference_us"] = round(time_graph(lambda: quantize_mla_latents(kv, 512)), 2)
        res[f"B{b}_triton_us"] = round(time_graph(lambda: mla_fp8_quantize_triton(kv, 512)), 2)
        print(b, res[f"B{b}_torch_reference_us"], res[f"B{b}_triton_us"], flush=True)
    args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "us": res}, indent=1) + "\n")


if __name__ == "__main__":
    main()
