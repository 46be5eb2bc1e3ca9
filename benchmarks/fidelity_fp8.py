"""Quest's fidelity with FP8 host KV beside the model's dtype, on the synthetic contexts of
``benchmarks/fidelity_context.py``.

What is rounded. With ``host_kv_dtype="fp8_e4m3"`` every complete page of a sparse-hier
request becomes an FP8 host page, and its GPU copies (sink pages, recent ring) are rounded
to the stored values; only the page still being filled stays in the model's dtype
(docs/fp8_host_kv.md). Here the context's KV is taken in bf16 (the model's KV dtype) and
its complete pages (keys and values, every head) go through ``fp8_round_trip``, the
quantiser of the FP8 page format (one power-of-two scale per page, buffer and head); a
partial last page is left in bf16. Every attention of an ``fp8_e4m3`` row reads these
values: sink, selection and recent window alike.

Where Quest's bounds come from. The runtime builds a prompt's page bounds at its prefill
(``attention_end`` reads the device key cache) before ``finish_prefill`` rounds the pages,
and folds each decoded key in before its page is complete: the bounds of a prompt
prefilled in the request are those of its bf16 keys, so its selection is the bf16
selection (``quest_bounds_from="bf16_keys"``). A prefix reused from the host tier or L3
comes back rounded, so its bounds are built from the FP8 keys (``"fp8_keys"``). Both are
measured; the first one's selection is the bf16 row's by construction, its mass recall
the same, its output error the rounding's.

Metrics (mean and min over the contexts of a length):

- ``mass_recall``: head-averaged mass of the *bf16* attention on the selected pages over
  the mass of the best top-k candidate pages by that attention: the bf16 rows' measure, so
  ``mass_recall_drop`` (bf16 row minus this row) is what the selection loses (negative:
  the FP8 bounds happened to pick pages of more bf16 mass).
- ``mass_recall_of_fp8_attention``: the same measure taken on the attention over the
  rounded KV (what the FP8 run attends).
- ``needle_recall``: planted needles whose page was selected.
- ``output_rel_error``: sparse attention output vs dense attention over bf16 KV.
- ``output_rel_error_vs_bf16_same_selection``: vs sparse attention over bf16 KV with the
  same selection (the rounding's error alone).
- ``selection_overlap_with_bf16``: share of the bf16 selection's pages also selected.

Per context (``kv_rounding``): relative error of the rounded keys and values, and of dense
attention over them vs dense attention over bf16 KV.
"""
from __future__ import annotations

from typing import Any

import torch

from benchmarks.fidelity_context import PAGE, attended_tokens, build, dense_attention, make_context, unit_mass
from hicache.kv_page_format import fp8_round_trip

MODEL_KV_DTYPE = torch.bfloat16
MASS_RECALL_DROP_LIMIT = 0.005
"""A larger drop of Quest's mass recall with FP8 host KV is a finding to explain."""
_VARIANTS = (("bf16", "bf16_keys"), ("fp8_e4m3", "bf16_keys"), ("fp8_e4m3", "fp8_keys"))


def round_complete_pages(kv: torch.Tensor, page: int) -> torch.Tensor:
    """``kv [2, t, Hkv, D]`` (keys, values; the model's dtype) -> a copy whose complete pages
    hold what FP8 host pages store (``fp8_round_trip`` over ``[pages, (k, v), page, Hkv,
    D]``); the tokens of a partial last page are left as they are."""
    n = kv.shape[1] // page * page
    pages = kv[:, :n].unflatten(1, (-1, page)).transpose(0, 1).contiguous()  # [P, 2, page, Hkv, D]
    out = kv.clone()
    out[:, :n] = fp8_round_trip(pages).transpose(0, 1).flatten(1, 2)
    return out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """``||a - b|| / ||b||``."""
    return float((a - b).norm() / b.norm())


def _mass_recall(mass: torch.Tensor, sel: torch.Tensor, cs: int, ce: int, k_units: int) -> float:
    best = torch.topk(mass[cs:ce], min(k_units, ce - cs)).values.sum()
    return float(mass[sel].sum() / best)


