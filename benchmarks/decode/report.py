"""bench_decode's report: the issue's targets, the scenario-a summary and the throughput
plot."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from benchmarks.decode.modes import AHEAD_MODES, AHEAD_SUFFIX, ALL_MODES, FP8_LATENT_MODES, FP8_MODE, MODES, loads_ahead

LOADING_AHEAD = tuple(m for m in ALL_MODES if loads_ahead(m))


def plot(rows: list[dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    groups = sorted({(r["model"], r["context"]) for r in rows})
    if not groups:
        return
    fig, axes = plt.subplots(1, len(groups), figsize=(4.6 * len(groups), 4), squeeze=False)
    colors = {"dense": "C0", "sparse-gpu": "C1", "sparse-hier": "C2", "offload-full": "C3", FP8_MODE: "C4",
              AHEAD_MODES[0]: "C5", AHEAD_MODES[1]: "C6", FP8_LATENT_MODES[0]: "C7", FP8_LATENT_MODES[1]: "C8",
              FP8_LATENT_MODES[2]: "C9"}
    for ax, (model, ctx) in zip(axes[0], groups):
        for scen, style in (("a", "-"), ("b", "--")):
            for mode in ALL_MODES:
                pts = sorted((r["batch"], r["tokens_per_s"]) for r in rows
                             if r["model"] == model and r["context"] == ctx and r["scenario"] == scen
                             and r["mode"] == mode and r.get("trace_source") == "trace85")
                if pts:
                    ax.plot(*zip(*pts), style, marker="o", ms=3, color=colors[mode], label=f"{mode} ({scen})")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch")
        ax.set_ylabel("decode tokens/s")
        label = f"{ctx // 1024}k" if ctx % 1024 == 0 else str(ctx)
        ax.set_title(f"{model}, {label} context", fontsize=9)
        ax.legend(fontsize=6)
    fig.suptitle("decode throughput vs batch (a: 16 GiB GPU KV budget, solid; b: whole free HBM, dashed)",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------- targets
def targets(rows: list[dict], caps: dict, ctx: int, model: str) -> list[str]:
    sel = [r for r in rows if r["model"] == model and r["context"] == ctx and r["scenario"] == "a"
           and r.get("trace_source") == "trace85"]
    if not sel:
        return [f"no scenario-a rows at {ctx} tokens"]

    def best(mode):
        rs = [r for r in sel if r["mode"] == mode]
        return max(rs, key=lambda r: r["tokens_per_s"]) if rs else None

    out = []
    cap = caps.get((model, ctx, "a"), {})
    bd, bg, bh = best("dense"), best("sparse-gpu"), best("sparse-hier")
    if cap.get("dense") and cap.get("sparse-hier"):
        ratio = cap["sparse-hier"] / cap["dense"]
        out.append(f"batch held: sparse-hier {cap['sparse-hier']} vs dense {cap['dense']} = {ratio:.1f}x "
                   f"(target >= 6x): {'MET' if ratio >= 6 else 'MISSED'}")
    for name, other, goal in (("dense", bd, 3.0), ("sparse-gpu", bg, 1.5)):
        if bh and other:
            r = bh["tokens_per_s"] / other["tokens_per_s"]
            out.append(f"best tokens/s: sparse-hier {bh['tokens_per_s']:.0f} (B={bh['batch']}) vs {name} "
                       f"{other['tokens_per_s']:.0f} (B={other['batch']}) = {r:.2f}x (target >= {goal}x): "
                       f"{'MET' if r >= goal else 'MISSED'}")
    offl = {r["batch"]: r for r in sel if r["mode"] == "offload-full"}
    hier = {r["batch"]: r for r in sel if r["mode"] == "sparse-hier"}
    common = sorted(set(offl) & set(hier))
    if common:
        b = common[-1]
        r = hier[b]["tokens_per_s"] / offl[b]["tokens_per_s"]
        out.append(f"sparse-hier vs offload-full at B={b}: {r:.1f}x (target >= 5x): {'MET' if r >= 5 else 'MISSED'}")
    if bh and bh.get("hit_rate") is not None:
        out.append(f"sparse-hier hit rate at its best batch: {bh['hit_rate']:.3f} (target >= 0.90): "
                   f"{'MET' if bh['hit_rate'] >= 0.9 else 'MISSED'}; measured top-k overlap {bh.get('topk_overlap')}")
    if bh:
        sp = bh["split_ms"]
        bound = max(sp, key=sp.get)
        out.append("sparse-hier split at its best batch (ms/step): " + ", ".join(f"{k} {v:.2f}" for k, v in sp.items())
                   + f"; largest term: {bound}")
    out += _ahead_lines(sel)
    return out


def _ahead_lines(sel: list[dict]) -> list[str]:
    """Per mode that loads ahead: the share of miss bytes loaded ahead at batch 1 and at its
    best batch against the 0.80 target, with the buffer hit rate (target >= 0.90)."""
    out = []
    for mode in LOADING_AHEAD:
        rs = [r for r in sel if r["mode"] == mode and r.get("prefetch_hidden_frac") is not None]
        if not rs:
            continue
        top = max(rs, key=lambda r: r["tokens_per_s"])
        pair = [r for r in rs if r["batch"] == 1][:1] + ([top] if top["batch"] != 1 else [])
        ok = all(r["prefetch_hidden_frac"] >= 0.8 and r["hit_rate"] >= 0.9 for r in pair)
        out.append(f"{mode}: miss bytes loaded ahead " + ", ".join(
            f"{r['prefetch_hidden_frac']:.3f} at B={r['batch']} (hit rate {r['hit_rate']:.3f})" for r in pair)
            + f" (target >= 0.80, hit rate >= 0.90): {'MET' if ok else 'MISSED'}")
    return out


MILLION = 1 << 20


FP8_MODES = (FP8_MODE, FP8_MODE + AHEAD_SUFFIX)
"""The modes with FP8 host KV, with and without loading ahead: the FP8 summary figures are
the best of them."""


def million_row(rows: list[dict], model: str) -> Optional[dict]:
    """The fastest scenario-a batch-1 row at 1,048,576 tokens among ``FP8_MODES`` (trace85
    rows before others), or None."""
    sel = [r for r in rows if r["model"] == model and r["context"] == MILLION and r["scenario"] == "a"
           and r["mode"] in FP8_MODES and r["batch"] == 1]
    sel.sort(key=lambda r: (r.get("trace_source") != "trace85", -r["tokens_per_s"]))
    return sel[0] if sel else None


SECTION_SUMMARY_KEYS = ("fp8_best_tok_s_64k", "fp8_best_mode_64k", "b1_tok_s_1m", "b1_mode_1m",
                        "prefetch_hidden_frac")
"""What a run kept as a section of decode.json (``--section``) lifts into the file's summary."""


