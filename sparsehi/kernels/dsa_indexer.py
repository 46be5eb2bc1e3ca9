"""DSA lightning indexer scores (DeepSeek-V3.2): for each cached token ``t`` of a request,
``score_t = scale_t · Σ_h w_h · ReLU(q_h · k̂_t)`` with one index key per token (shared by
all index heads), index queries ``q [H, Di]`` and per-head weights ``w [H]``.

Index keys are stored FP8 e4m3 with a per-token scale (``k_t ≈ scale_t · k̂_t``), or bf16 /
fp32 with no scale. Because ``scale_t > 0``, ``ReLU(q · scale_t k̂_t) = scale_t ReLU(q · k̂_t)``,
so the scale is applied once per token after the head reduction.

Entry points: ``dsa_indexer`` (dispatch), ``dsa_indexer_triton``, ``dsa_indexer_reference``;
``quantize_index_keys`` (FP8 + scale).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from hicache.triton_support import announce_path, use_triton

FP8_E4M3_MAX = 448.0


def fp8_dtype() -> Optional[torch.dtype]:
    """``torch.float8_e4m3fn`` when this torch has it, else None."""
    return getattr(torch, "float8_e4m3fn", None)


def quantize_index_keys(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token FP8 e4m3 quantisation.

    keys: ``[..., Di]`` float. Returns ``(k̂ [..., Di] float8_e4m3fn, scale [...] float32)``
    with ``keys ≈ scale[..., None] * k̂``; an all-zero key gets scale 1.
    """
    f8 = fp8_dtype()
    if f8 is None:
        raise ValueError("index_dtype='fp8' needs a torch build with float8_e4m3fn")
    k = keys.float()
    amax = k.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / FP8_E4M3_MAX, torch.ones_like(amax))
    return (k / scale[..., None]).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(f8), scale


def _check(q: torch.Tensor, weights: torch.Tensor, index_keys: torch.Tensor, key_scales: Optional[torch.Tensor],
           req_pool_indices: torch.Tensor, num_tokens: torch.Tensor) -> None:
    if q.dim() != 3:
        raise ValueError(f"q must be [B, H_index, index_head_dim], got {tuple(q.shape)}")
    b, h, d = q.shape
    if weights.shape != (b, h):
        raise ValueError(f"weights must be [B={b}, H_index={h}], got {tuple(weights.shape)}")
    if index_keys.dim() != 3 or index_keys.shape[2] != d:
        raise ValueError(f"index_keys must be [R, T, index_head_dim={d}], got {tuple(index_keys.shape)}")
    if key_scales is not None and key_scales.shape != index_keys.shape[:2]:
        raise ValueError(f"key_scales must be [R, T]={tuple(index_keys.shape[:2])}, got {tuple(key_scales.shape)}")
    if req_pool_indices.shape != (b,) or num_tokens.shape != (b,):
        raise ValueError(f"req_pool_indices and num_tokens must be [B={b}], got {tuple(req_pool_indices.shape)}, {tuple(num_tokens.shape)}")


def dsa_indexer_reference(
    q: torch.Tensor,
    weights: torch.Tensor,
    index_keys: torch.Tensor,
    key_scales: Optional[torch.Tensor],
    req_pool_indices: torch.Tensor,
    num_tokens: torch.Tensor,
) -> torch.Tensor:
    """Torch reference.

    q:                ``[B, H, Di]`` float index queries.
    weights:          ``[B, H]`` float per-head weights.
    index_keys:       ``[R, T, Di]`` fp8 e4m3 / bf16 / fp32 index keys per (request slot, position).
    key_scales:       ``[R, T] float32`` per-token scale (FP8) or None.
    req_pool_indices: ``[B]`` int row of index_keys per batch row (``-1``: none).
    num_tokens:       ``[B]`` int tokens indexed; positions ``>= num_tokens`` score ``-inf``.
    Returns ``[B, T] float32``.
    """
    _check(q, weights, index_keys, key_scales, req_pool_indices, num_tokens)
    t = index_keys.shape[1]
    req = req_pool_indices.long().clamp(min=0)
    k = index_keys[req].float()  # [B, T, Di]
    logits = torch.einsum("bhd,btd->bht", q.float(), k)
    s = (torch.relu(logits) * weights.float()[:, :, None]).sum(dim=1)
    if key_scales is not None:
        s = s * key_scales[req].float()
    pos = torch.arange(t, device=q.device)[None, :]
    live = (pos < num_tokens.to(q.device).long()[:, None]) & (req_pool_indices.to(q.device)[:, None] >= 0)
    return torch.where(live, s, torch.full_like(s, float("-inf")))


