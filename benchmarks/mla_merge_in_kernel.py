"""Sparse MLA decode on one Hopper GPU: the split-K merge in the kernel (the last split of an
output tile to finish merges the splits' partials, ``MlaGluonConfig.merge_in_kernel``, the
default) against the separate merge launch (``merge_in_kernel=False``), each over bf16 rows
and FP8 rows (656 bytes a token) with the config the default dispatch picks for the shape
(``default_gluon_config``), at 16, 64 and 128 query heads, the rows of
``bench_attention.dsa_case``. Shapes that do not split run the same launch either way and
are left out.

Each row (``bench_attention.time_mla_variants``): CUDA-graph time, TFLOP/s, bytes/s, the
fraction of the byte limit (``hbm_copy_gbps`` of the same run) and of the roofline model
(with ``bf16_gemm_tflops`` of the same run), and the largest difference from the first
variant's output (bf16 rows, merge launch). Writes ``attention_mla_merge_in_kernel.json``
under ``--out`` (default benchmarks/results).

Usage: ``PYTHONPATH=. python benchmarks/mla_merge_in_kernel.py [--commit SHA] [--out DIR]``.
"""
from __future__ import annotations

from dataclasses import replace

from benchmarks.bench_attention import write_mla_variant_rows
from benchmarks.common import bf16_gemm_tflops, hbm_copy_gbps, result_parser
from sparsehi.kernels.sparse_mla_gluon import default_gluon_config

# (B, query tokens, K, heads): 16 heads (the byte-limit target), the dsv32-shape decode's
# batches at 128 heads (30 over bf16 rows, 39 over FP8 rows), and the roofline target's B=64
SHAPES = [(64, 1, 2048, 16), (64, 2, 2048, 16), (64, 1, 8192, 16), (16, 1, 32768, 16), (16, 1, 2048, 16),
          (39, 1, 2048, 128), (30, 1, 2048, 128), (8, 1, 2048, 128), (1, 1, 32768, 128), (32, 1, 2048, 64)]


def variants(B: int, T: int, K: int, H: int) -> list:
    out = []
    for fp8 in (False, True):
        cfg = default_gluon_config(H, fp8, B * T)
        kind = "fp8" if fp8 else "bf16"
        out += [(f"{kind}_merge_launch", fp8, replace(cfg, merge_in_kernel=False)),
                (f"{kind}_merge_in_kernel", fp8, cfg)]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = result_parser(__doc__)
    args = ap.parse_args(argv)
    write_mla_variant_rows("attention_mla_merge_in_kernel.json", args, SHAPES, variants, hbm_copy_gbps(),
                           bf16_gemm_tflops(), diff_key="max_diff_vs_bf16_merge_launch")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
