"""Top-k of long rows: ``topk_select``'s paths side by side in CUDA-graph replay.

Shapes: Quest's page scores at 1M tokens (65,536 pages of 16, top 128 and 128 + 80 ahead)
and at 64k / 128k, DSA's token scores (top 2048) at 32k-128k, batch 1 to 64. Paths: the
default dispatch, the one-program-per-row kernel (``split=False``), the chunk shortlists of
``topk_split`` where its plan exists, and the floor filter of ``topk_floor`` at its own plan
and at other chunk sizes / warps. Every path's ids are checked against the torch reference.

    PYTHONPATH=. python benchmarks/bench_topk_long.py            # GPU (~1 min)
    PYTHONPATH=. python benchmarks/bench_topk_long.py --quick    # CPU smoke run (interpreter)
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

if "--quick" in sys.argv:  # the interpreter must be chosen before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

from benchmarks.common import cuda_time_us, device_info, write_result  # noqa: E402
from hicache.triton_support import sm_count  # noqa: E402
from sparsehi.kernels.topk import topk_select, topk_select_reference, topk_select_triton  # noqa: E402
from sparsehi.kernels.topk_floor import floor_plan, topk_select_floor  # noqa: E402
from sparsehi.kernels.topk_split import split_plan, topk_select_split  # noqa: E402

SHAPES = [  # (what, batch, ids, top_k)
    ("quest_1m", 1, 65536, 128), ("quest_1m_ahead", 1, 65536, 208), ("quest_128k", 1, 8192, 128),
    ("quest_64k", 1, 4096, 128), ("quest_64k", 10, 4096, 128), ("quest_1m", 4, 65536, 128),
    ("dsa_32k", 1, 32768, 2048), ("dsa_64k", 1, 65536, 2048), ("dsa_64k", 8, 65536, 2048),
    ("dsa_64k", 64, 65536, 2048), ("dsa_128k", 1, 131072, 2048), ("dsa_128k", 16, 131072, 2048),
]
QUICK = [("tiny", 1, 600, 40), ("tiny", 2, 300, 20)]


def paths(b: int, n: int, k: int, sms: int, quick: bool) -> dict:
    """name -> callable(scores, cs, ce) of every path that applies to this shape."""
    out = {"dispatch": lambda s, cs, ce: topk_select(s, k, cs, ce),
           "one_program": lambda s, cs, ce: topk_select_triton(s, k, cs, ce, split=False)}
    plan = split_plan(b, n, k, sms)
    if plan is not None:
        out["split"] = lambda s, cs, ce: topk_select_split(s, k, cs, ce, None, plan)
    small = dict(sample=32, block=32, list_block=32) if quick else {}
    chunks = (64,) if quick else (2048, 4096, 8192, 16384)
    for chunk in chunks:
        p = -(-n // chunk)
        if p > 64:
            continue
        for warps in ((4,) if quick else (4, 8, 16)):
            out[f"floor_c{chunk}_w{warps}"] = (lambda s, cs, ce, pl=(p, chunk), w=warps:
                                               topk_select_floor(s, k, cs, ce, None, pl, num_warps=w, **small))
    fp = floor_plan(b, n, k, sms)
    if fp is not None:
        out["floor_plan"] = lambda s, cs, ce: topk_select_floor(s, k, cs, ce, None, fp)
        out["floor_plan_s2048"] = lambda s, cs, ce: topk_select_floor(s, k, cs, ce, None, fp, sample=2048)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    dev = torch.device("cpu" if args.quick or not torch.cuda.is_available() else "cuda")
    sms = sm_count(dev, off_cuda=132)
    t0 = time.time()
    rows = []
    for what, b, n, k in (QUICK if args.quick else SHAPES):
        g = torch.Generator(device=dev).manual_seed(0)
        # Quest-like: smooth scores with a few peaks; DSA-like: relu'd logits (many zeros)
        s = torch.randn(b, n, device=dev, generator=g)
        if what.startswith("dsa"):
            s = s.relu()
        cs = torch.zeros(b, dtype=torch.int32, device=dev)
        ce = torch.full((b,), n, dtype=torch.int32, device=dev)
        ref = topk_select_reference(s, k, cs, ce)
        row = {"what": what, "batch": b, "ids": n, "top_k": k, "split_plan": split_plan(b, n, k, sms),
               "floor_plan": floor_plan(b, n, k, sms), "us": {}, "same": {}}
        for name, fn in paths(b, n, k, sms, args.quick).items():
            got = fn(s, cs, ce)
            row["same"][name] = bool(torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1]))
            if dev.type == "cuda":
                row["us"][name] = round(cuda_time_us(lambda: fn(s, cs, ce), iters=20, graph=True), 2)
        print(json.dumps(row), flush=True)
        rows.append(row)
    payload = {**device_info(), "what": __doc__.split("\n\n")[0], "rows": rows, "wall_s": round(time.time() - t0, 1),
               "quick": args.quick}
    if not args.quick:
        write_result("topk_long.json", payload, args.out)
    return 0 if all(all(r["same"].values()) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
