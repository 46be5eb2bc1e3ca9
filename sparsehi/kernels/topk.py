"""Masked top-k over per-id scores, shared by the built-in algorithms.

This is ``torch.topk`` on scores whose non-candidate ids are set to ``-inf``: the scoring
kernels (Quest, DSA) are the bandwidth-heavy part; a selection over a few thousand ids
per row is cheap in torch and stays CUDA-graph friendly (fixed shapes, no host sync).
"""
from __future__ import annotations

from typing import Optional

import torch


def candidate_mask(
    num_ids: int,
    candidate_start: torch.Tensor,
    candidate_end: torch.Tensor,
    sparse_mask: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``[B, num_ids] bool``: id ``i`` of row ``b`` is selectable.

    candidate_start / candidate_end: ``[B]`` int, the half-open id range ``[start, end)``.
    sparse_mask: ``[B] bool`` or None; rows with False select nothing.
    """
    ids = torch.arange(num_ids, device=candidate_start.device)[None, :]
    mask = (ids >= candidate_start.long()[:, None]) & (ids < candidate_end.long()[:, None])
    if sparse_mask is not None:
        mask &= sparse_mask.to(device=mask.device, dtype=torch.bool)[:, None]
    return mask


def masked_topk(
    scores: torch.Tensor,
    top_k: int,
    candidate_start: torch.Tensor,
    candidate_end: torch.Tensor,
    sparse_mask: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top ``top_k`` ids per row among the candidates.

    scores:          ``[B, N]`` float, score of id ``i`` (ids ``>= N`` do not exist; ``-inf``
                     or NaN: not selectable).
    top_k:           int > 0, ids returned per row at most.
    candidate_start: ``[B]`` int, candidate_end: ``[B]`` int (clipped to ``[0, N]``).
    sparse_mask:     ``[B] bool`` or None; False rows return nothing.

    Returns ``(selected [B, top_k] int32`` ids by descending score, ``-1`` padded,
    ``valid [B] int32)``. Ties break towards the lower id (deterministic).
    """
    if not isinstance(top_k, int) or top_k <= 0:
        raise ValueError(f"top_k={top_k!r} is invalid: an integer > 0 (selection units)")
    if scores.dim() != 2:
        raise ValueError(f"scores must be [B, N], got shape {tuple(scores.shape)}")
    bsz, n = scores.shape
    dev = scores.device
    cs = candidate_start.to(dev).long().clamp(0, n)
    ce = candidate_end.to(dev).long().clamp(0, n)
    # A score of -inf (or NaN) means "not selectable" (e.g. a position the index does not
    # cover yet): such ids are neither selected nor counted in valid.
    s = torch.nan_to_num(scores.float(), nan=float("-inf"), posinf=torch.finfo(torch.float32).max, neginf=float("-inf"))
    mask = candidate_mask(n, cs, ce, sparse_mask) & (s > float("-inf"))
    s = torch.where(mask, s, torch.full_like(s, float("-inf")))
    valid = mask.sum(dim=1).clamp(max=top_k)
    k_eff = min(top_k, n)
    if k_eff > 0:
        # stable sort gives lower-id-first among ties on every device
        _, order = torch.sort(s, dim=1, descending=True, stable=True)
        idx = order[:, :k_eff]
    else:
        idx = torch.empty(bsz, 0, dtype=torch.long, device=dev)
    out = torch.full((bsz, top_k), -1, dtype=torch.int32, device=dev)
    cols = torch.arange(k_eff, device=dev)[None, :]
    out[:, :k_eff] = torch.where(cols < valid[:, None], idx, torch.full_like(idx, -1)).to(torch.int32)
    return out, valid.to(torch.int32)


def selection_kwargs(
    kwargs: dict, batch: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Validate the keyword arguments the coordinator passes to ``retrieve_topk``.

    Returns ``(seq_lens [B] int64, candidate_start [B] int64, candidate_end [B] int64,
    top_k int)`` on ``device``; raises ValueError naming a missing or malformed one.
    """
    out = []
    for name in ("seq_lens", "candidate_start", "candidate_end"):
        t = kwargs.get(name)
        if not isinstance(t, torch.Tensor) or t.shape != (batch,):
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"retrieve_topk needs {name}: a [B={batch}] int tensor, got {got}")
        out.append(t.to(device=device, dtype=torch.long))
    top_k = kwargs.get("top_k")
    if isinstance(top_k, torch.Tensor) and top_k.numel() == 1:
        top_k = int(top_k)
    if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k <= 0:
        raise ValueError(f"retrieve_topk needs top_k: an integer > 0 (selection units), got {top_k!r}")
    return out[0], out[1], out[2], top_k
