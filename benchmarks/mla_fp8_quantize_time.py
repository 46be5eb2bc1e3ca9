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

from benchmarks.common import graph_replay_best_us

from sparsehi.kernels.mla_fp8_latents import quantize_mla_latents
from sparsehi.kernels.mla_fp8_quantize import mla_fp8_quantize_triton


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batches", default="1,7,39,64")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    res = {}
    for b in (int(x) for x in args.batches.split(",")):
        kv = (torch.randn(b, 1, 576, device="cuda") * 3).to(torch.bfloat16)
        res[f"B{b}_torch_reference_us"] = round(graph_replay_best_us(lambda: quantize_mla_latents(kv, 512), 8, 50), 2)
        res[f"B{b}_triton_us"] = round(graph_replay_best_us(lambda: mla_fp8_quantize_triton(kv, 512), 8, 50), 2)
        print(b, res[f"B{b}_torch_reference_us"], res[f"B{b}_triton_us"], flush=True)
    args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "us": res}, indent=1) + "\n")


if __name__ == "__main__":
    main()
