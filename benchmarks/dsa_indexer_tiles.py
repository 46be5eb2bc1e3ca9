"""DSA indexer launch shapes: tiles of index keys per program (the row's queries read once a
program, key loads pipelined in its loop), pipeline stages, tile size and warps, at the
decode's shapes (64 index heads x 128, FP8 keys with a float32 scale, bf16 queries, or those
quantised to FP8 in the kernel with ``--dots``), in CUDA-graph replays; each variant's scores
checked bit for bit against one tile a program of the same tile size, and its key bytes against
the device's copy bandwidth measured in the same run.

    PYTHONPATH=. python benchmarks/dsa_indexer_tiles.py          # -> results/dsa_indexer_tiles.json
    PYTHONPATH=. python benchmarks/dsa_indexer_tiles.py --quick  # CPU: the checks at small sizes
    PYTHONPATH=. python benchmarks/dsa_indexer_tiles.py --batches 30 --variants 64:8:3:4,64:16:3:4
    PYTHONPATH=. python benchmarks/dsa_indexer_tiles.py --dots fp16,fp8
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import cuda_time_us, finish_checked_run, hbm_copy_gbps, result_parser  # noqa: E402
from hicache.triton_support import cdiv, sm_count  # noqa: E402
from sparsehi.kernels.dsa_indexer import (PIPELINE_STAGES, dsa_indexer_reference, dsa_indexer_triton,  # noqa: E402
                                          indexer_tiles, quantize_index_keys)

DOTS = {"bf16": dict(fp16_dot=False), "fp16": dict(fp16_dot=None), "fp8": dict(fp8_queries=True)}
"""The products ``--dots`` names, as the launcher's arguments."""
BATCHES = [1, 8, 30, 39, 64]
TOKENS = 32780
"""A dsv32-shape pool row at 32k context (the context plus decode steps)."""
VARIANTS = [  # (block_t, tiles, num_stages, num_warps); tiles None: the launcher's choice
    (64, 1, 1, 4), (64, 2, 2, 4), (64, 4, 2, 4), (64, 8, 2, 4), (64, 4, 3, 4), (64, 8, 3, 4),
    (128, 1, 1, 4), (128, 2, 2, 4), (128, 4, 2, 4), (128, 4, 2, 8), (64, None, None, 4),
]


def case(b: int, tokens: int, heads: int, dim: int, device: str) -> tuple:
    g = torch.Generator(device=device).manual_seed(b)
    keys, scales = quantize_index_keys(torch.randn(b + 1, tokens, dim, device=device, generator=g))
    q = torch.randn(b, heads, dim, device=device, generator=g).to(torch.bfloat16)
    w = torch.rand(b, heads, device=device, generator=g)
    req = torch.randperm(b, device=device, generator=g)
    n = torch.full((b,), tokens - 12, dtype=torch.int32, device=device)
    indexed = torch.full((b + 1,), tokens - 12, dtype=torch.int64, device=device)
    return q, w, keys, scales, req, n, indexed


