"""Sparse MLA decode at 16 query heads on one Hopper GPU: the token-rows Gluon kernel with one
and with two MMA warpgroups (``MlaGluonConfig(token_rows=True, mma_groups=1 | 2)``; two take
the even and the odd tiles of a program, each with its own online softmax, and merge at the
end) over 16-bit (bf16) rows, beside the 8-warp Gluon kernel (``MlaGluonConfig()``, what the
default dispatch ran there from 5 query rows before) and the default dispatch over bf16 and
over FP8 rows (656 bytes a token), DeepSeek's 512 + 64, the rows of
``bench_attention.dsa_case``; batches 1-64, 1 and 2 query tokens, top-k 512-32768.

Each row (``bench_attention.time_mla_variants``): CUDA-graph time, TFLOP/s, bytes/s and the
fraction of the byte limit (``hbm_copy_gbps`` of the same run), and the largest difference
from the 8-warp kernel over the same values. Writes ``attention_mla_two_mma.json`` under
``--out`` (default benchmarks/results).

Usage: ``PYTHONPATH=. python benchmarks/mla_two_mma.py [--commit SHA] [--out DIR]``.
"""
from __future__ import annotations

from benchmarks.bench_attention import write_mla_variant_rows
from benchmarks.common import hbm_copy_gbps, result_parser
from sparsehi.kernels.sparse_mla_decode import MlaGluonConfig

HEADS = 16
# (B, query tokens, K)
CASES = [(64, 1, 2048), (64, 2, 2048), (64, 1, 8192), (16, 1, 32768), (64, 1, 512), (16, 1, 2048), (8, 1, 2048),
         (8, 1, 8192), (4, 1, 2048), (4, 1, 32768), (1, 1, 2048), (1, 1, 32768)]
VARIANTS = [("bf16_8warp", False, MlaGluonConfig(producer_warps=0)),
            ("bf16_token_rows_1mma", False, MlaGluonConfig(token_rows=True, mma_groups=1)),
            ("bf16_token_rows_2mma", False, MlaGluonConfig(token_rows=True, mma_groups=2)),
            ("bf16_default", False, None), ("fp8_default", True, None)]


def main(argv: list[str] | None = None) -> int:
    ap = result_parser(__doc__)
    args = ap.parse_args(argv)
    write_mla_variant_rows("attention_mla_two_mma.json", args, [(B, T, K, HEADS) for B, T, K in CASES], VARIANTS,
                           hbm_copy_gbps(), diff_key="max_diff_vs_bf16_8warp")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
