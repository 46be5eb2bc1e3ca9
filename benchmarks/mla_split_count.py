"""Split-K count of the Hopper Gluon sparse MLA kernels: each count from 1 to ``--max-splits``
beside the default dispatch, at the dsv32-shape decode's shapes (128 heads, 512 + 64, K =
2176: 64 sink + top 2048 + 64 recent tokens), over bf16 rows and the 656-byte FP8 latent
rows, CUDA-graph timed and each checked against the torch reference.

The Gluon kernels run one 64-head block of one row a program and one program an SM (their
shared memory), so a launch of fewer programs than SMs leaves SMs idle, and one of a few
more than the SMs takes a second wave of the whole loop. ``wave_model`` is the count the
model ``waves(s) x tiles per split(s)`` would take for each shape.

    PYTHONPATH=. python benchmarks/mla_split_count.py               # -> results/mla_split_count.json
    PYTHONPATH=. python benchmarks/mla_split_count.py --batches 39 --kv fp8
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
from sparsehi.kernels.mla_fp8_latents import quantize_mla_latents  # noqa: E402
from sparsehi.kernels.sparse_mla_decode import sparse_mla_decode_reference, sparse_mla_decode_triton  # noqa: E402
from sparsehi.kernels.flash_decoding import split_tokens  # noqa: E402
from sparsehi.kernels.sparse_mla_gluon import default_gluon_config  # noqa: E402
from sparsehi.kernels.sparse_mla_gluon_launch import gluon_splits  # noqa: E402

H, DL, DR = 128, 512, 64
K = 2176
BATCHES = [8, 16, 30, 32, 39, 48, 64, 96, 128]
TOLERANCE = 2e-2
"""Largest difference from the reference, relative to its largest value (bf16 outputs)."""


def wave_model_splits(programs: int, tiles: int, sms: int, max_splits: int) -> int:
    """The split count ``s`` that minimises ``ceil(programs x s / sms) x ceil(tiles / s)``
    (the fewest splits among equals)."""
    return min(range(1, max_splits + 1), key=lambda s: (cdiv(programs * s, sms) * cdiv(tiles, s), s))


def default_splits(b: int, k: int, cfg, fp8: bool) -> int:
    """The split count the default dispatch takes for ``b`` rows of ``k`` indices."""
    sms = sm_count(torch.device("cuda"))
    return split_tokens(k, gluon_splits(cfg, b * cdiv(H, 64), k, sms, fp8), cfg.block_n)[0]


def main(argv=None) -> int:
    ap = result_parser(__doc__)
    ap.add_argument("--batches", default=None, help="comma list of batch sizes (default: BATCHES)")
    ap.add_argument("--kv", default="bf16,fp8", help="comma list of row layouts: bf16, fp8")
    ap.add_argument("--k", default=str(K), help=f"comma list of indices per row (default {K})")
    ap.add_argument("--max-splits", type=int, default=8)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("mla_split_count.py times GPU kernels: run it on a CUDA machine")
    batches = [int(b) for b in a.batches.split(",")] if a.batches else BATCHES
    ks = [int(k) for k in a.k.split(",")]
    layouts = a.kv.split(",")
    if any(x not in ("bf16", "fp8") for x in layouts) or a.max_splits < 1:
        ap.error(f"--kv takes bf16 and/or fp8 and --max-splits an int >= 1, got {a.kv!r}, {a.max_splits}")
    sms = sm_count(torch.device("cuda"))
    rows: list[dict[str, Any]] = []
    bad = 0
    for k, b in ((k, b) for k in ks for b in batches):
        q, kv16, idx = mla_case(b, k, H, DL, DR)
        for layout in layouts:
            fp8 = layout == "fp8"
            kv = quantize_mla_latents(kv16, DL) if fp8 else kv16
            ref = sparse_mla_decode_reference(q, kv, idx, kv_lora_rank=DL, sm_scale=0.1).float()
            base = default_gluon_config(H, fp8, b)
            tiles = cdiv(k, base.block_n)
            cases = [("default", None)] + [(f"splits={s}", replace(base, num_splits=s))
                                           for s in range(1, a.max_splits + 1)]
            shape_rows = []
            for name, cfg in cases:
                def fn(cfg=cfg, kv=kv):
                    return sparse_mla_decode_triton(q, kv, idx, kv_lora_rank=DL, sm_scale=0.1, config=cfg)
                r = {"B": b, "K": k, "heads": H, "kv": layout, "variant": name,
                     "num_splits": None if cfg is None else cfg.num_splits,
                     **mla_checked_time(fn, ref, b, k, H, DL, DR, 656 if fp8 else None)}
                bad += r["rel_err"] > TOLERANCE
                shape_rows.append(r)
                print(r, flush=True)
            best = min(shape_rows[1:], key=lambda r: r["us"])
            for r in shape_rows:
                r["best_splits"] = best["num_splits"]
                r["wave_model_splits"] = wave_model_splits(b * cdiv(H, 64), tiles, sms, a.max_splits)
                r["default_splits"] = default_splits(b, k, base, fp8)
                r["over_best"] = round(r["us"] / best["us"], 3)
            rows += shape_rows
            torch.cuda.empty_cache()
    return finish_checked_run("mla_split_count.json", {
        "what": "sparse MLA decode (Gluon kernels, the default config of each row layout) at 128 heads, K=2176 "
                "unless --k says otherwise, "
                "each split count beside the default dispatch (config=None), CUDA-graph timed; over_best: time "
                "over the shape's fastest split count; wave_model_splits: the count minimising "
                "ceil(programs x s / SMs) x ceil(tiles / s); rel_err: largest difference from the torch "
                "reference over its largest value",
        "sms": sms, "commit": a.commit, "rows": rows}, bad, "variants differ from the reference", True, a.out)


if __name__ == "__main__":
    sys.exit(main())
