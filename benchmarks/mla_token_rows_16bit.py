"""Sparse MLA decode over 16-bit (bf16) latent rows at 16 and 32 query heads and small
batches on one Hopper GPU: the token-rows Gluon kernel with one MMA warpgroup
(``MlaGluonConfig(token_rows=True, mma_groups=1)``) beside what the default dispatch ran
there before it took the token-rows kernel up to 16 heads and 4 query rows, 2026-11-27 (the
fused kernel's ``default_mla_config`` under ``GLUON_MIN_HEAD_BLOCKS`` head blocks, the
8-warp Gluon kernel from there), DeepSeek's 512 + 64, the rows of
``bench_attention.dsa_case``. (The dispatch has since taken the token-rows kernel at every
batch up to 16 heads, with two MMA warpgroups on long splits: ``mla_two_mma.py``.)

Each row (``bench_attention.time_mla_variants``): CUDA-graph time, TFLOP/s, bytes/s and the
fraction of the byte limit (``hbm_copy_gbps`` of the same run), and the largest difference
from the previous default. Writes ``attention_mla_token_rows_16bit.json`` under ``--out``
(default benchmarks/results).

Usage: ``PYTHONPATH=. python benchmarks/mla_token_rows_16bit.py [--commit SHA] [--out DIR]``.
"""
from __future__ import annotations

import torch

from benchmarks.bench_attention import write_mla_variant_rows
from benchmarks.common import hbm_copy_gbps, result_parser
from hicache.triton_support import cdiv
from sparsehi.kernels.sparse_mla_decode import GLUON_MIN_HEAD_BLOCKS, MlaGluonConfig, default_mla_config

HEADS = (16, 32)
BATCHES = (1, 2, 4, 8)
QUERY_TOKENS = (1, 2)
TOP_K = (512, 2048, 32768)


def previous_default(B: int, T: int, K: int, H: int):
    """The config the default dispatch ran over 16-bit rows before the token-rows kernel."""
    if B * T * cdiv(H, 64) >= GLUON_MIN_HEAD_BLOCKS:
        return MlaGluonConfig()
    return default_mla_config(torch.device("cuda"), H, B * T, K)


def variants(B: int, T: int, K: int, H: int) -> list:
    """The previous default's config at this shape beside the token-rows kernel's."""
    return [("previous_default", False, previous_default(B, T, K, H)),
            ("token_rows", False, MlaGluonConfig(token_rows=True, mma_groups=1))]


def main(argv: list[str] | None = None) -> int:
    ap = result_parser(__doc__)
    args = ap.parse_args(argv)
    shapes = [(B, T, K, H) for H in HEADS for K in TOP_K for B in BATCHES for T in QUERY_TOKENS]
    write_mla_variant_rows("attention_mla_token_rows_16bit.json", args, shapes, variants, hbm_copy_gbps(),
                           diff_key="max_diff_vs_previous")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
