"""Stream-K against split-K for the warp-specialised Hopper sparse MLA kernel: each shape's
default Gluon config run as split-K (the split count of ``gluon_splits``) and as stream-K
(``MlaGluonConfig.stream_k``: one program an SM, an equal share of all (request, head block)
pairs' tiles each; with producer warps, which the default over 16-bit rows at 64 heads lacks),
one after the other in one process, CUDA-graph timed and each checked
against the torch reference.

    PYTHONPATH=. python benchmarks/mla_stream_k.py                 # -> results/mla_stream_k.json
    PYTHONPATH=. python benchmarks/mla_stream_k.py --batches 39 --kv fp8
"""
from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_attention import mla_case, mla_checked_time  # noqa: E402
from benchmarks.common import finish_checked_run, result_parser  # noqa: E402
from hicache.triton_support import cdiv, sm_count  # noqa: E402
from sparsehi.kernels.flash_decoding import split_tokens  # noqa: E402
from sparsehi.kernels.mla_fp8_latents import quantize_mla_latents  # noqa: E402
from sparsehi.kernels.sparse_mla_decode import sparse_mla_decode_reference, sparse_mla_decode_triton  # noqa: E402
from sparsehi.kernels.sparse_mla_gluon import default_gluon_config  # noqa: E402
from sparsehi.kernels.sparse_mla_gluon_launch import gluon_splits, stream_k  # noqa: E402
from sparsehi.kernels.sparse_mla_gluon_stream import stream_k_plan  # noqa: E402

DL, DR = 512, 64
SHAPES = [(128, 2176, b) for b in (1, 8, 16, 30, 32, 39, 48, 64, 96, 128)] + [
    (128, 2048, 64), (128, 2048, 128), (128, 32768, 1), (128, 8192, 8), (64, 2176, 39), (64, 2048, 64)]
TOLERANCE = 2e-2
"""Largest difference from the reference, relative to its largest value (bf16 outputs)."""


def main(argv=None) -> int:
    ap = result_parser(__doc__)
    ap.add_argument("--batches", default=None, help="comma list of batch sizes at 128 heads, K=2176 (default: SHAPES)")
    ap.add_argument("--kv", default="fp8,bf16", help="comma list of row layouts: bf16, fp8")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("mla_stream_k.py times GPU kernels: run it on a CUDA machine")
    shapes = [(128, 2176, int(b)) for b in a.batches.split(",")] if a.batches else SHAPES
    layouts = a.kv.split(",")
    if any(x not in ("bf16", "fp8") for x in layouts):
        ap.error(f"--kv takes bf16 and/or fp8, got {a.kv!r}")
    sms = sm_count(torch.device("cuda"))
    rows: list[dict[str, Any]] = []
    bad = 0
    for h, k, b in shapes:
        q, kv16, idx = mla_case(b, k, h, DL, DR)
        for layout in layouts:
            fp8 = layout == "fp8"
            kv = quantize_mla_latents(kv16, DL) if fp8 else kv16
            ref = sparse_mla_decode_reference(q, kv, idx, kv_lora_rank=DL, sm_scale=0.1).float()
            base = default_gluon_config(h, fp8, b)
            pairs, tiles = b * cdiv(h, 64), cdiv(k, base.block_n)
            splits = split_tokens(k, gluon_splits(base, pairs, k, sms, fp8), base.block_n)[0]
            plan = stream_k_plan(pairs, tiles, sms)
            shape_rows = {}
            # stream-K runs the warp-specialised kernel, which the default over 16-bit rows at 64 heads is not
            variants = (("split-K", replace(base, stream_k=False)),
                        ("stream-K", replace(base, stream_k=True, producer_warps=4)))
            for name, cfg in variants:
                def fn(cfg=cfg, kv=kv):
                    return sparse_mla_decode_triton(q, kv, idx, kv_lora_rank=DL, sm_scale=0.1, config=cfg)
                r = {"heads": h, "K": k, "B": b, "kv": layout, "variant": name,
                     **mla_checked_time(fn, ref, b, k, h, DL, DR, 656 if fp8 else None),
                     "programs": plan.programs if name == "stream-K" else pairs * splits,
                     "splits_or_max_parts": plan.max_parts if name == "stream-K" else splits,
                     "default_runs_stream_k": stream_k(base, pairs * splits, sms)}
                bad += r["rel_err"] > TOLERANCE
                shape_rows[name] = r
                print(r, flush=True)
            shape_rows["stream-K"]["speedup"] = round(shape_rows["split-K"]["us"] / shape_rows["stream-K"]["us"], 3)
            rows += shape_rows.values()
        torch.cuda.empty_cache()
    return finish_checked_run("mla_stream_k.json", {
        "what": "sparse MLA decode, Gluon warp-specialised kernel (each shape's default config), split-K with the "
                "default split count against stream-K, one after the other, CUDA-graph timed (20 calls a graph); "
                "speedup: split-K time over stream-K time; rel_err: largest difference from the torch reference "
                "over its largest value",
        "sms": sms, "commit": a.commit, "rows": rows}, bad, "variants differ from the reference", True, a.out)


if __name__ == "__main__":
    sys.exit(main())
