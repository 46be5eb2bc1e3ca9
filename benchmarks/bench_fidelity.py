"""Selection fidelity of the built-in algorithms on synthetic long contexts.

Measures selection *quality*, not speed (CPU is fine). Per context length (16k, 32k
tokens), token budget (256 … 4096) and algorithm: the share of the best possible top-k
attention mass the selection captures, the relative error of the attention output vs
dense attention, and the fraction of planted needles retrieved.

Contexts: Llama-8B-shaped heads (32 query heads, 8 KV heads, dim 128); "natural-like"
distractor keys = per-head bias with a few large outlier channels + a low-rank component
that drifts smoothly with position + token noise; values low-rank + noise; the query
leans towards the recent context's low-rank state. Needles: keys at random positions
(inside the selectable range) get an added component along their GQA group's mean query,
lifting the group's mean softmax logit 2 nats above the group's best distractor. Queries
are scaled so each head's softmax logits have std 1.8 (long-tailed, not one-hot).

Algorithms: oracle (exact head-summed q·k, page 16 and token mode), quest (page 16,
heads summed; ``quest_max``: max over heads), dsa (token-wise; index keys = a fixed random
projection of the attention keys, see ``ProjectedIndexerInputs``), and the
``examples/sink_window.py`` sliding window (the query-blind floor). Sink (64 tokens) and
recent window (64 tokens) are always attended and do not count against the budget.

FP8 host KV (key ``fp8_host_kv``): Quest at 32k and 128k over the same contexts with the KV
rounded as FP8 host pages round it, beside the same KV in bf16 (mass recall, needles,
output error; ``benchmarks/fidelity_fp8.py``), and forced top-1 agreement of sparse-hier
with FP8 host KV and with bf16 host KV on the tiny models (``benchmarks/fidelity_forced.py``).

Run: ``PYTHONPATH=. python benchmarks/bench_fidelity.py`` (``--quick`` for a smoke run;
``--fp8-host-kv only`` measures the FP8 section alone and merges it into the existing
``fidelity.json``).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # for the kernel = reference check on CPU

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.common import RESULTS_DIR, device_info, write_result  # noqa: E402
from benchmarks.fidelity_context import (D, HKV, HQ, INDEX_DIM, LOGIT_STD, NEEDLE_MARGIN,  # noqa: E402
                                         NEEDLES, PAGE, RECENT, SINK, attended_tokens, build, dense_attention,
                                         make_context, unit_mass)
from benchmarks.fidelity_forced import forced_agreement_rows  # noqa: E402
from benchmarks.fidelity_fp8 import MODEL_KV_DTYPE, fp8_rows, fp8_summary  # noqa: E402
from sparsehi.algorithms.testing import ProjectedIndexerInputs  # noqa: E402
from sparsehi.kernels.dsa_indexer import dsa_indexer_reference, dsa_indexer_triton  # noqa: E402
from sparsehi.kernels.quest_score import quest_score_reference, quest_score_triton  # noqa: E402
from sparsehi.kernels.topk import masked_topk  # noqa: E402


def evaluate(t: int, budgets: list[int], trials: int, algos: list[str], device: torch.device) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    acc: dict[tuple[str, int], dict[str, list[float]]] = {}
    for trial in range(trials):
        ctx = make_context(t, seed=1000 * t + trial, device=device)
        o_dense, p = dense_attention(ctx["q"], ctx["keys"], ctx["values"])
        for name in algos:
            unit, cs, ce, retrieve = build(name, max(budgets), ctx, t, device)
            mass = unit_mass(p, unit)
            needle_units = (ctx["needles"] // unit).tolist()
            for budget in budgets:
                k_units = budget // unit
                sel = retrieve(budget)
                best = torch.topk(mass[cs:ce], min(k_units, ce - cs)).values.sum()
                recall = float(mass[sel].sum() / best)
                o_sparse, _ = dense_attention(ctx["q"], ctx["keys"], ctx["values"], attended_tokens(sel, cs, ce, unit, t))
                err = float((o_sparse - o_dense).norm() / o_dense.norm())
                chosen = set(sel.tolist())
                hit = sum(1 for u in needle_units if u in chosen) / len(needle_units)
                d = acc.setdefault((name, budget), {"mass_recall": [], "output_rel_error": [], "needle_recall": []})
                d["mass_recall"].append(recall)
                d["output_rel_error"].append(err)
                d["needle_recall"].append(hit)
    for (name, budget), d in acc.items():
        rows.append({
            "context": t, "budget_tokens": budget, "algorithm": name,
            "unit": "token" if name in ("dsa", "oracle_token") else f"page{PAGE}",
            **{k: round(sum(v) / len(v), 5) for k, v in d.items()},
            "mass_recall_min": round(min(d["mass_recall"]), 5),
            "needle_recall_min": round(min(d["needle_recall"]), 5),
            "trials": len(d["mass_recall"]),
        })
    return rows


def kernel_equals_reference(t: int, budget: int, device: torch.device) -> dict[str, Any]:
    """DSA and Quest: the Triton kernel (interpreted on CPU) selects the same top-k as the
    torch reference on one context."""
    ctx = make_context(t, seed=7, device=device)
    proj = ProjectedIndexerInputs(INDEX_DIM, seed=99)
    ik = proj.index_keys(ctx["keys"]).to(torch.bfloat16)[None]
    iq = proj.index_queries(ctx["q"][None], HKV)
    w = torch.ones(1, HQ, device=device)
    req = torch.zeros(1, dtype=torch.int64, device=device)
    n = torch.tensor([t], device=device)
    cs, ce = torch.tensor([SINK], device=device), torch.tensor([t - RECENT], device=device)
    out: dict[str, Any] = {"context": t, "budget_tokens": budget}
    ref = dsa_indexer_reference(iq, w, ik, None, req, n)
    tri = dsa_indexer_triton(iq, w, ik, None, req, n)
    a, _ = masked_topk(ref, budget, cs, ce)
    b, _ = masked_topk(tri, budget, cs, ce)
    out["dsa_selection_overlap"] = float(torch.isin(a[0], b[0]).float().mean())
    out["dsa_max_abs_score_diff"] = float((ref - tri)[:, :t].abs().max())
    kp = ctx["keys"].view(-1, PAGE, HKV, D)
    kmin, kmax = kp.amin(1)[None], kp.amax(1)[None]
    npg = torch.tensor([t // PAGE], device=device)
    ref = quest_score_reference(ctx["q"][None], kmin, kmax, req, npg)
    tri = quest_score_triton(ctx["q"][None], kmin, kmax, req, npg)
    cs_p, ce_p = cs // PAGE, ce // PAGE
    a, _ = masked_topk(ref, budget // PAGE, cs_p, ce_p)
    b, _ = masked_topk(tri, budget // PAGE, cs_p, ce_p)
    out["quest_selection_overlap"] = float(torch.isin(a[0], b[0]).float().mean())
    out["quest_max_rel_score_diff"] = float(((ref - tri).abs() / ref.abs().clamp_min(1e-6)).max())
    return out


def fp8_host_kv_section(quick: bool, trials: int, device: torch.device) -> dict[str, Any]:
    """FP8 host KV beside the model's dtype: Quest on the synthetic contexts
    (``benchmarks/fidelity_fp8.py``) and forced top-1 agreement on the tiny models
    (``benchmarks/fidelity_forced.py``), with the device and date that measured them."""
    t0 = time.time()
    if quick:  # 4101: a partial last page, left in bf16
        contexts, budgets, trials = [2048, 4101], [256, 512], 1
    else:
        contexts, budgets = [32768, 131072], [1024, 2048, 4096, 8192]
    rows, rounding = fp8_rows(contexts, budgets, trials, device)
    print(f"fp8 host KV, synthetic contexts: done at {time.time() - t0:.0f}s", flush=True)
    tiny = forced_agreement_rows(quick, device.type)
    info = device_info()
    return {
        "device": info["device"], "date": info["date"],
        "setup": {
            "contexts": contexts, "budgets_tokens": budgets, "trials": trials, "algorithm": "quest (page 16, heads summed)",
            "kv": f"the synthetic context's KV in {str(MODEL_KV_DTYPE).removeprefix('torch.')}; fp8_e4m3 rows: its "
                  "complete pages (k and v, every head, sink and recent window included) rounded by fp8_round_trip "
                  "(hicache/kv_page_format.py), a partial last page left as it is",
            "quest_bounds_from": {
                "bf16_keys": "a prompt prefilled in the request: the runtime builds its bounds before its pages are "
                             "rounded, so its selection is the bf16 selection",
                "fp8_keys": "a prefix reused from the host tier or L3: its keys come back rounded",
            },
            "metrics": {
                "mass_recall": "head-averaged bf16 attention mass on the selected pages / the best top-k candidate "
                               "pages' bf16 mass (the bf16 rows' measure); mass_recall_drop = bf16 row - this row",
                "mass_recall_of_fp8_attention": "the same, of the attention over the rounded KV",
                "output_rel_error": "sparse attention over this row's KV vs dense attention over bf16 KV",
                "output_rel_error_vs_bf16_same_selection": "vs sparse attention over bf16 KV, same selection",
                "selection_overlap_with_bf16": "share of the bf16 selection's pages selected",
                "forced_top1_agreement": "tiny models: share of decode positions whose argmax agrees between "
                                         "sparse-hier with FP8 host KV and with host KV in the model's dtype, both "
                                         "teacher-forced with dense's tokens",
            },
        },
        "summary": fp8_summary(rows),
        "results": rows,
        "kv_rounding": rounding,
        "tiny_models": tiny,
        "elapsed_s": round(time.time() - t0, 1),
    }


def merge_section(key: str, section: dict[str, Any], out_dir: Path | None) -> Path:
    """Write ``section`` under ``key`` of ``fidelity.json`` in ``out_dir`` (default
    benchmarks/results), keeping the file's other keys; a new file if there is none."""
    path = Path(out_dir or RESULTS_DIR) / "fidelity.json"
    if not path.exists():
        return write_result("fidelity.json", {"benchmark": "fidelity", key: section}, out_dir)
    data = json.loads(path.read_text())
    data[key] = section
    path.write_text(json.dumps(data, indent=2) + "\n")
    return path


