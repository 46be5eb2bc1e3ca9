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

Run: ``PYTHONPATH=. python benchmarks/bench_fidelity.py`` (``--quick`` for a smoke run).
"""
from __future__ import annotations

import argparse
import json
import math
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

from benchmarks.common import RESULTS_DIR, write_result  # noqa: E402
from examples.sink_window import SinkWindow  # noqa: E402
from sparsehi.algorithms.base import check_selection  # noqa: E402
from sparsehi.algorithms.dsa import DSAAlgorithm  # noqa: E402
from sparsehi.algorithms.oracle import OracleAlgorithm  # noqa: E402
from sparsehi.algorithms.quest import QuestAlgorithm  # noqa: E402
from sparsehi.algorithms.testing import ProjectedIndexerInputs  # noqa: E402
from sparsehi.config import SparseConfig  # noqa: E402
from sparsehi.kernels.dsa_indexer import dsa_indexer_reference, dsa_indexer_triton  # noqa: E402
from sparsehi.kernels.quest_score import quest_score_reference, quest_score_triton  # noqa: E402
from sparsehi.kernels.topk import masked_topk  # noqa: E402

HQ, HKV, D = 32, 8, 128
PAGE = 16
SINK, RECENT = 64, 64
INDEX_DIM = 128
NEEDLES = 8
LOGIT_STD = 1.8
NEEDLE_MARGIN = 2.0
KEY_NOISE = 0.7


# ---------------------------------------------------------------------------- data
def make_context(t: int, seed: int, device: torch.device) -> dict[str, Any]:
    """Keys/values ``[t, HKV, D]``, query ``[HQ, D]``, needle positions ``[NEEDLES]``."""
    g = torch.Generator().manual_seed(seed)
    rank = 16
    bias = torch.randn(HKV, D, generator=g) * 0.5
    outliers = torch.randperm(D, generator=g)[:4]
    bias[:, outliers] += torch.randn(HKV, 4, generator=g).sign() * 6.0  # massive channels
    a = torch.randn(HKV, D, rank, generator=g) / math.sqrt(rank) * 1.5
    # smooth positional drift of the low-rank state: a few slow sinusoids per rank dim
    pos = torch.arange(t, dtype=torch.float32)[:, None, None]
    freq = torch.rand(1, 6, rank, generator=g) * 30 + 0.5  # cycles per context
    phase = torch.rand(1, 6, rank, generator=g) * 2 * math.pi
    amp = torch.rand(1, 6, rank, generator=g)
    z = (amp * torch.sin(2 * math.pi * freq * pos / t + phase)).sum(1)  # [t, rank]
    z = z + 0.3 * torch.randn(t, rank, generator=g)
    keys = bias[None] + torch.einsum("gdr,tr->tgd", a, z) + KEY_NOISE * torch.randn(t, HKV, D, generator=g)
    av = torch.randn(HKV, D, rank, generator=g) / math.sqrt(rank)
    values = torch.einsum("gdr,tr->tgd", av, z) + 0.5 * torch.randn(t, HKV, D, generator=g)
    # query: own direction + the recent state + the outlier channels (as real queries)
    zq = z[-1] + 0.5 * torch.randn(rank, generator=g)
    grp = torch.arange(HQ) // (HQ // HKV)
    q = 0.8 * torch.randn(HQ, D, generator=g) + 0.5 * torch.einsum("hdr,r->hd", a[grp], zq)
    q[:, outliers] += 0.3 * torch.randn(HQ, 4, generator=g)
    # needles inside the selectable range, on distinct pages
    lo, hi = -(-SINK // PAGE) + 1, (t - RECENT) // PAGE - 1
    pages = lo + torch.randperm(hi - lo, generator=g)[:NEEDLES]
    npos = pages * PAGE + torch.randint(0, PAGE, (NEEDLES,), generator=g)
    # temperature: scale each head's query so its softmax logits have std LOGIT_STD
    # (a long-tailed but not one-hot attention, as in real long-context heads)
    logits = torch.einsum("hd,thd->ht", q, keys[:, grp]) / math.sqrt(D)
    q = q * (LOGIT_STD / logits.std(dim=1))[:, None]
    logits = torch.einsum("hd,thd->ht", q, keys[:, grp]) / math.sqrt(D)
    # needle: lift its group's mean logit NEEDLE_MARGIN nats above the group's best distractor
    u = q.view(HKV, -1, D).mean(1)
    u = u / u.norm(dim=-1, keepdim=True)
    gain = (q.view(HKV, -1, D) * u[:, None]).sum(-1).mean(1) / math.sqrt(D)  # mean scaled q_h·u
    lg = logits.view(HKV, -1, t).mean(1)  # [HKV, t]
    lift = (lg.amax(1) + NEEDLE_MARGIN)[:, None] - lg[:, npos]  # [HKV, NEEDLES]
    keys[npos] += (lift / gain.clamp_min(1e-3)[:, None]).T[:, :, None] * u[None]
    return {"keys": keys.to(device), "values": values.to(device), "q": q.to(device), "needles": npos.to(device)}


# ---------------------------------------------------------------------------- metrics
def dense_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None = None):
    """``q [HQ, D]``, keys/values ``[t, HKV, D]``, mask ``[t] bool`` → (out ``[HQ, D]``,
    probs ``[HQ, t]``)."""
    grp = torch.arange(HQ, device=q.device) // (HQ // HKV)
    logits = torch.einsum("hd,thd->ht", q, keys[:, grp]) / math.sqrt(D)
    if mask is not None:
        logits = logits.masked_fill(~mask[None], float("-inf"))
    p = torch.softmax(logits, dim=1)
    return torch.einsum("ht,thd->hd", p, values[:, grp]), p


def unit_mass(p: torch.Tensor, unit: int) -> torch.Tensor:
    """Head-averaged attention probability per unit ``[ceil(t / unit)]``."""
    m = p.mean(0)
    n = -(-m.numel() // unit)
    out = torch.zeros(n * unit, device=m.device)
    out[: m.numel()] = m
    return out.view(n, unit).sum(1)


# ---------------------------------------------------------------------------- algorithms
def build(name: str, max_budget: int, ctx: dict[str, Any], t: int, device: torch.device):
    """Instantiate ``name``, fill its representations from the context; returns
    ``(unit, candidate_start, candidate_end, retrieve(budget_tokens) -> selected unit ids)``."""
    unit = 1 if name in ("dsa", "oracle_token") else PAGE
    extra_cfg: dict[str, Any] = {"index_head_dim": INDEX_DIM} if name == "dsa" else {}
    if name == "quest_max":
        extra_cfg["head_reduce"] = "max"
    cfg = SparseConfig(algorithm=name, page_size=unit, top_k=max_budget, device_buffer_size=2 * max_budget,
                       sink_tokens=SINK, recent_tokens=RECENT, dense_layers=(), sparse_extra_config=extra_cfg)
    cls = {"oracle_page": OracleAlgorithm, "oracle_token": OracleAlgorithm, "quest": QuestAlgorithm,
           "quest_max": QuestAlgorithm, "dsa": DSAAlgorithm, "sink_window": SinkWindow}[name]
    alg = cls(cfg, device)
    alg.initialize_representation_pool(0, 1, 1, t, kv_heads=HKV, head_dim=D, dtype=torch.float32)
    req = torch.zeros(1, dtype=torch.int64, device=device)
    seq = torch.tensor([t], dtype=torch.int32, device=device)
    slots = torch.arange(t, device=device)[None]
    extra: dict[str, Any] = {}
    q = ctx["q"][None]
    rkw: dict[str, Any] = {}
    if name == "dsa":
        proj = ctx.setdefault("_proj", ProjectedIndexerInputs(INDEX_DIM, seed=99))
        extra["index_keys"] = ctx.setdefault("_ik", proj.index_keys(ctx["keys"]))[None]
        q = proj.index_queries(ctx["q"][None], HKV)
        rkw["weights"] = torch.ones(1, HQ, device=device)
    alg.construct_representations(0, req, seq, ctx["keys"], slots, **extra)
    units = -(-t // unit)
    cs = torch.tensor([-(-SINK // unit)], dtype=torch.int32, device=device)
    ce = torch.tensor([units - max(1, -(-RECENT // unit))], dtype=torch.int32, device=device)

    def retrieve(budget: int) -> torch.Tensor:
        k_units = budget // unit
        sel, valid = alg.retrieve_topk(q, 0, req, torch.tensor([True], device=device), seq_lens=seq,
                                       candidate_start=cs, candidate_end=ce, top_k=k_units, **rkw)
        check_selection(sel, valid, k_units, cs, ce)
        return sel[0, : int(valid[0])].long()

    return unit, int(cs), int(ce), retrieve


def evaluate(t: int, budgets: list[int], trials: int, algos: list[str], device: torch.device) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    acc: dict[tuple[str, int], dict[str, list[float]]] = {}
    for trial in range(trials):
        ctx = make_context(t, seed=1000 * t + trial, device=device)
        o_dense, p = dense_attention(ctx["q"], ctx["keys"], ctx["values"])
        for name in algos:
            unit, cs, ce, retrieve = build(name, max(budgets), ctx, t, device)
            mass = unit_mass(p, unit)
            n_units = -(-t // unit)
            needle_units = (ctx["needles"] // unit).tolist()
            for budget in budgets:
                k_units = budget // unit
                sel = retrieve(budget)
                best = torch.topk(mass[cs:ce], min(k_units, ce - cs)).values.sum()
                recall = float(mass[sel].sum() / best)
                tok = torch.zeros(n_units * unit, dtype=torch.bool, device=device)
                keep_units = torch.cat([torch.arange(cs, device=device), sel, torch.arange(ce, n_units, device=device)])
                tok.view(-1, unit)[keep_units] = True
                o_sparse, _ = dense_attention(ctx["q"], ctx["keys"], ctx["values"], tok[:t])
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
    args = ap.parse_args(argv)
    if args.plot_from:
        src = Path(args.plot_from)
        plot(json.loads(src.read_text())["results"], src.with_suffix(".png"))
        return 0
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
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
        "elapsed_s": round(time.time() - t0, 1),
    }
    out_dir = Path(args.out) if args.out else None
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