def _trial(t: int, seed: int, budgets: list[int], device: torch.device
           ) -> tuple[dict[tuple[str, str, int], dict[str, float]], dict[str, float]]:
    """One context: metrics per (kv, bounds, budget), and the context's rounding errors."""
    ctx = make_context(t, seed=seed, device=device)
    kv16 = torch.stack([ctx["keys"], ctx["values"]]).to(MODEL_KV_DTYPE)
    kv = {"bf16": kv16.float(), "fp8_e4m3": round_complete_pages(kv16, PAGE).float()}
    q = ctx["q"]
    o_dense16, p16 = dense_attention(q, *kv["bf16"])
    o_dense8, p8 = dense_attention(q, *kv["fp8_e4m3"])
    mass = {"bf16": unit_mass(p16, PAGE), "fp8_e4m3": unit_mass(p8, PAGE)}
    retrieve = {}
    for bounds, src in (("bf16_keys", "bf16"), ("fp8_keys", "fp8_e4m3")):
        _, cs, ce, retrieve[bounds] = build("quest", max(budgets), {**ctx, "keys": kv[src][0]}, t, device)
    needle_pages = (ctx["needles"] // PAGE).tolist()
    out: dict[tuple[str, str, int], dict[str, float]] = {}
    for budget in budgets:
        k_units = budget // PAGE
        sel = {b: r(budget) for b, r in retrieve.items()}
        for kv_name, bounds in _VARIANTS:
            s = sel[bounds]
            mask = attended_tokens(s, cs, ce, PAGE, t)
            o_sparse, _ = dense_attention(q, *kv[kv_name], mask)
            o_same16, _ = dense_attention(q, *kv["bf16"], mask)
            chosen = set(s.tolist())
            out[(kv_name, bounds, budget)] = {
                "mass_recall": _mass_recall(mass["bf16"], s, cs, ce, k_units),
                "mass_recall_of_fp8_attention": _mass_recall(mass["fp8_e4m3"], s, cs, ce, k_units),
                "needle_recall": sum(u in chosen for u in needle_pages) / len(needle_pages),
                "output_rel_error": _rel(o_sparse, o_dense16),
                "output_rel_error_vs_bf16_same_selection": _rel(o_sparse, o_same16),
                "selection_overlap_with_bf16": float(torch.isin(sel["bf16_keys"], s).float().mean()),
            }
    rounding = {"key_rel_error": _rel(kv["fp8_e4m3"][0], kv["bf16"][0]),
                "value_rel_error": _rel(kv["fp8_e4m3"][1], kv["bf16"][1]),
                "dense_output_rel_error": _rel(o_dense8, o_dense16)}
    return out, rounding


def _mean(v: list[float]) -> float:
    return sum(v) / len(v)


def fp8_rows(contexts: list[int], budgets: list[int], trials: int, device: torch.device
             ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Quest over bf16 and FP8-rounded KV: (result rows, per-context ``kv_rounding``
    rows). Trial ``i`` of length ``t`` is the main section's context (seed ``1000 t + i``)."""
    rows: list[dict[str, Any]] = []
    rounding_rows: list[dict[str, Any]] = []
    for t in contexts:
        acc: dict[tuple[str, str, int], dict[str, list[float]]] = {}
        rounding: dict[str, list[float]] = {}
        for trial in range(trials):
            got, rnd = _trial(t, 1000 * t + trial, budgets, device)
            for key, metrics in got.items():
                for name, v in metrics.items():
                    acc.setdefault(key, {}).setdefault(name, []).append(v)
            for name, v in rnd.items():
                rounding.setdefault(name, []).append(v)
        rounding_rows.append({"context": t, "rounded_pages": t // PAGE, "tokens_left_in_bf16": t % PAGE,
                              **{k: round(_mean(v), 6) for k, v in rounding.items()},
                              "key_rel_error_max": round(max(rounding["key_rel_error"]), 6), "trials": trials})
        for budget in budgets:
            ref = acc[("bf16", "bf16_keys", budget)]["mass_recall"]
            for kv_name, bounds in _VARIANTS:
                d = acc[(kv_name, bounds, budget)]
                row: dict[str, Any] = {"context": t, "budget_tokens": budget, "algorithm": "quest", "kv": kv_name,
                                       "quest_bounds_from": bounds, **{k: round(_mean(v), 6) for k, v in d.items()},
                                       "mass_recall_min": round(min(d["mass_recall"]), 6),
                                       "needle_recall_min": round(min(d["needle_recall"]), 6), "trials": trials}
                if kv_name != "bf16":
                    drops = [a - b for a, b in zip(ref, d["mass_recall"])]
                    row["mass_recall_drop"] = round(_mean(drops), 6)
                    row["mass_recall_drop_max"] = round(max(drops), 6)
                rows.append(row)
    return rows, rounding_rows


def fp8_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The largest mass-recall drop of each bounds variant (mean over contexts, and the
    worst single context), and whether any exceeds ``MASS_RECALL_DROP_LIMIT``."""
    out: dict[str, Any] = {"mass_recall_drop_limit": MASS_RECALL_DROP_LIMIT}
    for bounds in ("bf16_keys", "fp8_keys"):
        fp8 = [r for r in rows if r["kv"] == "fp8_e4m3" and r["quest_bounds_from"] == bounds]
        worst = max(fp8, key=lambda r: r["mass_recall_drop"])
        out[f"bounds_{bounds}"] = {
            "max_mass_recall_drop": worst["mass_recall_drop"], "at": [worst["context"], worst["budget_tokens"]],
            "max_mass_recall_drop_one_context": max(r["mass_recall_drop_max"] for r in fp8),
            "min_needle_recall": min(r["needle_recall_min"] for r in fp8),
            "max_output_rel_error_vs_bf16_same_selection": max(r["output_rel_error_vs_bf16_same_selection"] for r in fp8),
        }
    out["drop_over_limit"] = any(out[f"bounds_{b}"]["max_mass_recall_drop"] > MASS_RECALL_DROP_LIMIT
                                 for b in ("bf16_keys", "fp8_keys"))
    return out
