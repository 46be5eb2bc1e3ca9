"""Sparse MLA decode on one Hopper GPU: the 8-warp Gluon kernels beside the warp-specialised
one (``MlaGluonConfig.producer_warps=4``: a producer warpgroup fills a ring of 16-bit tiles,
a score and a value warpgroup consume it), over bf16 and FP8 latent rows (DeepSeek's 512 +
64, one query token, the rows of ``bench_attention.dsa_case``), 64- and 32-token tiles.

Each row: CUDA-graph time, TFLOP/s, bytes/s (656 bytes a token for FP8 rows, 1152 for bf16)
and the largest difference from the 8-warp bf16 kernel. Writes ``attention_mla_producer.json``
under ``--out`` (default benchmarks/results).

Usage: ``PYTHONPATH=. python benchmarks/mla_producer_variants.py [--commit SHA] [--out DIR]``.
"""
from __future__ import annotations

import torch

from benchmarks.bench_attention import dsa_case, kv_row_bytes, mla_bytes, mla_flops
from benchmarks.common import cuda_time_us, device_info, result_parser, write_result
from sparsehi.kernels.sparse_mla_decode import MlaGluonConfig, sparse_mla_decode_triton

CASES = [(64, 2048, 128), (64, 2048, 16), (16, 32768, 128), (16, 32768, 16), (128, 2048, 128)]


def variants(kv: torch.Tensor, packed: torch.Tensor) -> list[tuple[str, torch.Tensor, MlaGluonConfig]]:
    G = MlaGluonConfig
    return [("bf16_8warp", kv, G(producer_warps=0)), ("bf16_ws", kv, G(producer_warps=4)),
            ("bf16_ws_n32x4", kv, G(32, 4, producer_warps=4)), ("fp8_8warp", packed, G(producer_warps=0)),
            ("fp8_ws", packed, G(producer_warps=4)), ("fp8_ws_n32x4", packed, G(32, 4, producer_warps=4))]


def main(argv: list[str] | None = None) -> int:
    ap = result_parser(__doc__)
    args = ap.parse_args(argv)
    rows = []
    for B, K, H in CASES:
        q, kv, packed, idx = dsa_case(B, 1, K, H, 512, 64)
        ref = sparse_mla_decode_triton(q, kv, idx, kv_lora_rank=512, sm_scale=0.1,
                                       config=MlaGluonConfig(producer_warps=0)).float()
        for name, buf, cfg in variants(kv, packed):
            fn = lambda: sparse_mla_decode_triton(q, buf, idx, kv_lora_rank=512, sm_scale=0.1, config=cfg)  # noqa: E731
            diff = (fn().float() - ref).abs().max().item()
            us = cuda_time_us(fn, graph=True)
            r = dict(B=B, K=K, heads=H, variant=name, us=round(us, 1), max_diff_vs_bf16_8warp=round(diff, 4),
                     tflops=round(mla_flops(B, K, H, 512, 64) / us / 1e6, 1),
                     gbps=round(mla_bytes(B, K, H, 512, 64, kv_row_bytes(buf, 512, 64)) / us / 1e3, 1))
            print(r, flush=True)
            rows.append(r)
    print("wrote", write_result("attention_mla_producer.json", {"commit": args.commit, "env": device_info(),
                                                               "rows": rows}, args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
