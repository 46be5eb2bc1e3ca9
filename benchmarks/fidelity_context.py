"""The synthetic long contexts of the fidelity benchmark and the selections it measures.

A context is Llama-8B-shaped KV (32 query heads, 8 KV heads, dim 128) with "natural-like"
distractor keys and planted needles (``make_context``); ``build`` fills one algorithm's
representations from a context and returns its Top-k retrieval; ``dense_attention``,
``unit_mass`` and ``attended_tokens`` are what the metrics are computed from. See
``benchmarks/bench_fidelity.py`` for the metrics and the setup's description.
"""
from __future__ import annotations

import math
from typing import Any

import torch

from examples.sink_window import SinkWindow
from sparsehi.algorithms.base import check_selection
from sparsehi.algorithms.dsa import DSAAlgorithm
from sparsehi.algorithms.oracle import OracleAlgorithm
from sparsehi.algorithms.quest import QuestAlgorithm
from sparsehi.algorithms.testing import ProjectedIndexerInputs
from sparsehi.config import SparseConfig

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


def attended_tokens(sel: torch.Tensor, cs: int, ce: int, unit: int, t: int) -> torch.Tensor:
    """``[t] bool``: the tokens a sparse step attends, the sink units ``[0, cs)``, the
    selected units ``sel [k] int64`` and the recent units ``[ce, ceil(t / unit))``."""
    n_units = -(-t // unit)
    keep = torch.cat([torch.arange(cs, device=sel.device), sel, torch.arange(ce, n_units, device=sel.device)])
    tok = torch.zeros(n_units * unit, dtype=torch.bool, device=sel.device)
    tok.view(-1, unit)[keep] = True
    return tok[:t]
