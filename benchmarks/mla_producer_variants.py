"""Sparse MLA decode on one Hopper GPU: the 8-warp Gluon kernels beside the warp-specialised
one (``MlaGluonConfig.producer_warps=4``: a producer warpgroup fills a ring of 16-bit tiles,
a score and a value warpgroup consume it), over bf16 and FP8 latent rows (DeepSeek's 512 +
64, one query token, the rows of ``bench_attention.dsa_case``), 64- and 32-token tiles.

Each row (``bench_attention.time_mla_variants``): CUDA-graph time, TFLOP/s, bytes/s (656
bytes a token for FP8 rows, 1152 for bf16), the fraction of the byte limit (``hbm_copy_gbps``
of the same run) and the largest difference from the 8-warp bf16 kernel. Writes
``attention_mla_producer.json`` under ``--out`` (default benchmarks/results).

Usage: ``PYTHONPATH=. python benchmarks/mla_producer_variants.py [--commit SHA] [--out DIR]``.
"""
from __future__ import annotations

from benchmarks.bench_attention import write_mla_variant_rows
from benchmarks.common import hbm_copy_gbps, result_parser
from sparsehi.kernels.sparse_mla_decode import MlaGluonConfig

# (B, K, heads), one query token
CASES = [(64, 2048, 128), (64, 2048, 16), (16, 32768, 128), (16, 32768, 16), (128, 2048, 128)]
# (name, FP8 rows, config); the first is the reference of the differences
VARIANTS = [("bf16_8warp", False, MlaGluonConfig(producer_warps=0)),
            ("bf16_ws", False, MlaGluonConfig(producer_warps=4)),
            ("bf16_ws_n32x4", False, MlaGluonConfig(32, 4, producer_warps=4)),
            ("fp8_8warp", True, MlaGluonConfig(producer_warps=0)),
            ("fp8_ws", True, MlaGluonConfig(producer_warps=4)),
            ("fp8_ws_n32x4", True, MlaGluonConfig(32, 4, producer_warps=4))]


def main(argv: list[str] | None = None) -> int:
    ap = result_parser(__doc__)
    args = ap.parse_args(argv)
    write_mla_variant_rows("attention_mla_producer.json", args, [(B, 1, K, H) for B, K, H in CASES], VARIANTS,
                           hbm_copy_gbps(), diff_key="max_diff_vs_bf16_8warp")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
