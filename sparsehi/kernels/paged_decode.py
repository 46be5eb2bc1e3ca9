"""GQA decode attention over a paged KV pool (one query token per request).

The KV of one layer lives in the device pool as flat slot buffers ``k_buffer`` /
``v_buffer`` ``[num_slots, Hkv, D]``; page ``p`` covers slots ``[p*page_size,
(p+1)*page_size)``. A request's attended sequence is the concatenation of the pages its
page-table row names, in order, cut to ``cache_seqlens[b]`` tokens (only the last page may
be partial) — exactly the paged-KV contract of ``flash_attn_with_kvcache``.

Kernel shape (Triton): one program per (request, kv head, split). All ``Hq / Hkv`` query
heads of the kv group are processed together so every K/V row is read from HBM once and
used by a ``tl.dot`` over the group. Long sequences are cut into ``num_splits`` ranges
(split-K) whose partial outputs are merged with their log-sum-exp in a second launch; the
split count is picked from the grid size versus the SM count, from shapes only, so no
host synchronisation happens and the launch can be captured in a CUDA graph.

Entry points: ``paged_decode`` (dispatch), ``paged_decode_triton``,
``paged_decode_reference``; the ``flash_attn_with_kvcache`` contract itself:
``flash_attn_with_kvcache_triton`` / ``flash_attn_with_kvcache_reference``.
The shared launcher ``decode_over_table`` also serves the ragged (``kv_indptr`` /
``kv_indices``) form, see ``ragged_decode.py``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from hicache.triton_support import INT32_MAX, cdiv, dispatch, sm_count
from sparsehi.kernels.flash_decoding import (FLOAT_DTYPES, INTERPRETER_SMS, MAX_SPLITS, dot_in_fp32, fail,
                                             merge_splits, split_buffers, split_tokens, store_split_result)


# ----------------------------------------------------------------------------- config
@dataclass(frozen=True)
class DecodeLaunchConfig:
    """Block sizes of the decode kernel; ``num_splits`` None = heuristic."""

    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2
    num_splits: Optional[int] = None


SMALL_READ_BYTES = 40 << 20
"""A step reading at most this much KV is bound by latency, not bandwidth (see
``choose_num_splits``)."""


def choose_num_splits(work_items: int, max_tokens: int, block_n: int, num_sms: int,
                      min_tokens_per_split: int = 256, waves: int = 2, kv_bytes: Optional[int] = None) -> int:
    """Split-K count from static shapes: enough programs to fill ``waves`` x SMs, but no
    split shorter than ``min_tokens_per_split`` tokens (then the merge and the q load
    would cost more than the split saves).

    ``kv_bytes`` (the K and V bytes the call may read, from static shapes): at most
    ``SMALL_READ_BYTES`` the call is latency-bound (a sparse selection, a short context,
    a small model), and splits down to one tile each filling 4 waves (measured faster:
    docs/kernels.md); larger reads stream at close to the HBM bandwidth with the default,
    where more splits only add partial results to merge."""
    if max_tokens <= 0:
        return 1
    if kv_bytes is not None and kv_bytes <= SMALL_READ_BYTES:
        min_tokens_per_split, waves = block_n, 4
    want = cdiv(waves * num_sms, max(1, work_items))
    cap = max(1, cdiv(max_tokens, max(block_n, min_tokens_per_split)))
    return int(max(1, min(want, cap, MAX_SPLITS)))


def default_config(device: torch.device, head_dim: int) -> DecodeLaunchConfig:
    """Block sizes by head dim: 64-token tiles, 4 warps, 2 stages (the H200 sweep's best:
    docs/kernels.md); head dims above 128 halve the tile to stay in shared memory."""
    if device.type != "cuda":
        return DecodeLaunchConfig(block_n=16, num_warps=4, num_stages=1)
    if head_dim > 128:
        return DecodeLaunchConfig(block_n=32, num_warps=4, num_stages=2)
    return DecodeLaunchConfig(block_n=64, num_warps=4, num_stages=2)


# ----------------------------------------------------------------------------- kernels
@triton.jit
def _decode_stage1(
    Q, K, V, Table, RowStart, SeqLens, Out, OutPartial, LsePartial,
    qk_scale_log2,
    stride_qb, stride_qh,
    stride_kn, stride_kh,
    stride_vn, stride_vh,
    stride_ob, stride_oh,
    stride_pb, stride_ph, stride_ps,
    stride_lb, stride_lh,
    tokens_per_split, num_slots, row_units, table_len,
    GROUP: tl.constexpr, PAGE_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr, V_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    SPLIT: tl.constexpr, DOT_F32: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)

    seqlen = tl.load(SeqLens + b)
    row = tl.load(RowStart + b).to(tl.int64)
    start = split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, seqlen)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    h_mask = offs_h < GROUP
    d_mask = offs_d < HEAD_DIM
    dv_mask = offs_dv < V_DIM
    q_heads = kvh * GROUP + offs_h

    q = tl.load(Q + b.to(tl.int64) * stride_qb + q_heads[:, None] * stride_qh + offs_d[None, :],
                mask=h_mask[:, None] & d_mask[None, :], other=0.0)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], dtype=tl.float32)

    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        # a length past the row's table width (paged) or past the end of the table (ragged)
        # must not read the next row's / foreign entries: those tokens are not attended
        entry = row + offs_n // PAGE_SIZE
        in_row = (offs_n < end) & (offs_n // PAGE_SIZE < row_units) & (entry >= 0) & (entry < table_len)
        page = tl.load(Table + entry, mask=in_row, other=0).to(tl.int64)
        slot = page * PAGE_SIZE + offs_n % PAGE_SIZE
        # negative (padding) or out-of-pool ids are masked, never dereferenced
        n_mask = in_row & (page >= 0) & (slot < num_slots)
        slot = tl.where(n_mask, slot, 0)
        k = tl.load(K + slot[None, :] * stride_kn + kvh * stride_kh + offs_d[:, None],
                    mask=n_mask[None, :] & d_mask[:, None], other=0.0)
        if DOT_F32:
            s = tl.dot(q.to(tl.float32), k.to(tl.float32)) * qk_scale_log2
        else:
            s = tl.dot(q, k.to(q.dtype)) * qk_scale_log2
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # a block of only masked entries leaves m at -inf; shift by 0 then (p = 0)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + slot[:, None] * stride_vn + kvh * stride_vh + offs_dv[None, :],
                    mask=n_mask[:, None] & dv_mask[None, :], other=0.0)
        if DOT_F32:
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32))
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    store_split_result(acc, l_i, m_i, Out, OutPartial, LsePartial, b, split, q_heads, offs_dv, h_mask, dv_mask, h_mask,
                       stride_ob, stride_oh, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, SPLIT)


# ----------------------------------------------------------------------------- checks
def check_decode_inputs(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                        page_size: int) -> tuple[int, int, int, int, int]:
    """Validate q / pool buffers; returns (B, Hq, Hkv, D, Dv)."""
    if not isinstance(q, torch.Tensor) or q.dim() != 3:
        fail("q", "a [B, Hq, D] tensor", getattr(q, "shape", type(q)))
    if q.dtype not in FLOAT_DTYPES:
        fail("q", f"of dtype in {FLOAT_DTYPES}", q.dtype)
    for name, buf in (("k_buffer", k_buffer), ("v_buffer", v_buffer)):
        if not isinstance(buf, torch.Tensor) or buf.dim() != 3:
            fail(name, "a [num_slots, Hkv, D] tensor", getattr(buf, "shape", type(buf)))
        if buf.dtype != q.dtype:
            fail(name, f"of q's dtype {q.dtype}", buf.dtype)
        if buf.device != q.device:
            fail(name, f"on q's device {q.device}", buf.device)
        if buf.stride(-1) != 1:
            fail(name, "contiguous in its last dim", buf.stride())
    if q.stride(-1) != 1:
        fail("q", "contiguous in its last dim", q.stride())
    B, Hq, D = q.shape
    if k_buffer.shape[0] != v_buffer.shape[0] or k_buffer.shape[1] != v_buffer.shape[1]:
        fail("v_buffer", f"[num_slots={k_buffer.shape[0]}, Hkv={k_buffer.shape[1]}, Dv]", tuple(v_buffer.shape))
    Hkv = k_buffer.shape[1]
    if k_buffer.shape[2] != D:
        fail("k_buffer", f"of head dim {D} (q's)", k_buffer.shape[2])
    if Hkv <= 0 or Hq % Hkv != 0:
        fail("q", f"with Hq a multiple of Hkv={Hkv}", Hq)
    if not isinstance(page_size, int) or page_size < 1:
        fail("page_size", "an integer >= 1", page_size)
    if k_buffer.shape[0] % page_size != 0:
        fail("k_buffer", f"with num_slots a multiple of page_size={page_size}", k_buffer.shape[0])
    return B, Hq, Hkv, D, v_buffer.shape[2]


def _check_table(page_table: torch.Tensor, cache_seqlens: torch.Tensor, B: int, device: torch.device) -> None:
    if not isinstance(page_table, torch.Tensor) or page_table.dim() != 2 or page_table.shape[0] != B:
        fail("page_table", f"a [B={B}, max_pages] tensor", getattr(page_table, "shape", type(page_table)))
    if page_table.dtype not in (torch.int32, torch.int64):
        fail("page_table", "int32 or int64", page_table.dtype)
    if not isinstance(cache_seqlens, torch.Tensor) or tuple(cache_seqlens.shape) != (B,):
        fail("cache_seqlens", f"a [B={B}] tensor", getattr(cache_seqlens, "shape", type(cache_seqlens)))
    if cache_seqlens.dtype not in (torch.int32, torch.int64):
        fail("cache_seqlens", "int32 or int64", cache_seqlens.dtype)
    for name, t in (("page_table", page_table), ("cache_seqlens", cache_seqlens)):
        if t.device != device:
            fail(name, f"on q's device {device}", t.device)


# ----------------------------------------------------------------------------- launcher
def decode_over_table(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                      table: torch.Tensor, row_start: torch.Tensor, seqlens: torch.Tensor,
                      *, page_size: int, max_tokens: int, sm_scale: float,
                      row_units: Optional[int] = None, table_len: Optional[int] = None,
                      config: Optional[DecodeLaunchConfig] = None) -> torch.Tensor:
    """Triton launch shared by the paged and ragged forms (inputs already validated).

    table:     ``[*] int32/int64`` flat: row ``b``'s page (or slot, page_size 1) ids start
               at ``table[row_start[b]]``.
    row_start: ``[B]`` int offsets into ``table``.
    seqlens:   ``[B]`` tokens attended per row (0 allowed: output zeros).
    max_tokens: static upper bound of ``seqlens`` (sets the split count, never read back).
    row_units: entries of ``table`` one row may read (paged: ``max_pages``; None: no
               limit); tokens past them, or past ``table_len`` (default ``table.numel()``,
               the entries from ``table``'s first element), are masked whatever ``seqlens`` says.
    Returns ``[B, Hq, Dv]`` in q's dtype.
    """
    B, Hq, D = q.shape
    Hkv, Dv = k_buffer.shape[1], v_buffer.shape[2]
    group = Hq // Hkv
    out = torch.empty((B, Hq, Dv), dtype=q.dtype, device=q.device)
    if B == 0:
        return out
    cfg = config or default_config(q.device, D)
    block_n = cfg.block_n
    kv_bytes = B * max(0, max_tokens) * Hkv * (D * k_buffer.element_size() + Dv * v_buffer.element_size())
    splits, tps = split_tokens(max_tokens, cfg.num_splits or choose_num_splits(
        B * Hkv, max_tokens, block_n, sm_count(q.device, off_cuda=INTERPRETER_SMS), kv_bytes=kv_bytes), block_n)
    block_h = max(16, triton.next_power_of_2(group))
    block_d = max(16, triton.next_power_of_2(D))
    block_dv = max(16, triton.next_power_of_2(Dv))
    part, lse, part_strides = split_buffers(out, splits)
    qk_scale_log2 = float(sm_scale) * 1.4426950408889634
    _decode_stage1[(B, Hkv, splits)](
        q, k_buffer, v_buffer, table, row_start, seqlens, out, part, lse,
        qk_scale_log2,
        q.stride(0), q.stride(1),
        k_buffer.stride(0), k_buffer.stride(1),
        v_buffer.stride(0), v_buffer.stride(1),
        out.stride(0), out.stride(1),
        *part_strides,
        tps, k_buffer.shape[0],
        INT32_MAX if row_units is None else int(row_units),
        table.numel() if table_len is None else int(table_len),
        GROUP=group, PAGE_SIZE=page_size, HEAD_DIM=D, V_DIM=Dv,
        BLOCK_H=block_h, BLOCK_N=block_n, BLOCK_D=block_d, BLOCK_DV=block_dv,
        SPLIT=splits > 1, DOT_F32=dot_in_fp32(q),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if splits > 1:
        merge_splits(part, lse, out, block_dv)
    return out


# ----------------------------------------------------------------------------- paged form
def paged_decode_triton(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                        page_table: torch.Tensor, cache_seqlens: torch.Tensor, *,
                        page_size: int, sm_scale: float,
                        config: Optional[DecodeLaunchConfig] = None) -> torch.Tensor:
    """Triton paged decode.

    q:             ``[B, Hq, D]`` fp16/bf16 (fp32 accepted; dot in tf32 on GPU).
    k_buffer:      ``[num_slots, Hkv, D]`` same dtype; ``v_buffer`` ``[num_slots, Hkv, Dv]``.
    page_table:    ``[B, max_pages]`` int32 physical pages in logical order; entries past
                   a row's length are never read (pad with 0, hicache's padding page, or
                   -1). Negative or out-of-pool pages inside a row are masked out.
    cache_seqlens: ``[B]`` int32 tokens per row; tokens past ``max_pages * page_size`` are
                   not attended (masked in the kernel, no host sync), as in the reference.
    Returns ``[B, Hq, Dv]`` in q's dtype; rows of length 0 are zeros.
    """
    B, *_ = check_decode_inputs(q, k_buffer, v_buffer, page_size)
    _check_table(page_table, cache_seqlens, B, q.device)
    if page_table.stride(1) != 1:
        page_table = page_table.contiguous()
    row_start = _row_starts(B, page_table.stride(0), q.device)
    # entries reachable from the table's first element (rows may be a strided view)
    extent = (B - 1) * page_table.stride(0) + page_table.shape[1] if B > 0 else 0
    return decode_over_table(q, k_buffer, v_buffer, page_table, row_start, cache_seqlens,
                             page_size=page_size, max_tokens=page_table.shape[1] * page_size,
                             sm_scale=sm_scale, row_units=page_table.shape[1], table_len=extent, config=config)


_ROW_STARTS: dict = {}


def _row_starts(b: int, stride: int, device: torch.device) -> torch.Tensor:
    """``arange(b) * stride`` (int64), cached read-only per (b, stride, device): every
    decode layer of a step asks for the same one."""
    key = (b, stride, device)
    t = _ROW_STARTS.get(key)
    if t is None:
        t = _ROW_STARTS[key] = torch.arange(b, device=device, dtype=torch.int64) * stride
    return t


def gathered_decode_reference(q: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor,
                              mask: torch.Tensor, sm_scale: float) -> torch.Tensor:
    """Plain torch attention of one query per row over gathered, masked KV.

    q ``[B, Hq, D]``; k_rows ``[B, T, Hkv, D]``; v_rows ``[B, T, Hkv, Dv]``; mask ``[B, T]``
    bool (True = attend). fp32 math; rows with no True give zeros. Returns q's dtype.
    """
    B, Hq, D = q.shape
    Hkv = k_rows.shape[2]
    g = Hq // Hkv
    qf = q.float().view(B, Hkv, g, D)
    s = torch.einsum("bhgd,bthd->bhgt", qf, k_rows.float()) * sm_scale
    s = s.masked_fill(~mask[:, None, None, :], float("-inf"))
    p = torch.softmax(s, dim=-1)
    p = torch.nan_to_num(p, nan=0.0)  # all-masked rows: softmax of -inf is nan
    o = torch.einsum("bhgt,bthd->bhgd", p, v_rows.float())
    return o.reshape(B, Hq, -1).to(q.dtype)


def paged_decode_reference(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                           page_table: torch.Tensor, cache_seqlens: torch.Tensor, *,
                           page_size: int, sm_scale: float,
                           config: Optional[DecodeLaunchConfig] = None) -> torch.Tensor:
    """Torch reference of :func:`paged_decode_triton` (same arguments and result)."""
    B, *_ = check_decode_inputs(q, k_buffer, v_buffer, page_size)
    _check_table(page_table, cache_seqlens, B, q.device)
    T = page_table.shape[1] * page_size
    t = torch.arange(T, device=q.device)
    pages = page_table.long()[:, t // page_size]
    slots = pages * page_size + (t % page_size)[None, :]
    mask = (t[None, :] < cache_seqlens.long()[:, None]) & (pages >= 0) & (slots < k_buffer.shape[0])
    slots = torch.where(mask, slots, torch.zeros_like(slots))
    return gathered_decode_reference(q, k_buffer[slots], v_buffer[slots], mask, sm_scale)


def paged_decode(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                 page_table: torch.Tensor, cache_seqlens: torch.Tensor, *,
                 page_size: int, sm_scale: float,
                 config: Optional[DecodeLaunchConfig] = None) -> torch.Tensor:
    """Paged GQA decode (see the module docstring); Triton on CUDA, the torch reference
    elsewhere."""
    impl = dispatch("paged_decode", q, paged_decode_triton, paged_decode_reference)
    return impl(q, k_buffer, v_buffer, page_table, cache_seqlens, page_size=page_size, sm_scale=sm_scale,
                config=config)


# ----------------------------------------------------------------------------- FA contract
def _check_fa_inputs(q, k_cache, v_cache, cache_seqlens, page_table, causal):
    if not isinstance(q, torch.Tensor) or q.dim() != 4 or q.shape[1] != 1:
        fail("q", "a [B, 1, Hq, D] tensor (one decode token per row)", getattr(q, "shape", type(q)))
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(c, torch.Tensor) or c.dim() != 4:
            fail(name, "a [num_pages, page_size, Hkv, D] tensor", getattr(c, "shape", type(c)))
    if k_cache.shape[:3] != v_cache.shape[:3]:
        fail("v_cache", f"[{k_cache.shape[0]}, {k_cache.shape[1]}, {k_cache.shape[2]}, Dv]", tuple(v_cache.shape))


def flash_attn_with_kvcache_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                      cache_seqlens: torch.Tensor, page_table: torch.Tensor,
                                      softmax_scale: Optional[float] = None, causal: bool = True) -> torch.Tensor:
    """Pure-torch ``flash_attn_with_kvcache`` for decode (seqlen_q == 1), paged KV.

    q ``[B, 1, Hq, D]``; k_cache ``[num_pages, page_size, Hkv, D]``; v_cache
    ``[num_pages, page_size, Hkv, Dv]``; cache_seqlens ``[B] int32``; page_table
    ``[B, max_pages] int32`` (flash-attn's ``block_table``). Query head ``h`` reads kv head
    ``h // (Hq // Hkv)``. With one query at the sequence end, causal masking keeps every
    cached token. Returns ``[B, 1, Hq, Dv]``. Written per row, independently of the
    vectorised references, as the contract's ground truth.
    """
    _check_fa_inputs(q, k_cache, v_cache, cache_seqlens, page_table, causal)
    B, _, Hq, D = q.shape
    ps, Hkv = k_cache.shape[1], k_cache.shape[2]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(D)
    out = torch.zeros((B, 1, Hq, v_cache.shape[-1]), dtype=q.dtype, device=q.device)
    for b in range(B):
        n = int(cache_seqlens[b])
        if n == 0:
            continue
        pages = page_table[b, : cdiv(n, ps)].long()
        k = k_cache[pages].reshape(-1, Hkv, D)[:n].float()          # [n, Hkv, D]
        v = v_cache[pages].reshape(-1, Hkv, v_cache.shape[-1])[:n].float()
        k = k.repeat_interleave(Hq // Hkv, dim=1)                   # [n, Hq, D]
        v = v.repeat_interleave(Hq // Hkv, dim=1)
        s = torch.einsum("hd,nhd->hn", q[b, 0].float(), k) * scale
        out[b, 0] = torch.einsum("hn,nhd->hd", torch.softmax(s, dim=-1), v).to(q.dtype)
    return out


def flash_attn_with_kvcache_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                   cache_seqlens: torch.Tensor, page_table: torch.Tensor,
                                   softmax_scale: Optional[float] = None, causal: bool = True,
                                   config: Optional[DecodeLaunchConfig] = None) -> torch.Tensor:
    """``flash_attn_with_kvcache`` contract (decode, paged KV) on the Triton kernel.
    Same arguments and result as :func:`flash_attn_with_kvcache_reference`."""
    _check_fa_inputs(q, k_cache, v_cache, cache_seqlens, page_table, causal)
    B, _, Hq, D = q.shape
    num_pages, ps, Hkv = k_cache.shape[:3]
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        fail("k_cache/v_cache", "contiguous (a view of the flat slot pool)", "non-contiguous")
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(D)
    out = paged_decode_triton(q[:, 0], k_cache.view(num_pages * ps, Hkv, D),
                              v_cache.view(num_pages * ps, Hkv, v_cache.shape[-1]),
                              page_table, cache_seqlens, page_size=ps, sm_scale=scale, config=config)
    return out.unsqueeze(1)
