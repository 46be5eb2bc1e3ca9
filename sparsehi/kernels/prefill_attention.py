"""Causal prefill attention of one request whose every query row is bitwise the same
whatever other rows are computed with it.

Query ``t`` sits at position ``q_offset + t`` and sees keys ``0 .. q_offset + t``. Each
program takes a block of queries of one head and walks the keys in blocks that start at
key 0, with an online softmax in float32: a query meets the same key blocks in the same
order whether the prefill computes 21 tokens after a reused prefix or the whole prompt
(key blocks past its position are fully masked and leave its running sums exactly as they
were). Library kernels pick split-K and tiles from the shape, so their rows differ in the
last bits between those two prefills.

``q [T, Hq, D]``, ``k [S, Hkv, D]``, ``v [S, Hkv, Dv]`` with ``S = q_offset + T`` and
``Hq % Hkv == 0`` (query head ``h`` reads KV head ``h // (Hq // Hkv)``); MLA passes the
latent entry as ``k`` (``Hkv = 1``) and its first ``Dv`` columns as ``v``. Returns
``[T, Hq, Dv]`` in q's dtype.

Entry points: ``prefill_attention`` (dispatch), ``prefill_attention_triton``,
``prefill_attention_reference``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from hicache.triton_support import cdiv, dispatch, exact_dot_precision



@dataclass(frozen=True)
class PrefillAttentionConfig:
    """Launch shape. Fixed per call site whatever the prompt's length: a different block of
    keys changes a query's reduction order (``benchmarks/bench_prefill_attention.py``
    measures the choices)."""

    block_m: int = 32
    """Queries per program."""
    block_n: int = 32
    """Keys per step of the online softmax."""
    num_warps: int = 4

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n"):
            v = getattr(self, name)
            if v not in (16, 32, 64, 128):
                raise ValueError(f"PrefillAttentionConfig.{name} must be one of 16, 32, 64, 128, got {v!r}")
        if self.num_warps not in (1, 2, 4, 8):
            raise ValueError(f"PrefillAttentionConfig.num_warps must be one of 1, 2, 4, 8, got {self.num_warps!r}")


DEFAULT_CONFIG = PrefillAttentionConfig()


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_offset: int) -> None:
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"q, k, v must be [T, Hq, D], [S, Hkv, D], [S, Hkv, Dv], got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    T, Hq, D = q.shape
    S, Hkv, Dk = k.shape
    if Dk != D or v.shape[0] != S or v.shape[1] != Hkv:
        raise ValueError(f"k must be [S, Hkv, {D}] and v [S, Hkv, Dv], got k={tuple(k.shape)}, v={tuple(v.shape)}")
    if Hkv == 0 or Hq % Hkv:
        raise ValueError(f"query heads ({Hq}) must be a multiple of KV heads ({Hkv})")
    if not isinstance(q_offset, int) or q_offset < 0 or S != q_offset + T:
        raise ValueError(f"q_offset must be an int with q_offset + T == S, got q_offset={q_offset!r}, T={T}, S={S}")


def prefill_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float,
                                q_offset: int) -> torch.Tensor:
    """The torch form (float32 softmax over the visible keys); equal to the kernel up to rounding."""
    _check(q, k, v, q_offset)
    T, Hq, _ = q.shape
    S, Hkv, _ = k.shape
    group = Hq // Hkv
    qh = q.float().transpose(0, 1)                                  # [Hq, T, D]
    kh = k.float().transpose(0, 1).repeat_interleave(group, dim=0)  # [Hq, S, D]
    vh = v.float().transpose(0, 1).repeat_interleave(group, dim=0)
    s = torch.bmm(qh, kh.transpose(1, 2)) * sm_scale
    rows = torch.arange(T, device=q.device)[:, None] + q_offset
    cols = torch.arange(S, device=q.device)[None, :]
    s = s.masked_fill(cols > rows, float("-inf"))
    o = torch.bmm(torch.softmax(s, dim=-1), vh)
    return o.transpose(0, 1).to(q.dtype)


@triton.jit
def _prefill_attention_kernel(q_ptr, k_ptr, v_ptr, o_ptr, T, q_offset, D, DV, GROUP, sm_scale,
                              sqt, sqh, skt, skh, svt, svh, sot, soh,
                              BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr,
                              PRECISION: tl.constexpr):
    pid_m = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    hk = h // GROUP
    rows = pid_m.to(tl.int64) * BM + tl.arange(0, BM)
    row_ok = rows < T
    d = tl.arange(0, BD)
    dv = tl.arange(0, BDV)
    q = tl.load(q_ptr + rows[:, None] * sqt + h * sqh + d[None, :],
                mask=row_ok[:, None] & (d[None, :] < D), other=0.0).to(tl.float32)
    pos = rows + q_offset  # each query's position; it sees keys <= pos
    m_i = tl.full((BM,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BM,), dtype=tl.float32)
    acc = tl.zeros((BM, BDV), dtype=tl.float32)
    last = tl.minimum(q_offset + (pid_m.to(tl.int64) + 1) * BM, q_offset + T)  # keys this block needs
    for n0 in range(0, last, BN):
        cols = n0 + tl.arange(0, BN).to(tl.int64)
        col_ok = cols < last
        kt = tl.load(k_ptr + cols[None, :] * skt + hk * skh + d[:, None],
                     mask=col_ok[None, :] & (d[:, None] < D), other=0.0).to(tl.float32)
        s = tl.dot(q, kt, input_precision=PRECISION) * sm_scale
        seen = (cols[None, :] <= pos[:, None]) & col_ok[None, :] & row_ok[:, None]
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # rows that have seen nothing yet keep m = -inf; exp(-inf - -inf) would be nan
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        vt = tl.load(v_ptr + cols[:, None] * svt + hk * svh + dv[None, :],
                     mask=col_ok[:, None] & (dv[None, :] < DV), other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, vt, input_precision=PRECISION)
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(o_ptr + rows[:, None] * sot + h * soh + dv[None, :], out.to(o_ptr.dtype.element_ty),
             mask=row_ok[:, None] & (dv[None, :] < DV))


def prefill_attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float,
                             q_offset: int, config: Optional[PrefillAttentionConfig] = None) -> torch.Tensor:
    """Triton launcher: one program per block of ``config.block_m`` queries and query head."""
    cfg = config or DEFAULT_CONFIG
    _check(q, k, v, q_offset)
    T, Hq, D = q.shape
    Hkv, Dv = k.shape[1], v.shape[2]
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(2) != 1:
            raise ValueError(f"{name} must have a contiguous last dim, got strides {t.stride()}")
    o = torch.empty((T, Hq, Dv), dtype=q.dtype, device=q.device)
    if T:
        _prefill_attention_kernel[(cdiv(T, cfg.block_m), Hq)](
            q, k, v, o, T, q_offset, D, Dv, Hq // Hkv, float(sm_scale), q.stride(0), q.stride(1), k.stride(0),
            k.stride(1), v.stride(0), v.stride(1), o.stride(0), o.stride(1), BM=cfg.block_m, BN=cfg.block_n,
            BD=max(16, triton.next_power_of_2(D)), BDV=max(16, triton.next_power_of_2(Dv)),
            PRECISION=exact_dot_precision(q.dtype), num_warps=cfg.num_warps)
    return o


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float,
                      q_offset: int) -> torch.Tensor:
    """See the module docstring; row-invariant on the Triton path."""
    return dispatch("prefill_attention", q, prefill_attention_triton, prefill_attention_reference)(
        q, k, v, sm_scale, q_offset)
