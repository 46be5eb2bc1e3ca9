"""The paged decode kernel's split-K count: the shape-based choice against the choice
without its small-read rule, on the GPU, in one run.

``decode_over_table`` picks its split count from static shapes
(``sparsehi.kernels.paged_decode.choose_num_splits``). A call that reads little KV (a
sparse layer's selection, a short context, a small model) is bound by latency, so the
choice splits it finer when the K and V it may read are at most ``SMALL_READ_BYTES``.
This script times both choices over decode shapes of the Llama-8B attention (8 KV heads x
128) and of ``tiny-gqa`` (2 x 32), with pages of 16 tokens at random places in the pool,
as CUDA-graph replays of 10 calls (the way a decode step runs them).

Usage: ``PYTHONPATH=. python benchmarks/bench_split_heuristic.py`` on a GPU.
Result: ``split_heuristic.json``.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import cuda_time_us, write_result  # noqa: E402
from hicache.triton_support import sm_count  # noqa: E402
from sparsehi.kernels.paged_decode import (DecodeLaunchConfig, SMALL_READ_BYTES, choose_num_splits,  # noqa: E402
                                           decode_over_table)

# (batch, q heads, kv heads, head dim, tokens): sparse selections (2048 + sink/recent/page),
# short and long dense contexts
SHAPES = [(1, 32, 8, 128, 2192), (2, 32, 8, 128, 2192), (4, 32, 8, 128, 2192), (10, 32, 8, 128, 2192),
          (32, 32, 8, 128, 2192), (64, 32, 8, 128, 2192), (1, 32, 8, 128, 8192), (8, 32, 8, 128, 8192),
          (1, 32, 8, 128, 65536), (4, 32, 8, 128, 65536), (16, 32, 8, 128, 16384),
          (1, 4, 2, 32, 2192), (2, 4, 2, 32, 2192), (8, 4, 2, 32, 2192), (2, 4, 2, 32, 32768), (8, 4, 2, 32, 32768)]


def time_shape(b: int, hq: int, hkv: int, d: int, ntok: int, page: int = 16) -> dict[str, Any]:
    dev = torch.device("cuda")
    npages = ntok // page
    pool_pages = b * npages + 8
    k = torch.randn(pool_pages * page, hkv, d, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    q = torch.randn(b, hq, d, device=dev, dtype=torch.bfloat16)
    table = torch.randperm(pool_pages, device=dev)[: b * npages].to(torch.int32)
    row_start = torch.arange(b, device=dev, dtype=torch.int32) * npages
    seqlens = torch.full((b,), ntok, device=dev, dtype=torch.int32)
    kv_bytes = b * ntok * hkv * 2 * d * k.element_size()
    sms = sm_count(dev)
    choices = {"chosen": choose_num_splits(b * hkv, ntok, 64, sms, kv_bytes=kv_bytes),
               "without_small_read_rule": choose_num_splits(b * hkv, ntok, 64, sms)}
    row: dict[str, Any] = {"batch": b, "q_heads": hq, "kv_heads": hkv, "head_dim": d, "tokens": ntok,
                           "kv_mib": round(kv_bytes / 2**20, 2), "small_read": kv_bytes <= SMALL_READ_BYTES}
    for name, splits in choices.items():
        cfg = DecodeLaunchConfig(num_splits=splits)

        def call():
            return decode_over_table(q, k, v, table, row_start, seqlens, page_size=page, max_tokens=ntok,
                                     sm_scale=d ** -0.5, row_units=npages, config=cfg)

        row[name] = {"splits": splits, "us": round(cuda_time_us(call, iters=10, graph=True), 2)}
    row["chosen_over_without"] = round(row["chosen"]["us"] / row["without_small_read_rule"]["us"], 3)
    return row


def main(argv: Optional[list[str]] = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="result directory (default benchmarks/results)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU")
    rows = []
    for shape in SHAPES:
        row = time_shape(*shape)
        rows.append(row)
        print(f"B={row['batch']:3d} Hkv={row['kv_heads']} D={row['head_dim']:3d} tokens={row['tokens']:6d} "
              f"({row['kv_mib']:8.2f} MiB): {row['without_small_read_rule']} -> {row['chosen']} "
              f"ratio {row['chosen_over_without']}", flush=True)
    payload = {"what": "paged decode (decode_over_table) time per call, CUDA-graph replays, split count chosen "
                       "with and without the small-read rule (choose_num_splits kv_bytes)",
               "small_read_bytes": SMALL_READ_BYTES, "rows": rows}
    path = write_result("split_heuristic.json", payload, args.out)
    print(f"wrote {path}")
    return payload


if __name__ == "__main__":
    main()
