"""Sparse MLA decode over 16-bit (bf16) latent rows at 128 and 64 query heads on one Hopper
GPU: the warp-specialised Gluon kernel with 32-token tiles x 4 (the default dispatch's from
65 heads) with its gather producer 1, 2 and 3 tiles ahead of the tile it hands over
(``MlaGluonConfig.gather_ahead``), and the default dispatch, DeepSeek's 512 + 64, the rows
of ``bench_attention.dsa_case``; batches 1-128, 1 and 2 query tokens, top-k 512-32768.

Each row (``bench_attention.time_mla_variants``): CUDA-graph time, TFLOP/s, bytes/s, the
fraction of the byte limit (``hbm_copy_gbps``) and of the roofline model (with
``bf16_gemm_tflops``), both of the same run, and the largest difference from one tile
ahead. Writes ``attention_mla_gather_ahead.json`` under ``--out`` (default
benchmarks/results).

Usage: ``PYTHONPATH=. python benchmarks/mla_gather_ahead.py [--commit SHA] [--out DIR]``.
"""
from __future__ import annotations

from benchmarks.bench_attention import write_mla_variant_rows
from benchmarks.common import bf16_gemm_tflops, hbm_copy_gbps, result_parser
from sparsehi.kernels.sparse_mla_decode import MlaGluonConfig

# (heads, B, query tokens, K)
CASES = [(128, 64, 1, 2048), (128, 128, 1, 2048), (128, 64, 2, 2048), (128, 64, 1, 8192), (128, 16, 1, 32768),
         (128, 32, 1, 2048), (128, 8, 1, 2048), (128, 64, 1, 512), (128, 2, 1, 2048), (128, 1, 1, 8192),
         (64, 64, 1, 2048)]
VARIANTS = [(f"ahead_{a}", False, MlaGluonConfig(32, 4, producer_warps=4, gather_ahead=a)) for a in (1, 2, 3)]
VARIANTS.append(("default", False, None))


def main(argv: list[str] | None = None) -> int:
    ap = result_parser(__doc__)
    args = ap.parse_args(argv)
    write_mla_variant_rows("attention_mla_gather_ahead.json", args, [(B, T, K, H) for H, B, T, K in CASES], VARIANTS,
                           hbm_copy_gbps(), bf16_gemm_tflops(), diff_key="max_diff_vs_ahead_1")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
