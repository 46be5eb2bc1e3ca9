"""Top-k of long rows: the radix select spread over each row's chunks (``topk_radix_grid``)
against one program per row, the chunk shortlists of ``topk_split`` (where their plan
applies), the row in registers with a bisected threshold (``topk_bisect``, rows of at
most 32768 ids), what ``topk_select`` dispatches and ``torch.topk`` (unsorted), in
CUDA-graph replays, each checked against ``topk_select_reference``.

    PYTHONPATH=. python benchmarks/topk_long_rows.py            # -> results/topk_long_rows.json
    PYTHONPATH=. python benchmarks/topk_long_rows.py --quick    # CPU: the checks at small sizes
    PYTHONPATH=. python benchmarks/topk_long_rows.py --shapes 131072x2048 --row-ids 32768
        # rows of 32768 candidates in scores of 131072 ids (a decode's scores span the pool's
        # max_context_len; -inf past a row's end, as the indexer writes)
        # -> results/topk_rows_shorter_than_n.json

Score kinds: ``randn``; ``indexer`` (DSA-like: a weighted sum over 64 heads of ReLU(q.k));
``crowded`` (1 + 1e-3 U(0, 1): every key shares its exponent bits).
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import cuda_time_us, finish_checked_run, result_parser  # noqa: E402
from hicache.triton_support import sm_count  # noqa: E402
from sparsehi.kernels.topk import radix_grid_plan, topk_select, topk_select_reference, topk_select_triton  # noqa: E402
from sparsehi.kernels.topk_bisect import MAX_BLOCK as BISECT_MAX_BLOCK, topk_select_bisect  # noqa: E402
from sparsehi.kernels.topk_radix_grid import CHUNK, topk_select_radix_grid  # noqa: E402
from sparsehi.kernels.topk_split import split_plan  # noqa: E402

SHAPES = [(8192, 2048), (32768, 2048), (65536, 2048), (131072, 2048), (65536, 208), (16384, 512)]
"""(ids per row, top_k): DSA top 2048 from 8k to 128k tokens, and smaller selections."""
BATCHES = [1, 8, 30, 64, 128]
KINDS = ["randn", "indexer", "crowded"]


def make_scores(kind: str, b: int, n: int, device: str) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(b * 7919 + n)
    if kind == "randn":
        return torch.randn(b, n, device=device, generator=g)
    if kind == "crowded":
        return 1.0 + 1e-3 * torch.rand(b, n, device=device, generator=g)
    q = torch.randn(b, 64, 64, device=device, generator=g)
    k = torch.randn(n, 64, device=device, generator=g)
    w = torch.rand(b, 64, device=device, generator=g)
    return sum(torch.relu(q[:, h] @ k.T) * w[:, h:h + 1] for h in range(64))


def variants(scores: torch.Tensor, k: int, cs: torch.Tensor, ce: torch.Tensor) -> dict[str, Callable[[], Any]]:
    b, n = scores.shape
    chunks = -(-n // CHUNK)
    out: dict[str, Callable[[], Any]] = {
        "one_program": lambda: topk_select_triton(scores, k, cs, ce, split=False, radix_grid=False, bisect=False),
        "radix_grid": lambda: topk_select_radix_grid(scores, k, cs, ce, None, chunks),
        "default": lambda: topk_select(scores, k, cs, ce),
    }
    if chunks & (chunks - 1):  # the grid over a power of two of chunks, as planned before 2026-11-28
        pow2 = 1 << chunks.bit_length()
        out["radix_grid_pow2_chunks"] = lambda: topk_select_radix_grid(scores, k, cs, ce, None, pow2)
    if n <= BISECT_MAX_BLOCK:
        out["bisect"] = lambda: topk_select_bisect(scores, k, cs, ce)
    plan = split_plan(b, n, k, sm_count(scores.device))
    if plan is not None:
        out["split"] = lambda: topk_select_triton(scores, k, cs, ce, radix_grid=False, bisect=False)
    return out


def main(argv=None) -> int:
    ap = result_parser(__doc__)
    ap.add_argument("--quick", action="store_true", help="CPU: the checks at small sizes, no timing, no file")
    ap.add_argument("--shapes", default=None, help="comma list of IDSxTOP_K (default: all of SHAPES)")
    ap.add_argument("--batches", default=None, help="comma list of batch sizes (default: all of BATCHES)")
    ap.add_argument("--kinds", default=None, help=f"comma list of score kinds, of {KINDS} (default: all)")
    ap.add_argument("--row-ids", type=int, default=None,
                    help="candidates per row (candidate_end; -inf past it), fewer than the shape's ids "
                         "(default: the whole row)")
    a = ap.parse_args(argv)
    cuda = torch.cuda.is_available() and not a.quick
    dev = "cuda" if cuda else "cpu"
    try:
        shapes = [tuple(int(x) for x in v.split("x")) for v in a.shapes.split(",")] if a.shapes else None
        batches = [int(v) for v in a.batches.split(",")] if a.batches else None
    except ValueError:
        ap.error(f"--shapes takes IDSxTOP_K pairs and --batches ints, got {a.shapes!r}, {a.batches!r}")
    kinds = a.kinds.split(",") if a.kinds else KINDS
    if any(k not in KINDS for k in kinds) or any(len(x) != 2 or min(x) < 1 for x in shapes or []):
        ap.error(f"--kinds must be of {KINDS}; --shapes pairs of positive ints")
    shapes = shapes or (SHAPES if cuda else [(5000, 300)])
    if a.row_ids is not None and not all(0 < a.row_ids <= n for n, _ in shapes):
        ap.error(f"--row-ids={a.row_ids} must be in [1, ids] of every shape")
    batches = batches or (BATCHES if cuda else [1, 3])
    rows = []
    for n, k in shapes:
        for b in batches:
            for kind in kinds:
                scores = make_scores(kind, b, n, dev).float()
                end = n if a.row_ids is None else a.row_ids
                scores[:, end:] = float("-inf")
                cs = torch.zeros(b, dtype=torch.int32, device=dev)
                ce = torch.full((b,), end, dtype=torch.int32, device=dev)
                ref = topk_select_reference(scores, k, cs, ce)
                row: dict[str, Any] = {"n": n, "row_ids": end, "top_k": k, "batch": b, "scores": kind,
                                       "radix_grid_plan": radix_grid_plan(b, n, k)}
                for name, fn in variants(scores, k, cs, ce).items():
                    ids, valid = fn()
                    row[f"{name}_exact"] = bool(torch.equal(ids, ref[0]) and torch.equal(valid, ref[1]))
                    if cuda:
                        row[f"{name}_us"] = round(cuda_time_us(fn, iters=20, graph=True), 2)
                if cuda:
                    row["torch_topk_us"] = round(cuda_time_us(lambda: torch.topk(scores, k, dim=1, sorted=False),
                                                              iters=20, graph=True), 2)
                    row["one_program_over_radix_grid"] = round(row["one_program_us"] / row["radix_grid_us"], 2)
                rows.append(row)
                print({x: y for x, y in row.items()}, flush=True)
    bad = [r for r in rows if not all(v for x, v in r.items() if x.endswith("_exact"))]
    name = "topk_long_rows.json" if a.row_ids is None else "topk_rows_shorter_than_n.json"
    return finish_checked_run(name, {
        "what": "top-k of long rows, CUDA-graph replays (us per call): one program per row, the chunk "
                "shortlists (split, where their plan applies), the radix select over each row's chunks "
                "(radix_grid; radix_grid_pow2_chunks: over the next power of two of chunks, where that "
                "differs), the row in registers with a bisected threshold (bisect, rows of at most 32768 "
                "ids), the default dispatch and torch.topk (unsorted); *_exact: ids and counts equal "
                "topk_select_reference's", "commit": a.commit, "rows": rows},
        len(bad), "rows differ from the reference", cuda, a.out)


if __name__ == "__main__":
    sys.exit(main())
