"""Plain-torch prefill attention used by the runtime (every mode).

It takes the cache rows a query may see; GQA groups are expanded here, MLA passes
``k = kv [S, 1, r + rope]`` and ``v = kv[..., :r]``.
"""
from __future__ import annotations

import torch

from sparsehi.kernels.prefill_attention import prefill_attention


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float,
                     q_offset: int, batch_invariant: bool = False) -> torch.Tensor:
    """Prefill attention of one request (``batch_invariant``: the row-invariant kernel of
    ``sparsehi/kernels/prefill_attention.py`` instead of SDPA).

    q: ``[T, Hq, D]`` the new tokens at positions ``q_offset .. q_offset+T-1``;
    k: ``[S, Hkv, D]``, v: ``[S, Hkv, Dv]`` the whole context (S = q_offset + T).
    Returns ``[T, Hq, Dv]`` in q's dtype (computed in float32 on CPU for determinism).
    """
    T, Hq, _ = q.shape
    S, Hkv, _ = k.shape
    if S != q_offset + T:
        raise ValueError(f"causal_attention: k has {S} rows, expected q_offset + T = {q_offset + T}")
    if batch_invariant:
        return prefill_attention(q, k, v, sm_scale, q_offset)
    group = Hq // Hkv
    cdt = torch.float32 if q.device.type == "cpu" else q.dtype
    qh = q.to(cdt).transpose(0, 1)                                  # [Hq, T, D]
    kh = k.to(cdt).transpose(0, 1).repeat_interleave(group, dim=0)  # [Hq, S, D]
    vh = v.to(cdt).transpose(0, 1).repeat_interleave(group, dim=0)
    if q_offset == 0:  # plain causal: lets SDPA take its fused (flash) path
        o = torch.nn.functional.scaled_dot_product_attention(
            qh[None], kh[None], vh[None], is_causal=True, scale=sm_scale)[0]
    else:
        rows = torch.arange(T, device=q.device)[:, None] + q_offset
        cols = torch.arange(S, device=q.device)[None, :]
        mask = cols <= rows                                         # [T, S]
        o = torch.nn.functional.scaled_dot_product_attention(
            qh[None], kh[None], vh[None], attn_mask=mask[None, None], scale=sm_scale)[0]
    return o.transpose(0, 1).to(q.dtype)

