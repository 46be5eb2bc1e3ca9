"""Sparse MLA decode for 16 and 32 query heads on one Hopper GPU: the token-rows Gluon
kernel (``MlaGluonConfig(token_rows=True)``: tokens as the MMA's rows, 16- or 32-head
blocks) beside the kernels that pad the heads to 64 rows, over FP8 latent rows (the
warp-specialised kernel, ``MlaGluonConfig()``) and bf16 rows (the 8-warp kernel,
``MlaGluonConfig()``), DeepSeek's 512 + 64, the rows of ``bench_attention.dsa_case``.

Each row (``bench_attention.time_mla_variants``): CUDA-graph time of each kernel in the
same process, TFLOP/s, bytes/s (656 bytes a token for FP8 rows, 1152 for bf16) and the
fraction of the byte limit (``hbm_copy_gbps`` of the same run), and the largest difference
of each kernel from the bf16 8-warp one over the same values. Writes
``attention_mla_token_rows.json`` under ``--out`` (default benchmarks/results).

Usage: ``PYTHONPATH=. python benchmarks/mla_token_rows.py [--commit SHA] [--out DIR]``.
"""
from __future__ import annotations

from benchmarks.bench_attention import write_mla_variant_rows
from benchmarks.common import hbm_copy_gbps, result_parser
from sparsehi.kernels.sparse_mla_decode import MlaGluonConfig

# (B, query tokens, K) at 16 heads; the 32-head rows take the first three
CASES = [(64, 1, 2048), (64, 2, 2048), (64, 1, 8192), (64, 1, 512), (16, 1, 32768), (4, 1, 2048), (1, 1, 2048),
         (1, 1, 32768)]
VARIANTS = [("bf16_8warp", False, MlaGluonConfig(producer_warps=0)),
            ("bf16_token_rows", False, MlaGluonConfig(token_rows=True)),
            ("fp8_ws", True, MlaGluonConfig()), ("fp8_token_rows", True, MlaGluonConfig(token_rows=True))]


def main(argv: list[str] | None = None) -> int:
    ap = result_parser(__doc__)
    args = ap.parse_args(argv)
    shapes = [(B, T, K, H) for H, cases in ((16, CASES), (32, CASES[:3])) for B, T, K in cases]
    write_mla_variant_rows("attention_mla_token_rows.json", args, shapes, VARIANTS, hbm_copy_gbps(),
                           diff_key="max_diff_vs_bf16_8warp")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