@triton.jit
def _dsa_indexer_kernel(
    q_ptr, w_ptr, k_ptr, scale_ptr, req_ptr, ntok_ptr, out_ptr,
    T, H, D,
    stride_qb, stride_qh, stride_wb,
    stride_kr, stride_kt, stride_sr,
    stride_ob,
    HAS_SCALE: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0)
    tblk = tl.program_id(1)
    offs_t = tblk * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    req = tl.load(req_ptr + b).to(tl.int64)
    n = tl.load(ntok_ptr + b)
    n = tl.where(req >= 0, n, 0)
    req = tl.maximum(req, 0)
    live_t = offs_t < n
    h_mask = offs_h < H
    d_mask = offs_d < D
    # Tokens past the row's end are masked out of the key load: a fixed [B, T] grid reads
    # only the live index keys.
    k = tl.load(k_ptr + req * stride_kr + offs_t[:, None].to(tl.int64) * stride_kt + offs_d[None, :],
                mask=live_t[:, None] & d_mask[None, :], other=0.0).to(tl.float32)
    q = tl.load(q_ptr + b * stride_qb + offs_h[:, None] * stride_qh + offs_d[None, :],
                mask=h_mask[:, None] & d_mask[None, :], other=0.0).to(tl.float32)
    w = tl.load(w_ptr + b * stride_wb + offs_h, mask=h_mask, other=0.0).to(tl.float32)
    # padded heads have q = 0 and w = 0, so they add ReLU(0) * 0 = 0
    logits = tl.dot(k, tl.trans(q), input_precision="ieee")  # [BLOCK_T, BLOCK_H]
    s = tl.sum(tl.maximum(logits, 0.0) * w[None, :], axis=1)
    if HAS_SCALE:
        sc = tl.load(scale_ptr + req * stride_sr + offs_t, mask=live_t, other=1.0)
        s = s * sc
    s = tl.where(live_t, s, float("-inf"))
    tl.store(out_ptr + b * stride_ob + offs_t, s, mask=offs_t < T)


def dsa_indexer_triton(
    q: torch.Tensor,
    weights: torch.Tensor,
    index_keys: torch.Tensor,
    key_scales: Optional[torch.Tensor],
    req_pool_indices: torch.Tensor,
    num_tokens: torch.Tensor,
    block_t: int = 64,
) -> torch.Tensor:
    """Triton launcher; same arguments and result as :func:`dsa_indexer_reference`."""
    _check(q, weights, index_keys, key_scales, req_pool_indices, num_tokens)
    b, h, d = q.shape
    r, t, _ = index_keys.shape
    if index_keys.stride(2) != 1:
        raise ValueError("index_keys must have a contiguous last dim")
    q = q.float().contiguous()
    w = weights.float().contiguous()
    req = req_pool_indices.to(device=q.device, dtype=torch.int64).contiguous()
    ntok = num_tokens.to(device=q.device, dtype=torch.int32).contiguous()
    out = torch.empty(b, t, dtype=torch.float32, device=q.device)
    if b == 0 or t == 0:
        return out
    scales = key_scales.float().contiguous() if key_scales is not None else out  # dummy pointer when unused
    grid = (b, triton.cdiv(t, block_t))
    _dsa_indexer_kernel[grid](
        q, w, index_keys, scales, req, ntok, out,
        t, h, d,
        q.stride(0), q.stride(1), w.stride(0),
        index_keys.stride(0), index_keys.stride(1), scales.stride(0),
        out.stride(0),
        HAS_SCALE=key_scales is not None,
        BLOCK_T=block_t, BLOCK_H=max(16, triton.next_power_of_2(h)), BLOCK_D=max(16, triton.next_power_of_2(d)),
    )
    return out


def dsa_indexer(
    q: torch.Tensor,
    weights: torch.Tensor,
    index_keys: torch.Tensor,
    key_scales: Optional[torch.Tensor],
    req_pool_indices: torch.Tensor,
    num_tokens: torch.Tensor,
) -> torch.Tensor:
    """Indexer scores ``[B, T] float32`` (Triton on CUDA, reference on CPU)."""
    if use_triton(q):
        announce_path("dsa_indexer", "triton")
        return dsa_indexer_triton(q, weights, index_keys, key_scales, req_pool_indices, num_tokens)
    announce_path("dsa_indexer", "reference")
    return dsa_indexer_reference(q, weights, index_keys, key_scales, req_pool_indices, num_tokens)
