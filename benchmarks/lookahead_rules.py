"""How much of a decode step's misses a load-ahead rule could have loaded during the step
before, on bench_decode's calibrated query trace (CPU, one Quest layer).

A rule named here picks, after a step's selection, pages to copy into the layer's LRU
buffer for the next step; a miss of the next step that such a copy already brought in is a
*hidden* miss (its bytes left the critical path), and every page copied that way costs host
bytes whether it is used or not. Rule measured:

- ``runners_up(m)``: the pages ranked ``K+1 .. K+m`` by this step's Quest score that are not
  resident (the pages closest to entering the Top-k), in two LRU orders:
  ``behind``: a page copied ahead ranks just behind this step's selection, and runners-up
  already resident keep their place; ``with_selection`` (what ``SparseConfig.lookahead_tokens``
  builds: one LRU diff of the Top-(K+m) with the step's stamp): every runner-up, copied or
  resident, ranks with the selection, so the buffer keeps the Top-(K+m) of recent steps.

The layer is the Llama-8B shape (32 query heads over 8 KV heads, dim 128), Quest bounds of
random keys at page 16, top-k ``K`` pages, an LRU buffer of ``2K`` slots, and queries that
follow the benchmark's AR(1) trace (``sparsehi.runtime.traces``) with rho calibrated to the
85 % adjacent-step Top-k overlap, as bench_decode calibrates it.

    PYTHONPATH=. python benchmarks/lookahead_rules.py              # 64k, ~1 min on one core
    PYTHONPATH=. python benchmarks/lookahead_rules.py --quick
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import write_result  # noqa: E402
from sparsehi.kernels.quest_score import quest_score_reference  # noqa: E402
from sparsehi.runtime.traces import calibrate_rho  # noqa: E402


def quest_bounds(pages: int, page_size: int, kv_heads: int, dim: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """``(kmin, kmax)`` ``[1, pages, kv_heads, dim]`` of random normal keys, page by page."""
    kmin = torch.empty(1, pages, kv_heads, dim)
    kmax = torch.empty_like(kmin)
    for lo in range(0, pages, 512):
        hi = min(pages, lo + 512)
        k = torch.randn(hi - lo, page_size, kv_heads, dim, generator=gen)
        kmin[0, lo:hi], kmax[0, lo:hi] = k.amin(1), k.amax(1)
    return kmin, kmax


class Trace:
    """The AR(1) query trace of ``sparsehi.runtime.traces.QueryTrace`` for one layer and row."""

    def __init__(self, rho: float, shape: tuple[int, ...], seed: int) -> None:
        self.rho, self.gen = rho, torch.Generator().manual_seed(seed)
        self.u = torch.randn(shape, generator=self.gen)

    def next(self) -> torch.Tensor:
        self.u = self.rho * self.u + math.sqrt(1 - self.rho ** 2) * torch.randn(self.u.shape, generator=self.gen)
        return self.u


def ranked(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor) -> torch.Tensor:
    """Page ids by Quest score, best first ``[P] int64``."""
    lengths = torch.tensor([kmin.shape[1]])
    s = quest_score_reference(q[None], kmin, kmax, torch.tensor([0]), lengths)[0]
    return torch.argsort(s, descending=True, stable=True)


def overlap_at(rho: float, kmin, kmax, q_shape, top_k: int, steps: int = 12) -> float:
    tr = Trace(rho, q_shape, seed=3)
    prev, got = None, []
    for _ in range(steps):
        cur = set(ranked(tr.next(), kmin, kmax)[:top_k].tolist())
        if prev is not None:
            got.append(len(cur & prev) / top_k)
        prev = cur
    return sum(got) / len(got)


def run_rule(m: int, rho: float, kmin, kmax, q_shape, top_k: int, slots: int, steps: int, warmup: int,
             order_rule: str = "behind") -> dict:
    """Misses per step, the share of them a ``runners_up(m)`` copy had brought in, and the
    pages it copied per step (``order_rule``: ``behind`` or ``with_selection``, above)."""
    tr = Trace(rho, q_shape, seed=5)
    last_used: dict[int, float] = {}  # resident page -> step of its last use (prefetched: step - 0.5)
    ahead: set[int] = set()  # resident because a load-ahead copied it, not used since
    misses = hidden = copied = 0
    for t in range(warmup + steps):
        order = ranked(tr.next(), kmin, kmax)
        sel = order[:top_k].tolist()
        timed = t >= warmup
        for p in sel:
            if p not in last_used:
                misses += timed
            elif p in ahead:
                hidden += timed
            ahead.discard(p)
            last_used[p] = t
        runners = order[top_k:top_k + m].tolist()
        extra = [p for p in runners if p not in last_used]
        copied += len(extra) * timed
        for p in extra:
            last_used[p] = t - 0.5 if order_rule == "behind" else t
            ahead.add(p)
        if order_rule == "with_selection":
            for p in runners:
                last_used[p] = t
        while len(last_used) > slots:  # evict the least recently used (lower page id first on a tie)
            victim = min(last_used, key=lambda p: (last_used[p], p))
            del last_used[victim]
            ahead.discard(victim)
    would_miss = misses + hidden
    return {"m": m, "order_rule": order_rule, "misses_per_step": misses / steps, "hidden_per_step": hidden / steps,
            "hidden_frac": hidden / would_miss if would_miss else 0.0, "copied_ahead_per_step": copied / steps,
            "hit_rate": 1.0 - misses / (steps * top_k),
            "host_pages_per_step_over_no_rule": None}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="4k context, few steps")
    ap.add_argument("--context", type=int, default=65536)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--out", type=Path, default=None, help="JSON result file")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    ctx, steps, warmup = (4096, 30, 10) if a.quick else (a.context, a.steps, 40)
    ps, hq, hkv, d, top_k = 16, 32, 8, 128, (16 if a.quick else 128)
    slots = 2 * top_k
    kmin, kmax = quest_bounds(ctx // ps, ps, hkv, d, torch.Generator().manual_seed(1))
    q_shape = (hq, d)
    rho, ov = calibrate_rho(lambda r: overlap_at(r, kmin, kmax, q_shape, top_k), 0.85, iters=6 if a.quick else 9)
    ms = (0, 4, 8, 16) if a.quick else (0, 16, 32, 64, 128)
    rows = [run_rule(m, rho, kmin, kmax, q_shape, top_k, slots, steps, warmup, rule)
            for rule in ("behind", "with_selection") for m in ms if m or rule == "behind"]
    base = rows[0]["misses_per_step"] or 1.0
    for r in rows:
        r["host_pages_per_step_over_no_rule"] = (r["misses_per_step"] + r["copied_ahead_per_step"]) / base
        print(f"{r['order_rule']:>14} runners_up({r['m']:3d}): misses/step {r['misses_per_step']:6.2f}  hidden {r['hidden_frac']:.3f}  "
              f"copied ahead/step {r['copied_ahead_per_step']:6.2f}  host pages x{r['host_pages_per_step_over_no_rule']:.2f}"
              f"  hit rate {r['hit_rate']:.3f}")
    result = {"context": ctx, "page_size": ps, "top_k_pages": top_k,
              "lru_slots": slots, "query_heads": hq, "kv_heads": hkv, "head_dim": d, "trace_rho": rho,
              "measured_overlap": ov, "steps": steps, "warmup_steps": warmup, "rule": "runners_up(m)",
              "order_rules": {"behind": "a page copied ahead ranks behind the step's selection; resident runners-up "
                                        "keep their place",
                              "with_selection": "every runner-up ranks with the step's selection (what "
                                                "SparseConfig.lookahead_tokens builds)"},
              "rows": rows}
    if a.out is not None:
        write_result(a.out.name, result, a.out.parent)  # device and date added
    return 0


if __name__ == "__main__":
    sys.exit(main())
