"""Sparse MLA decode over bf16 latent rows on one Hopper GPU: the 8-warp Gluon kernel
(``MlaGluonConfig(producer_warps=0)``, 64-token tiles x 2) beside the warp-specialised one
with 32-token tiles x 4 (``MlaGluonConfig(32, 4, producer_warps=4)``), for every batch the
default dispatch sends to the Gluon kernels (at least 4 head blocks of 64), top-k 2048 to
32768, 64 and 128 heads, 1 and 2 query tokens (DeepSeek's 512 + 64, the rows of
``bench_attention.dsa_case``). This is the measurement behind the bf16 default.

Each row: CUDA-graph time of both kernels in the same process, their ratio and the
largest difference between their outputs. Writes ``attention_mla_bf16_sweep.json`` under
``--out`` (default benchmarks/results).

Usage: ``PYTHONPATH=. python benchmarks/mla_bf16_sweep.py [--commit SHA] [--out DIR] [--quick]``.
"""
from __future__ import annotations

import torch

from benchmarks.bench_attention import dsa_case, mla_flops
from benchmarks.common import cuda_time_us, device_info, result_parser, write_result
from sparsehi.kernels.sparse_mla_decode import MlaGluonConfig, sparse_mla_decode_triton

HEADS = (64, 128)
BATCHES = (2, 4, 8, 16, 32, 64, 128)
TOP_K = (2048, 8192, 32768)
TWO_TOKEN_CASES = [(4, 2048, 64), (32, 2048, 64), (8, 2048, 128)]   # (B, K, H) with 2 query tokens
VARIANTS = {"gluon_8warp_64x2": MlaGluonConfig(producer_warps=0),
            "gluon_ws_32x4": MlaGluonConfig(32, 4, producer_warps=4)}


def cases(quick: bool) -> list[tuple[int, int, int, int]]:
    """(B, query tokens, K, H) measured: launches of at least 4 head blocks, and no more
    than 2^22 indices per launch beyond B = 16 (the pool and its rows fit in HBM)."""
    if quick:
        return [(64, 1, 2048, 128), (4, 1, 2048, 64)]
    out = [(B, 1, K, H) for H in HEADS for K in TOP_K for B in BATCHES
           if B * H // 64 >= 4 and (B <= 16 or B * K <= 1 << 22)]
    return out + [(B, 2, K, H) for B, K, H in TWO_TOKEN_CASES]


def time_case(B: int, T: int, K: int, H: int) -> dict:
    """Both kernels at one shape, in the same process: times, ratio, largest difference."""
    q, kv, _, idx = dsa_case(B, T, K, H, 512, 64)
    outs, times = {}, {}
    for name, cfg in VARIANTS.items():
        fn = lambda: sparse_mla_decode_triton(q, kv, idx, kv_lora_rank=512, sm_scale=0.1, config=cfg)  # noqa: E731
        outs[name] = fn().float()
        times[name] = cuda_time_us(fn, graph=True)
    a, b = times["gluon_8warp_64x2"], times["gluon_ws_32x4"]
    return dict(B=B, query_tokens=T, K=K, heads=H, us_8warp_64x2=round(a, 1), us_ws_32x4=round(b, 1),
                ws_32x4_speedup=round(a / b, 3), tflops_ws_32x4=round(mla_flops(B * T, K, H, 512, 64) / b / 1e6, 1),
                max_diff=round((outs["gluon_8warp_64x2"] - outs["gluon_ws_32x4"]).abs().max().item(), 4))


def main(argv: list[str] | None = None) -> int:
    ap = result_parser(__doc__)
    ap.add_argument("--quick", action="store_true", help="two cases only")
    args = ap.parse_args(argv)
    rows = []
    for B, T, K, H in cases(args.quick):
        rows.append(time_case(B, T, K, H))
        print(rows[-1], flush=True)
        torch.cuda.empty_cache()
    print("wrote", write_result("attention_mla_bf16_sweep.json", {"commit": args.commit, "env": device_info(),
                                                                 "rows": rows}, args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
