"""Fidelity against the oracle: per-unit attention mass, the share of the best top-k mass
a selection captures, and planting needle keys aligned with a query."""
from __future__ import annotations

import math

import torch


def attention_mass(q: torch.Tensor, keys: torch.Tensor, seq_len: int, page_size: int) -> torch.Tensor:
    """Softmax attention probability of each unit (page / token) averaged over heads.

    q ``[Hq, D]``, keys ``[T, Hkv, D]`` (first ``seq_len`` used). Returns
    ``[ceil(seq_len / page_size)] float32`` summing to 1.
    """
    hq, d = q.shape
    hkv = keys.shape[1]
    k = keys[:seq_len].float()
    logits = torch.einsum("hd,thd->ht", q.float(), k[:, torch.arange(hq, device=q.device) // (hq // hkv)]) / math.sqrt(d)
    p = torch.softmax(logits, dim=1).mean(dim=0)
    units = -(-seq_len // page_size)
    padded = torch.zeros(units * page_size, device=p.device)
    padded[:seq_len] = p
    return padded.view(units, page_size).sum(dim=1)


def mass_recall(mass: torch.Tensor, selected: torch.Tensor, start: int, end: int, top_k: int) -> float:
    """Attention mass of ``selected`` units over the best possible mass of ``top_k`` units
    in ``[start, end)`` (the top-k-by-mass oracle). 1.0 when there is nothing to select."""
    cand = mass[start:end]
    best = float(torch.topk(cand, min(top_k, cand.numel())).values.sum()) if cand.numel() else 0.0
    if best <= 0.0:
        return 1.0
    sel = selected[selected >= 0].long()
    return float(mass[sel].sum()) / best


def plant_needles(keys: torch.Tensor, q: torch.Tensor, positions: torch.Tensor, strength: float = 4.0) -> None:
    """Overwrite ``keys[positions]`` (``[T, Hkv, D]``, in place) with keys aligned to the
    query ``q [Hq, D]``: per KV head, ``strength * sqrt(D)`` times the unit mean query of
    its GQA group."""
    hq, d = q.shape
    hkv = keys.shape[1]
    u = q.float().view(hkv, hq // hkv, d).mean(dim=1)
    u = u / u.norm(dim=-1, keepdim=True).clamp_min(1e-6)
    keys[positions.long()] = (strength * math.sqrt(d) * u).to(keys.dtype)