def summary_context(contexts: list[int]) -> int:
    """The context the summary describes: 64k when the run has it, else the largest."""
    return 65536 if 65536 in contexts else max(contexts)


def summary(rows: list[dict], caps: dict, ctx: int, model: str, graphs: bool) -> dict[str, Any]:
    """Scenario a at ``ctx`` (the 64k run): best and batch-1 tokens/s per mode, rooflines,
    the largest host time per step, sparse-hier's hit rate at its best batch; and
    ``b1_tok_s_1m``, the batch-1 tokens/s at 1,048,576 tokens with FP8 host KV, and
    ``fp8_best_tok_s_64k``, the best at 65,536 (each the fastest of ``FP8_MODES``, its
    mode in ``b1_mode_1m`` / ``fp8_best_mode_64k``; None without those rows);
    ``prefetch_hidden_frac``: the share of miss bytes loaded ahead (off the critical path),
    the smaller of the batch-1 and best-batch rows of the modes that load ahead (details
    per mode in ``prefetch``; None without such rows); ``by_mode``: batch-1 and best
    tokens/s of every swept mode."""
    sel = [r for r in rows if r["model"] == model and r["context"] == ctx and r["scenario"] == "a"
           and r.get("trace_source") == "trace85"]

    def best(mode):
        rs = [r for r in sel if r["mode"] == mode]
        return max(rs, key=lambda r: r["tokens_per_s"]) if rs else None

    def b1(mode):
        return next((r for r in sel if r["mode"] == mode and r["batch"] == 1), None)

    def get(r, key):
        return None if r is None else r.get(key)

    out: dict[str, Any] = {"context": ctx, "graphs": graphs}
    for mode in ("dense", "sparse-gpu", "sparse-hier"):
        k = mode.replace("-", "_")
        out[f"{k}_best_tok_s"] = get(best(mode), "tokens_per_s")
        out[f"{k}_b1_tok_s"] = get(b1(mode), "tokens_per_s")
    out["sparse_hier_best_batch"] = get(best("sparse-hier"), "batch")
    out["dense_best_batch"] = get(best("dense"), "batch")
    out["dense_b1_frac_roofline"] = get(b1("dense"), "frac_roofline")
    out["sparse_hier_best_frac_roofline"] = get(best("sparse-hier"), "frac_roofline")
    hosts = [r["host_ms_per_step_max"] for r in sel if r.get("host_ms_per_step_max") is not None]
    out["host_ms_per_step_max"] = max(hosts) if hosts else None
    gaps = [r["device_gap_ms_max"] for r in sel if r.get("device_gap_ms_max") is not None]
    out["device_gap_ms_max"] = max(gaps) if gaps else None
    out["hit_rate"] = get(best("sparse-hier"), "hit_rate")
    out["fp8_best_tok_s"] = get(best(FP8_MODE), "tokens_per_s")
    out["fp8_best_batch"] = get(best(FP8_MODE), "batch")
    out["fp8_b1_tok_s"] = get(b1(FP8_MODE), "tokens_per_s")
    m1 = million_row(rows, model)
    out["b1_tok_s_1m"], out["b1_mode_1m"] = get(m1, "tokens_per_s"), get(m1, "mode")
    at_64k = [r for r in rows if r["model"] == model and r["context"] == 65536 and r["scenario"] == "a"
              and r.get("trace_source") == "trace85" and r["mode"] in FP8_MODES]
    top = max(at_64k, key=lambda r: r["tokens_per_s"], default=None)
    out["fp8_best_tok_s_64k"], out["fp8_best_mode_64k"] = get(top, "tokens_per_s"), get(top, "mode")
    prefetch = {}
    for mode in LOADING_AHEAD:
        pair = {"b1": b1(mode), "best": best(mode)}
        if pair["best"] is not None:
            prefetch[mode] = {k: {f: get(r, f) for f in ("batch", "tokens_per_s", "prefetch_hidden_frac",
                                                          "ahead_precision", "hit_rate")}
                              for k, r in pair.items() if r is not None}
    fracs = [v["prefetch_hidden_frac"] for p in prefetch.values() for v in p.values()
             if v.get("prefetch_hidden_frac") is not None]
    out["prefetch_hidden_frac"] = min(fracs) if fracs else None
    out["prefetch"] = prefetch
    cap = caps.get((model, ctx, "a"), {})
    out["batch_held"] = {m: cap.get(m) for m in ALL_MODES if m in MODES or cap.get(m) is not None}
    out["by_mode"] = {m: {"b1_tok_s": get(b1(m), "tokens_per_s"), "best_tok_s": get(best(m), "tokens_per_s"),
                          "best_batch": get(best(m), "batch")}
                      for m in ALL_MODES if best(m) is not None}
    return out
