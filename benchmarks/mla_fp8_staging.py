"""Sparse MLA decode over FP8 latent rows at 64 and 128 query heads on one Hopper GPU: the
warp-specialised kernel's producer warps loading each tile's rows into registers
(``MlaGluonConfig()``, 64-token tiles x 2) beside the same kernel with a ``cp.async``
staging ring of raw rows (``MlaGluonConfig(block_n, num_buf, fp8_stages=n)``), and the bf16
default over the same values (DeepSeek's 512 + 64, the rows of ``bench_attention.dsa_case``).

Each row: CUDA-graph time, TFLOP/s, bytes/s (656 bytes a token for FP8 rows, 1152 for bf16),
the fraction of the roofline model (the larger of the byte time at the device-copy rate and
the flop time at the bf16 GEMM rate, both measured in the same run) and the largest
difference from the bf16 default. Writes ``attention_mla_fp8_staging.json`` under ``--out``
(default benchmarks/results).

Usage: ``PYTHONPATH=. python benchmarks/mla_fp8_staging.py [--commit SHA] [--out DIR] [--quick]``.
"""
from __future__ import annotations

import argparse

from benchmarks.bench_attention import dsa_case, kv_row_bytes, mla_bytes, mla_flops
from benchmarks.common import bf16_gemm_tflops, cuda_time_us, device_info, hbm_copy_gbps, write_result
from sparsehi.kernels.sparse_mla_decode import MlaGluonConfig, sparse_mla_decode_triton

# (B, query tokens, K, heads)
CASES = [(64, 1, 2048, 128), (128, 1, 2048, 128), (64, 1, 8192, 128), (64, 2, 2048, 128), (16, 1, 32768, 128),
         (4, 1, 2048, 128),
         (1, 1, 2048, 64), (4, 1, 2048, 64), (16, 1, 2048, 64), (64, 1, 2048, 64), (128, 1, 2048, 64),
         (64, 2, 2048, 64), (64, 1, 512, 64), (4, 1, 8192, 64), (64, 1, 8192, 64), (16, 1, 32768, 64)]
VARIANTS = [("bf16_default", False, None),
            ("fp8_registers_64x2", True, MlaGluonConfig()),
            ("fp8_staged_32x3_s2", True, MlaGluonConfig(32, 3, fp8_stages=2)),
            ("fp8_staged_32x2_s3", True, MlaGluonConfig(32, 2, fp8_stages=3)),
            ("fp8_staged_64x1_s1", True, MlaGluonConfig(64, 1, fp8_stages=1))]


def time_case(B: int, T: int, K: int, H: int, roof: float, gemm: float) -> list[dict]:
    """All variants at one shape, in the same process."""
    q, kv, packed, idx = dsa_case(B, T, K, H, 512, 64)
    base = None
    rows = []
    for name, fp8, cfg in VARIANTS:
        buf = packed if fp8 else kv
        fn = lambda: sparse_mla_decode_triton(q, buf, idx, kv_lora_rank=512, sm_scale=0.1, config=cfg)  # noqa: E731
        out = fn().float()
        base = out if base is None else base
        us = cuda_time_us(fn, graph=True)
        nbytes, flops = mla_bytes(B * T, K, H, 512, 64, kv_row_bytes(buf, 512, 64)), mla_flops(B * T, K, H, 512, 64)
        bound_us = max(nbytes / (roof * 1e9), flops / (gemm * 1e12)) * 1e6
        rows.append(dict(B=B, query_tokens=T, K=K, heads=H, variant=name, us=round(us, 1),
                         tflops=round(flops / us / 1e6, 1), gbps=round(nbytes / us / 1e3, 1),
                         frac_roofline_model=round(bound_us / us, 3),
                         max_diff_vs_bf16_default=round((out - base).abs().max().item(), 4)))
        print(rows[-1], flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--commit", default=None, help="commit of the kernels timed (recorded)")
    ap.add_argument("--out", default=None, help="result directory (default benchmarks/results)")
    ap.add_argument("--quick", action="store_true", help="the first case only")
    args = ap.parse_args(argv)
    roof, gemm = hbm_copy_gbps(), bf16_gemm_tflops()
    rows = []
    for case in CASES[:1] if args.quick else CASES:
        rows += time_case(*case, roof, gemm)
    print("wrote", write_result("attention_mla_fp8_staging.json", {
        "commit": args.commit, "env": device_info(), "roofline_gbps": round(roof, 1),
        "compute_ceiling_tflops": round(gemm, 1), "rows": rows}, args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
