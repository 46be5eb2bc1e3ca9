"""Selection per sparse layer (scoring + Top-k), old path vs new, in CUDA-graph replay.

Quest: Llama-8B GQA shape (32 query / 8 KV heads, head dim 128, bf16 bounds), 4096 pages
(64k tokens at page 16), top_k 128 pages, candidates = every page but one sink and the
last 4 (recent window). DSA: 64 index heads, index dim 128, FP8 index keys with per-token
scales, 65536 tokens, top_k 2048 tokens. B in 1, 8, 64.

- ``old``: what ``retrieve_topk`` ran per layer under capture before the selection kernel:
  the per-call conversions of the step's index tensors (``seq_lens``, candidate range,
  request slots, page or indexed counts), the scoring kernel, then ``masked_topk`` (masking,
  ``nan_to_num``, counting, a stable torch sort).
- ``new``: the scoring kernel reading the step's tensors as they are, then ``topk_select``
  (one Triton launch, radix select, ids in ascending order): two launches.

Both select the same ids (checked per row as sets). Times are CUDA-graph replays
(``benchmarks.common.cuda_time_us(graph=True)``): GPU time without Python launch overhead,
as a graph-captured decode step runs. ``score_us`` is the scoring kernel alone,
``masked_topk_us`` / ``topk_select_us`` the Top-k alone on the same scores. Quest rows also
time ``quest_retrieve`` fused (bounds + chunk shortlists in one kernel, then the merge;
forced even where ``quest_select_plan`` would score apart) as ``fused_us`` and unfused
(score kernel, then ``topk_select``) as ``unfused_us``; the fused ids must equal ``new``'s.
``--tiny`` adds the tiny-gqa shape (4 query / 2 KV heads x 32, 2048 pages).

Usage: ``PYTHONPATH=. python benchmarks/bench_selection.py`` on a GPU (writes
benchmarks/results/selection.json; ``--sweep`` adds topk_select and quest_score block /
warp variants);
``--quick`` runs tiny sizes on the CPU (no timing) to check the script end to end.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import cuda_time_us, write_result  # noqa: E402
from sparsehi.kernels.dsa_indexer import dsa_indexer, quantize_index_keys  # noqa: E402
from sparsehi.kernels.quest_score import quest_score, quest_score_triton  # noqa: E402
from sparsehi.kernels.quest_select import quest_retrieve  # noqa: E402
from sparsehi.input_checks import live_rows  # noqa: E402
from sparsehi.kernels.topk import masked_topk, topk_select, topk_select_triton  # noqa: E402

SINK, RECENT = 1, 4  # selection units outside the candidates (Quest pages; DSA scaled below)


def same_sets(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Rows of two ``-1``-padded selections hold the same ids (any order)."""
    return bool(torch.equal(a.long().sort(1).values, b.long().sort(1).values))


