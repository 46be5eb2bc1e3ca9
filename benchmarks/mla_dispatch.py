"""Where the sparse MLA default should switch from the fused Triton kernel to the Hopper
Gluon kernel: both (and the default dispatch) at DeepSeek dims (128 heads, 512 + 64),
K=2048, B in {1, 2, 4, 8, 16}, each checked against the torch reference and CUDA-graph timed.
``--k`` and ``--batches`` take other index counts and batches (dense decode over a whole
context is the same kernel with K = the context); ``--wide`` adds the fused kernel with
64-head blocks (``fused64``) and the warp-specialised Gluon kernel (``gluon_ws``); ``--fp8``
runs them over the 656-byte FP8 latent rows.

Usage (GPU): ``PYTHONPATH=. python3 benchmarks/mla_dispatch.py [--out DIR]``; writes
``mla_dispatch.json`` under ``--out`` (default benchmarks/results). Its rows are kept in
benchmarks/results/attention.json under ``mla_dispatch``.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_attention import mla_case, mla_flops  # noqa: E402
from benchmarks.common import cuda_time_us, write_result  # noqa: E402
from sparsehi.kernels.mla_fp8_latents import quantize_mla_latents  # noqa: E402
from sparsehi.kernels.sparse_mla_decode import (MlaGluonConfig, MlaLaunchConfig, default_mla_config,  # noqa: E402
                                                default_mla_fp8_config, sparse_mla_decode_reference,
                                                sparse_mla_decode_triton)
from sparsehi.kernels.sparse_mla_gluon import default_gluon_config  # noqa: E402

H, DL, DR = 128, 512, 64


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="result directory (default benchmarks/results)")
    ap.add_argument("--k", default="2048", help="comma list of index counts per row")
    ap.add_argument("--batches", default="1,2,4,8,16", help="comma list of batch sizes")
    ap.add_argument("--wide", action="store_true", help="also fused64 and gluon_ws")
    ap.add_argument("--fp8", action="store_true", help="KV in DeepSeek-V3.2's 656-byte FP8 latent rows")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("mla_dispatch.py times GPU kernels: run it on a CUDA machine")
    rows = []
    for K, b in ((int(k), int(b)) for k in args.k.split(",") for b in args.batches.split(",")):
        q, kv, idx = mla_case(b, K, H, DL, DR)
        if args.fp8:
            kv = quantize_mla_latents(kv, DL)
        ref = sparse_mla_decode_reference(q, kv, idx, kv_lora_rank=DL, sm_scale=0.1).float()
        fused = default_mla_fp8_config(q.device, H, b) if args.fp8 else default_mla_config(q.device, H, b, K)
        cases = [("fused", fused), ("gluon", MlaGluonConfig()), ("default", None)]
        if args.wide:
            cases += [("fused64", MlaLaunchConfig(block_h=64, block_n=64, num_warps=8, num_stages=3)),
                      ("gluon_ws", default_gluon_config(H, args.fp8, b))]
        for name, cfg in cases:
            def fn(cfg=cfg):
                return sparse_mla_decode_triton(q, kv, idx, kv_lora_rank=DL, sm_scale=0.1, config=cfg)
            err = ((fn().float() - ref).abs().max() / ref.abs().max()).item()
            us = cuda_time_us(fn, iters=20, warmup=3, graph=True)
            rows.append({"B": b, "K": K, "H": H, "kv": "fp8" if args.fp8 else "bf16", "kernel": name,
                         "us": round(us, 2), "rel_err": round(err, 5),
                         "tflops": round(mla_flops(b, K, H, DL, DR) / (us * 1e-6) / 1e12, 1)})
            print(rows[-1], flush=True)
    print("wrote", write_result("mla_dispatch.json", {"rows": rows}, args.out))


if __name__ == "__main__":
    main()
