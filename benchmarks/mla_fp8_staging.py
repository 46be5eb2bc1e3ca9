"""Sparse MLA decode over FP8 latent rows at 64 and 128 query heads on one Hopper GPU: the
warp-specialised kernel's producer warps loading each tile's rows into registers
(``MlaGluonConfig()``, 64-token tiles x 2) beside the same kernel with a ``cp.async``
staging ring of raw rows (``MlaGluonConfig(block_n, num_buf, fp8_stages=n)``), and the bf16
default over the same values (DeepSeek's 512 + 64, the rows of ``bench_attention.dsa_case``).

Each row (``bench_attention.time_mla_variants``): CUDA-graph time, TFLOP/s, bytes/s (656
bytes a token for FP8 rows, 1152 for bf16), the fractions of the byte limit and of the
roofline model (the larger of the byte time at the device-copy rate and the flop time at the
bf16 GEMM rate, both measured in the same run) and the largest difference from the bf16
default. Writes ``attention_mla_fp8_staging.json`` under ``--out``
(default benchmarks/results).

Usage: ``PYTHONPATH=. python benchmarks/mla_fp8_staging.py [--commit SHA] [--out DIR] [--quick]``.
"""
from __future__ import annotations

from benchmarks.bench_attention import write_mla_variant_rows
from benchmarks.common import bf16_gemm_tflops, hbm_copy_gbps, result_parser
from sparsehi.kernels.sparse_mla_decode import MlaGluonConfig

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


def main(argv: list[str] | None = None) -> int:
    ap = result_parser(__doc__)
    ap.add_argument("--quick", action="store_true", help="the first case only")
    args = ap.parse_args(argv)
    write_mla_variant_rows("attention_mla_fp8_staging.json", args, CASES[:1] if args.quick else CASES, VARIANTS,
                           hbm_copy_gbps(), bf16_gemm_tflops(), diff_key="max_diff_vs_bf16_default")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