def main(argv=None) -> int:
    ap = result_parser(__doc__)
    ap.add_argument("--quick", action="store_true", help="CPU: the checks at small sizes, no timing, no file")
    ap.add_argument("--batches", default=None, help="comma list of batch sizes (default: all of BATCHES)")
    ap.add_argument("--variants", default=None,
                    help="comma list of BLOCK_T:TILES:STAGES:WARPS[:MAX_REGISTERS] launch shapes (default: VARIANTS)")
    ap.add_argument("--bf16-dot", action="store_true",
                    help="bf16 queries over FP8 keys dot in bf16 (the launcher's fp16_dot=False), as before "
                         "2026-11-28 (the same as --dots bf16)")
    ap.add_argument("--dots", default=None,
                    help="comma list of the products to time, each at every launch shape: bf16 (fp16_dot=False), "
                         "fp16 (the launcher's default for bf16 queries), fp8 (fp8_queries=True: the queries "
                         "quantised to FP8 in the kernel); default fp16")
    a = ap.parse_args(argv)
    cuda = torch.cuda.is_available() and not a.quick
    dev = "cuda" if cuda else "cpu"
    batches, tokens, heads, dim = (BATCHES, TOKENS, 64, 128) if cuda else ([1, 3], 300, 4, 32)
    variants = VARIANTS if cuda else [(16, 1, 1, 4), (16, 4, 2, 4), (32, 2, 3, 4), (16, None, None, 4)]
    try:
        if a.batches:
            batches = [int(v) for v in a.batches.split(",")]
        if a.variants:
            variants = [tuple(int(x) for x in v.split(":")) for v in a.variants.split(",")]
    except ValueError:
        ap.error(f"--batches takes ints and --variants BLOCK_T:TILES:STAGES:WARPS[:MAX_REGISTERS] ints, got "
                 f"{a.batches!r}, {a.variants!r}")
    if any(len(v) not in (4, 5) or min(x for x in v if x is not None) < 1 for v in variants) or any(b < 1 for b in batches):
        ap.error(f"--variants are four or five positive ints each and --batches positive, got {a.variants!r}, "
                 f"{a.batches!r}")
    variants = [(*v, None) if len(v) == 4 else v for v in variants]
    dots = ["bf16"] if a.bf16_dot else (a.dots or "fp16").split(",")
    if not dots or any(d not in DOTS for d in dots):
        ap.error(f"--dots takes a comma list of {tuple(DOTS)}, got {a.dots!r}")
    hbm = hbm_copy_gbps() if cuda else None  # bytes read + written a second: what a stream of reads reaches
    rows: list[dict[str, Any]] = []
    for b in batches:
        args = case(b, tokens, heads, dim, dev)
        key_bytes = b * (tokens - 12) * (dim + 4)  # FP8 values and a float32 scale a token
        live = torch.arange(tokens, device=dev)[None, :] < (tokens - 12)
        native = None
        for dot in dots:
            kw = DOTS[dot]
            # the reference of a variant: one tile a program, same tile size and warps (the warps
            # set the MMA's layout, so the order of the head sum)
            one_tile = {(bt, nw): dsa_indexer_triton(*args, block_t=bt, tiles=1, num_stages=1, num_warps=nw, **kw)
                        for bt, nw in {(v[0], v[3]) for v in variants}}
            scores = next(iter(one_tile.values()))
            ref = dsa_indexer_reference(*args, fp8_queries=dot == "fp8")
            quality: dict[str, Any] = {"max_abs_err_vs_reference": round(float(
                (scores[live.expand_as(scores)] - ref[live.expand_as(ref)]).abs().max()), 6)}
            if dot != "fp8" and native is None:
                native = scores
            if dot == "fp8" and native is not None:
                # what FP8 queries change in the selection: the top 2048 (or a tenth) of each row
                k = min(2048, max(1, (tokens - 12) // 10))
                a_ids, b_ids = native.topk(k, dim=1).indices, scores.topk(k, dim=1).indices
                shared = sum(int(torch.isin(a_ids[r], b_ids[r]).sum()) for r in range(b))
                quality["topk_shared_with_native_queries"] = round(shared / (b * k), 4)
            for block_t, tiles, stages, warps, regs in variants:
                def run(block_t=block_t, tiles=tiles, stages=stages, warps=warps, regs=regs, kw=kw):
                    return dsa_indexer_triton(*args, block_t=block_t, tiles=tiles, num_stages=stages,
                                              num_warps=warps, max_registers=regs, **kw)

                chosen = tiles if tiles is not None else indexer_tiles(b, cdiv(tokens, block_t), sm_count(
                    torch.device(dev), off_cuda=132))
                row: dict[str, Any] = {"batch": b, "tokens": tokens, "block_t": block_t, "tiles": chosen,
                                       "launcher_choice": tiles is None, "num_stages": stages if stages is not None
                                       else (1 if chosen == 1 else PIPELINE_STAGES), "num_warps": warps,
                                       "max_registers": regs, "dot": dot,
                                       "same_as_one_tile": bool(torch.equal(run(), one_tile[(block_t, warps)])),
                                       **quality}
                if cuda:
                    us = cuda_time_us(run, iters=30, graph=True)
                    row.update(us=round(us, 2), key_gbps=round(key_bytes / us / 1e3, 1),
                               frac_of_copy_bandwidth=round(key_bytes / us / 1e3 / hbm, 3))
                rows.append(row)
                print(row, flush=True)
    bad = [r for r in rows if not r["same_as_one_tile"]]
    return finish_checked_run("dsa_indexer_tiles.json", {
        "what": "DSA indexer scores [B, T] at the decode's shapes (64 index heads x 128, FP8 keys + float32 "
                "scale, bf16 queries), CUDA-graph replays (us per call) per launch shape and product (dot: bf16 "
                "or fp16 tensor-core products of the bf16 queries, or fp8: the queries quantised to FP8 in the "
                "kernel, FP8 x FP8 products); key_gbps: index key bytes (132 a token) over the time; "
                "frac_of_copy_bandwidth against the device-to-device copy's GB/s (bytes read + written) "
                "measured in this run; same_as_one_tile: scores equal to one tile a program of the same "
                "block_t, bit for bit; max_abs_err_vs_reference: against the torch reference of the same "
                "product (fp8: with the queries quantised as the kernel does); "
                "topk_shared_with_native_queries: the share of each row's top 2048 that the fp8 product "
                "keeps from the first non-fp8 product's",
        "copy_gbps": hbm and round(hbm, 1), "commit": a.commit, "rows": rows},
        len(bad), "variants differ from one tile a program", cuda, a.out)


if __name__ == "__main__":
    sys.exit(main())