def print_fp8_section(section: dict[str, Any]) -> None:
    s = section["summary"]
    print("fp8 host KV:", {k: s[k] for k in ("bounds_bf16_keys", "bounds_fp8_keys", "drop_over_limit")})
    for r in section["tiny_models"]:
        print(f"  {r['model']} forced top-1 agreement fp8 vs {r['model_dtype']}: {r['forced_top1_agreement']:.4f} "
              f"(vs dense: {r['forced_top1_agreement_fp8_vs_dense']:.4f} fp8, "
              f"{r['forced_top1_agreement_model_dtype_vs_dense']:.4f} {r['model_dtype']}; {r['positions']} positions)")


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ctxs = sorted({r["context"] for r in rows})
    algos = list(dict.fromkeys(r["algorithm"] for r in rows))
    fig, axes = plt.subplots(2, len(ctxs), figsize=(5.5 * len(ctxs), 8), squeeze=False)
    for j, t in enumerate(ctxs):
        for name in algos:
            rs = sorted((r for r in rows if r["context"] == t and r["algorithm"] == name), key=lambda r: r["budget_tokens"])
            x = [r["budget_tokens"] for r in rs]
            axes[0][j].plot(x, [r["mass_recall"] for r in rs], marker="o", label=name)
            axes[1][j].plot(x, [r["output_rel_error"] for r in rs], marker="o", label=name)
        axes[0][j].set_title(f"{t // 1024}k context: recall of top-k attention mass")
        axes[1][j].set_title(f"{t // 1024}k context: attention output rel. error vs dense")
        for i in (0, 1):
            axes[i][j].set_xscale("log", base=2)
            axes[i][j].set_xlabel("budget (tokens, sink + recent excluded)")
            axes[i][j].grid(alpha=0.3)
        axes[1][j].set_yscale("log")
        axes[0][j].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small contexts and one trial (smoke run)")
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--out", default=None, help="result directory (default benchmarks/results)")
    ap.add_argument("--plot-from", default=None, help="only redraw fidelity.png next to this fidelity.json")
    ap.add_argument("--fp8-host-kv", choices=("include", "only", "skip"), default="include",
                    help="the FP8 host KV section (key fp8_host_kv): with the rest, only it (merged into the existing "
                         "fidelity.json, whose other keys are kept), or not at all")
    args = ap.parse_args(argv)
    if args.plot_from:
        src = Path(args.plot_from)
        plot(json.loads(src.read_text())["results"], src.with_suffix(".png"))
        return 0
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    out_dir = Path(args.out) if args.out else None
    fp8 = fp8_host_kv_section(args.quick, args.trials, device) if args.fp8_host_kv != "skip" else None
    if fp8 is not None:
        print_fp8_section(fp8)
    if args.fp8_host_kv == "only":
        print(f"wrote {merge_section('fp8_host_kv', fp8, out_dir)} (key fp8_host_kv)")
        return 0
    if args.quick:
        contexts, budgets, trials = [2048, 4096], [256, 512], 1
    else:
        contexts, budgets, trials = [16384, 32768], [256, 512, 1024, 2048, 4096], args.trials
    algos = ["oracle_page", "oracle_token", "quest", "quest_max", "dsa", "sink_window"]
    t0 = time.time()
    rows: list[dict[str, Any]] = []
    for t in contexts:
        rows += evaluate(t, budgets, trials, algos, device)
        print(f"context {t}: done at {time.time() - t0:.0f}s", flush=True)
    check_t = contexts[-1] if (device.type == "cuda" or args.quick) else 8192
    kernel_check = kernel_equals_reference(check_t, min(2048, check_t // 4), device)
    big, tb = contexts[-1], 2048 if not args.quick else 512

    def at(name: str, key: str, agg: str = "") -> float:
        r = next(r for r in rows if r["context"] == big and r["budget_tokens"] == tb and r["algorithm"] == name)
        return r[key + agg]

    targets = {
        "context": big, "budget_tokens": tb,
        "quest_mass_recall": at("quest", "mass_recall"), "quest_mass_recall_min": at("quest", "mass_recall", "_min"),
        "quest_mass_recall_target": 0.95, "quest_needle_recall_min": at("quest", "needle_recall", "_min"),
        "dsa_needle_recall_min": at("dsa", "needle_recall", "_min"),
        "dsa_kernel_selection_overlap": kernel_check["dsa_selection_overlap"],
    }
    targets["met"] = bool(targets["quest_mass_recall_min"] >= 0.95 and targets["quest_needle_recall_min"] == 1.0
                          and targets["dsa_needle_recall_min"] == 1.0 and targets["dsa_kernel_selection_overlap"] == 1.0)
    payload = {
        "benchmark": "fidelity",
        "setup": {
            "heads": {"q": HQ, "kv": HKV, "dim": D}, "page_size_quest": PAGE, "sink_tokens": SINK,
            "recent_tokens": RECENT, "needles_per_context": NEEDLES, "trials": trials, "contexts": contexts,
            "budgets_tokens": budgets,
            "distractors": "per-KV-head bias with 4 outlier channels (|6|), rank-16 state drifting smoothly with "
                           "position (6 sinusoids/dim, 0.5-30 cycles per context) + noise; values rank-16 + noise",
            "needles": f"key += its GQA group's mean-query direction, lifting the group's mean logit {NEEDLE_MARGIN} nats above its best distractor",
            "query_temperature": f"queries scaled per head to softmax-logit std {LOGIT_STD}",
            "head_reduce": "sum over query heads (oracle, quest: the defaults); quest_max = quest with max over heads",
            "dsa_index": f"index keys = fixed random projection P (N(0, 1/{INDEX_DIM}), {INDEX_DIM}x{HKV * D}) of the "
                         "concatenated attention keys; one index query per attention head = P applied to q_h in its "
                         "group's block; weights 1; index keys stored " +
                         ("fp8 e4m3 + per-token scale" if device.type == "cuda" and torch.cuda.get_device_capability() >= (8, 9) else "bf16"),
            "metrics": {
                "mass_recall": "head-averaged softmax attention mass of the selected units / mass of the best top-k "
                               "units (by mass) among the candidates, same granularity",
                "output_rel_error": "||o_sparse - o_dense|| / ||o_dense|| over all heads; o_sparse attends sink + "
                                    "selection + recent window",
                "needle_recall": "fraction of planted needles whose unit was selected",
            },
            "kernel_check_context": check_t,
        },
        "targets": targets,
        "kernel_equals_reference": kernel_check,
        "results": rows,
        **({"fp8_host_kv": fp8} if fp8 is not None else {}),
        "elapsed_s": round(time.time() - t0, 1),
    }
    path = write_result("fidelity.json", payload, out_dir)
    try:
        plot(rows, path.with_suffix(".png"))
    except ImportError as e:  # a bare GPU host may lack matplotlib: re-plot with --plot-from
        print(f"no plot ({e}); run --plot-from {path}")
    print(f"wrote {path} and {path.with_suffix('.png')}")
    print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in targets.items()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