def quest_case(b: int, pages: int, page_size: int, top_k: int, dev: torch.device, hq: int = 32, hkv: int = 8,
               d: int = 128) -> dict[str, Callable[[], Any]]:
    g = torch.Generator(device=dev).manual_seed(b)
    kmin = torch.randn(b, pages, hkv, d, device=dev, generator=g).to(torch.bfloat16)
    kmax = (kmin.float() + torch.rand(b, pages, hkv, d, device=dev, generator=g)).to(torch.bfloat16)
    q = torch.randn(b, hq, d, device=dev, generator=g).to(torch.bfloat16)
    req = torch.randperm(b, device=dev, generator=g)  # int64, as the coordinator's batch carries it
    seq = torch.full((b,), pages * page_size, device=dev, dtype=torch.int32)
    cs = torch.full((b,), SINK, device=dev, dtype=torch.int32)
    ce = torch.full((b,), pages - RECENT, device=dev, dtype=torch.int32)
    mask = torch.ones(b, dtype=torch.bool, device=dev)
    r = kmin.shape[0]

    def old():
        seq_l, cs_l, ce_l = seq.long(), cs.long(), ce.long()
        num_pages = ((seq_l + page_size - 1) // page_size).to(torch.int32)
        req_l = req.long()
        rows = torch.where(live_rows(req_l, r), req_l, -1)
        scores = quest_score(q, kmin, kmax, rows, num_pages, "sum")
        return masked_topk(scores, top_k, cs_l, ce_l, mask)

    def score():
        return quest_score(q, kmin, kmax, req, seq, "sum", page_size=page_size)

    def new():
        return topk_select(score(), top_k, cs, ce, mask)

    def fused():  # bounds + chunk shortlists in one kernel, then the merge (forced: any shape)
        return quest_retrieve(q, kmin, kmax, req, seq, "sum", page_size, top_k, cs, ce, mask, fused=True)

    def unfused():  # the score kernel, then topk_select
        return quest_retrieve(q, kmin, kmax, req, seq, "sum", page_size, top_k, cs, ce, mask, fused=False)

    def score_variant(block_p: int, num_warps: int):
        return quest_score_triton(q, kmin, kmax, req, seq, "sum", page_size=page_size, block_p=block_p,
                                  num_warps=num_warps)

    return dict(old=old, new=new, score=score, score_variant=score_variant, fused=fused, unfused=unfused, cs=cs, ce=ce,
                mask=mask, top_k=top_k)


def dsa_case(b: int, tokens: int, top_k: int, dev: torch.device, heads: int = 64,
             di: int = 128) -> dict[str, Callable[[], Any]]:
    g = torch.Generator(device=dev).manual_seed(100 + b)
    keys, scales = quantize_index_keys(torch.randn(b, tokens, di, device=dev, generator=g))
    q = torch.randn(b, heads, di, device=dev, generator=g).to(torch.bfloat16)
    w = torch.rand(b, heads, device=dev, generator=g)
    req = torch.randperm(b, device=dev, generator=g)
    indexed = torch.full((b + 1,), tokens, device=dev, dtype=torch.int64)
    seq = torch.full((b,), tokens, device=dev, dtype=torch.int32)
    cs = torch.full((b,), SINK * 64, device=dev, dtype=torch.int32)
    ce = torch.full((b,), tokens - RECENT * 64, device=dev, dtype=torch.int32)
    mask = torch.ones(b, dtype=torch.bool, device=dev)
    r = keys.shape[0]

    def old():
        seq_l, cs_l, ce_l = seq.long(), cs.long(), ce.long()
        req_l = req.long()
        live = live_rows(req_l, r)
        counts = torch.where(live, indexed[torch.where(live, req_l, torch.full_like(req_l, r))], torch.zeros_like(req_l))
        rows = torch.where(live, req_l, torch.full_like(req_l, -1))
        scores = dsa_indexer(q.float(), w.float(), keys, scales, rows, torch.minimum(seq_l, counts))
        return masked_topk(scores, top_k, cs_l, ce_l, mask)

    def score():
        return dsa_indexer(q, w, keys, scales, req, seq, indexed)

    def new():
        return topk_select(score(), top_k, cs, ce, mask)

    return dict(old=old, new=new, score=score, cs=cs, ce=ce, mask=mask, top_k=top_k)


def measure(case: dict[str, Any], sweep: list[tuple[int, int, int, int]], timed: bool) -> dict[str, Any]:
    old_sel, old_valid = case["old"]()
    new_sel, new_valid = case["new"]()
    row: dict[str, Any] = {"same_selection": same_sets(old_sel, new_sel) and bool(torch.equal(old_valid, new_valid)),
                           "valid_min": int(new_valid.min())}
    if "fused" in case:
        f_sel, f_valid = case["fused"]()
        row["same_selection"] &= bool(torch.equal(f_sel, new_sel) and torch.equal(f_valid, new_valid))
    if not timed:
        return row
    if "fused" in case:
        row["fused_us"] = round(cuda_time_us(case["fused"], iters=20, graph=True), 2)
        row["unfused_us"] = round(cuda_time_us(case["unfused"], iters=20, graph=True), 2)
    scores = case["score"]()
    k, cs, ce, mask = case["top_k"], case["cs"], case["ce"], case["mask"]
    row["old_us"] = round(cuda_time_us(case["old"], iters=20, graph=True), 2)
    row["new_us"] = round(cuda_time_us(case["new"], iters=20, graph=True), 2)
    row["speedup"] = round(row["old_us"] / row["new_us"], 2)
    row["score_us"] = round(cuda_time_us(case["score"], iters=20, graph=True), 2)
    row["masked_topk_us"] = round(cuda_time_us(lambda: masked_topk(scores, k, cs, ce, mask), iters=20, graph=True), 2)
    row["topk_select_us"] = round(cuda_time_us(lambda: topk_select(scores, k, cs, ce, mask), iters=20, graph=True), 2)
    for sample, block, list_block, warps in sweep:
        fn = (lambda smp=sample, blk=block, lb=list_block, nw=warps:
              topk_select_triton(scores, k, cs, ce, mask, sample=smp, block=blk, list_block=lb, num_warps=nw))
        key = f"sample{sample}_block{block}_list{list_block}_warps{warps}"
        row.setdefault("topk_select_variants_us", {})[key] = round(cuda_time_us(fn, iters=20, graph=True), 2)
    if sweep and "score_variant" in case:
        for block_p, warps in SCORE_SWEEP:
            fn = lambda bp=block_p, nw=warps: case["score_variant"](bp, nw)  # noqa: E731
            row.setdefault("score_variants_us", {})[f"block_p{block_p}_warps{warps}"] = round(
                cuda_time_us(fn, iters=20, graph=True), 2)
    return row


# (sample, block, list_block, num_warps) variants of topk_select_triton (default 4096, 4096, 2048, 8)
SWEEP = [(4096, 4096, 2048, 4), (4096, 4096, 2048, 16), (8192, 8192, 2048, 16), (2048, 2048, 1024, 4),
         (2048, 4096, 2048, 8), (4096, 8192, 4096, 16)]
# (block_p, num_warps) variants of quest_score_triton (default 16, 4)
SCORE_SWEEP = [(8, 4), (32, 4), (32, 8), (64, 8)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny sizes on the CPU, no timing, no result file")
    ap.add_argument("--sweep", action="store_true", help="also time topk_select block / list-block / warp variants")
    ap.add_argument("--tiny", action="store_true", help="also the tiny-gqa Quest shape (4 / 2 heads x 32, B 1, 2, 8)")
    ap.add_argument("--out", default=None, help="result directory (default benchmarks/results)")
    args = ap.parse_args()
    t0 = time.time()
    if args.quick:
        dev, batches = torch.device("cpu"), (1, 3)
        quest_shape = dict(pages=64, page_size=16, top_k=8, hq=4, hkv=2, d=16)
        dsa_shape = dict(tokens=6000, top_k=200, heads=4, di=16)  # longer than the sample
    else:
        if not torch.cuda.is_available():
            sys.exit("bench_selection needs a CUDA GPU (--quick checks the script on the CPU)")
        dev, batches = torch.device("cuda"), (1, 8, 64)
        quest_shape = dict(pages=4096, page_size=16, top_k=128)
        dsa_shape = dict(tokens=65536, top_k=2048)
    sweep = SWEEP if args.sweep and not args.quick else []
    cases = [(b, "quest", quest_case, quest_shape) for b in batches] + [(b, "dsa", dsa_case, dsa_shape) for b in batches]
    cases.sort(key=lambda c: c[0])
    if args.tiny:
        tiny = dict(pages=64 if args.quick else 2048, page_size=16, top_k=8 if args.quick else 128, hq=4, hkv=2, d=32)
        cases += [(b, "quest_tiny", quest_case, tiny) for b in (1, 2, 8)]
    rows = []
    for b, name, make, shape in cases:
        r = measure(make(b, dev=dev, **shape), sweep, timed=not args.quick)
        r = {"algorithm": name, "batch": b, **{k: v for k, v in shape.items()}, **r}
        rows.append(r)
        print(r, flush=True)
        if not r["same_selection"]:
            raise SystemExit(f"{name} B={b}: old and new select different ids")
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    if args.quick:
        print(f"quick check ok ({time.time() - t0:.1f} s)")
        return
    payload = {
        "what": "per-layer selection (scoring + Top-k) in CUDA-graph replay: old = per-call index conversions + "
                "scoring kernel + masked_topk (torch sort); new = scoring kernel + topk_select (Triton radix select)",
        "quest_shape": {"hq": 32, "hkv": 8, "head_dim": 128, "dtype": "bfloat16", **quest_shape},
        "dsa_shape": {"index_heads": 64, "index_head_dim": 128, "index_dtype": "fp8_e4m3 + scale", **dsa_shape},
        "rows": rows,
        "wall_s": round(time.time() - t0, 1),
    }
    print("wrote", write_result("selection.json", payload, args.out))


if __name__ == "__main__":
    main()
