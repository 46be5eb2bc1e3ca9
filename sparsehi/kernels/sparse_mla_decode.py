"""Sparse MLA decode attention over token indices (DeepSeek DSA style).

MLA with the absorbed query: every head attends to the same latent KV rows
``kv[slot] = [c_kv (kv_lora_rank) | k_rope (rope_dim)]`` (one "kv head"); the score is
``q · kv`` over all ``kv_lora_rank + rope_dim`` dims and the value is the latent part
``kv[:, :kv_lora_rank]``. Each row attends to the slots ``indices[b]`` (``-1`` padding,
anywhere in the row; out-of-pool slots are masked too, never read).

Fused kernel (:class:`MlaLaunchConfig`; the default off Hopper and for small launches): one program per (head block, request,
split); the head block is the fastest grid axis so the programs reading the same KV rows
run side by side and the repeat reads hit L2. Scores are two ``tl.dot`` (latent and rope
parts), the value product reuses the latent tile already in shared memory (``tl.trans``),
so each KV row is loaded once per head block. Split-K over the index list with a
log-sum-exp merge (the merge kernel of ``paged_decode``).

Two-pass path (opt-in, :class:`MlaTwoPassConfig`): a score GEMM per request writes fp32
scores ``[B, H, K]`` and per-block row maxima to a scratch buffer, then a value pass does
``softmax(S) @ V`` with no rescaling in its loop. Same results; on the H200 it is within
±10 % of the fused kernel (faster at B=16 and B=64/K=512, slower at B=1) and costs
``B*H*K*4`` bytes of scratch, so it is not the default.

Gluon path (:class:`MlaGluonConfig`; the default for large launches on Hopper, falls back
to the fused Triton kernel elsewhere): :func:`_mla_gluon_kernel` with explicit layouts. The fused Triton kernel
at 64-head blocks / 8 warps is laid out "all warps along M" for the score dot (Triton's
AccelerateMatmul gives a dot whose result feeds another dot ``warpsPerCTA = [8, 1]``), so
both warpgroups issue the same 64-row score MMA; the Gluon kernel splits the score MMA's
tokens and the value MMA's 512 columns over the two warpgroups (``[4, 2]``), passes ``P``
through shared memory, gathers KV rows by cp.async into a 2-deep shared ring and reads the
index tiles one iteration ahead. H200, H=128, K=2048, same run (benchmarks/mla_experiments.py):
B=64 109 us (334 TFLOP/s) vs 173 us for the fused kernel, B=16 40 vs 59 us, but B=1
14.8 us (13.9 with 32 splits) vs 12.5 us. So with ``config=None`` a Hopper launch of at
least ``GLUON_MIN_HEAD_BLOCKS`` 64-head blocks runs the Gluon kernel and smaller ones the
fused Triton kernel; pass a config to pick one explicitly. Un-chaining the
dots inside plain Triton (P through a global scratch; all dots then get ``[4, 2]``) gave
171 vs 172 us: the L2 round trip and extra barriers ate the saved MMA; a softmax/value-MMA
skew needs a third KV buffer, which only fits at 32-token tiles, and was slower (168 us).
Second pass (same H200, K=2048, B=64; none kept, the kernel is unchanged): timing variants
that drop the MMAs or the gathers put H=128 at 87 us compute-only and 57 us gather-only
(110 us whole), H=16 at 45 us compute-only (the 64-row padded MMAs) and 44 us gather-only
(60 us whole). Tried and slower: the next tile's score MMA issued behind the running value
MMA (rotated loop, wgmma wait 1) 134 vs 110 us (H=16: 79 vs 60), with 32-token tiles x 4
164 us; an L2 bulk prefetch of the rows 1-3 tiles ahead of the ring 164-168 us (H=16:
87-98 us); for 16 heads a transposed kernel (tokens / latent dims on the wgmma M side,
heads on N: no padding, q only 16 rows, 68 m64n16 wgmmas per tile): 27 us compute-only and
44 us gather-only but 67 us whole with 4 warps (no overlap; 73 with 8 warps, 63 with two
1-slot CTAs per SM), and with the rope rows through registers to fit a third latent slot
40 us gather-only, 53 compute-only, 70 whole;
32-token tiles x 4 at 16 heads 73 us.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from hicache.triton_support import announce_path, dispatch, interpreter_enabled
from sparsehi.kernels.paged_decode import (_FLOAT_DTYPES, _MAX_SPLITS, _fail, _store_split_result, dot_in_fp32,
                                           merge_splits, sm_count)


@dataclass(frozen=True)
class MlaLaunchConfig:
    """Block sizes of the sparse MLA kernel; ``num_splits`` None = heuristic."""

    block_h: int = 64
    block_n: int = 32
    num_warps: int = 8
    num_stages: int = 2
    num_splits: Optional[int] = None
    row_load: bool = False
    """Load KV tiles as ``[N, D]`` rows (score dot on the transposed view) instead of
    ``[D, N]`` columns (value dot on the transposed view)."""


@dataclass(frozen=True)
class MlaTwoPassConfig:
    """Block sizes of the two-pass path: pass 1 is a score GEMM ``q [H, D] x kv[idx]^T``
    per request (``score_*``, written to an fp32 scratch ``[B, H, K]`` with per-block row
    maxima), pass 2 the value product over the stored scores (``pv_*``, split-K merged
    like the fused kernel). ``num_splits`` None = heuristic."""

    score_block_h: int = 128
    score_block_n: int = 128
    score_block_k: int = 64
    score_warps: int = 8
    score_stages: int = 3
    pv_block_h: int = 64
    pv_block_n: int = 64
    pv_block_dv: int = 512
    pv_warps: int = 8
    pv_stages: int = 2
    num_splits: Optional[int] = None


@dataclass(frozen=True)
class MlaGluonConfig:
    """Hopper Gluon kernel :func:`_mla_gluon_kernel` (64-head blocks, 8 warps): ``block_n``
    tokens per tile, a ``num_buf``-deep cp.async ring (64 x 2 fills the shared memory; 32 x 3
    or 32 x 4 fit too but were slower). ``late_issue``: issue the next tile's gather after
    the loop-top barrier instead of behind a trailing one. Falls back to the Triton kernel
    (logged once) where Gluon or a Hopper GPU is unavailable."""

    block_n: int = 64
    num_buf: int = 2
    late_issue: bool = False
    num_splits: Optional[int] = None


# Default dispatch on Hopper: the Gluon kernel once a launch has at least this many 64-head
# blocks (batch x ceil(heads / 64)); below it the fused Triton kernel's 16-head blocks keep
# more SMs busy. H200, K=2048, 128 heads (benchmarks/results/attention.json, `mla_dispatch`):
# Gluon 1.6x faster at B=64, 1.5x at B=16, 1.1x at B=2, 1.2x slower at B=1.
GLUON_MIN_HEAD_BLOCKS = 4


def default_mla_config(device: torch.device, num_heads: int, batch: int = 1,
                       num_idx: Optional[int] = None) -> MlaLaunchConfig:
    """Block sizes from the H200 sweeps in benchmarks/results/attention.json (``sweep_history``).

    Many rows (``batch * heads / 64 >= 8``): 64-head blocks, 64-token tiles, 8 warps —
    the KV tile is read once per 64 heads and the dots are large. 3 pipeline stages when
    each program walks >= 8 tiles (``num_idx`` after the split heuristic; None = assume
    long): the index tile is then fetched asynchronously too, where with 2 stages its
    load sits on every iteration's critical path (-8 % time at B=64, K=2048); on short
    loops the deeper prologue costs more than it hides (+6 % at B=16, K=512). Few rows:
    16-head blocks (4x the programs) with row-layout loads, which won at B=1.
    """
    if device.type != "cuda":
        return MlaLaunchConfig(block_h=16, block_n=16, num_warps=4, num_stages=1)
    head_blocks = -(-num_heads // 64)
    if batch * head_blocks >= 8:
        stages = 3
        if num_idx is not None:
            splits = mla_num_splits(batch * head_blocks, num_idx, 64, sm_count(device))
            stages = 3 if -(-num_idx // splits) >= 8 * 64 else 2
        return MlaLaunchConfig(block_h=64, block_n=64, num_warps=8, num_stages=stages)
    return MlaLaunchConfig(block_h=16, block_n=64, num_warps=4, num_stages=2, row_load=True)


def mla_num_splits(work_items: int, num_idx: int, block_n: int, num_sms: int) -> int:
    """Split-K count for the MLA kernel: one program per SM is already a full wave (each
    program holds a large tile in shared memory), so split only while the grid is smaller
    than the SM count, and keep splits >= 128 indices."""
    want = max(1, num_sms // max(1, work_items))
    cap = max(1, -(-num_idx // max(block_n, 128)))
    return int(max(1, min(want, cap, _MAX_SPLITS)))


@triton.jit
def _load_rows(KV, idx, valid, stride_kvn, offs_d, d_mask, col0):
    """[N, D] rows ``KV[idx, col0 + offs_d]`` (zeros where not valid)."""
    base = tl.where(valid, idx, 0).to(tl.int64) * stride_kvn + col0
    return tl.load(KV + base[:, None] + offs_d[None, :], mask=valid[:, None] & d_mask[None, :], other=0.0)


@triton.jit
def _load_cols(KV, idx, valid, stride_kvn, offs_d, d_mask, col0):
    """[D, N] = rows transposed at load time."""
    base = tl.where(valid, idx, 0).to(tl.int64) * stride_kvn + col0
    return tl.load(KV + base[None, :] + offs_d[:, None], mask=valid[None, :] & d_mask[:, None], other=0.0)


@triton.jit
def _valid(Idx, b, stride_ib, n0, end, num_slots, BLOCK_N: tl.constexpr):
    offs_n = n0 + tl.arange(0, BLOCK_N)
    in_row = offs_n < end
    idx = tl.load(Idx + b.to(tl.int64) * stride_ib + offs_n, mask=in_row, other=-1)
    valid = in_row & (idx >= 0) & (idx < num_slots)
    return idx, valid


@triton.jit
def _online_softmax_step(s, valid, m_i, l_i, acc, v_rows, qk_scale_log2):
    """One flash-decoding step: scores ``s [H, N]`` (unscaled), value rows ``v_rows [N, DV]``."""
    s = s * qk_scale_log2
    s = tl.where(valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # a block of only padding leaves m at -inf; shift by 0 then (p = 0)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v_rows.dtype), v_rows, acc)
    return m_new, l_i, acc


@triton.jit
def _mla_stage1(
    Q, KV, Idx, Out, OutPartial, LsePartial,
    qk_scale_log2,
    stride_qb, stride_qh, stride_kvn, stride_ib,
    stride_ob, stride_oh,
    stride_pb, stride_ph, stride_ps,
    stride_lb, stride_lh,
    num_heads, num_idx, tokens_per_split, num_slots,
    D_LAT: tl.constexpr, D_ROPE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_DL: tl.constexpr, BLOCK_DR: tl.constexpr,
    SPLIT: tl.constexpr, DOT_F32: tl.constexpr, ROW_LOAD: tl.constexpr,
):
    hb = tl.program_id(0)
    b = tl.program_id(1)
    split = tl.program_id(2)
    start = split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, num_idx)

    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_dl = tl.arange(0, BLOCK_DL)
    offs_dr = tl.arange(0, BLOCK_DR)
    h_mask = offs_h < num_heads
    dl_mask = offs_dl < D_LAT
    dr_mask = offs_dr < D_ROPE
    q_base = Q + b.to(tl.int64) * stride_qb + offs_h[:, None] * stride_qh
    q_lat = tl.load(q_base + offs_dl[None, :], mask=h_mask[:, None] & dl_mask[None, :], other=0.0)
    q_pe = tl.load(q_base + D_LAT + offs_dr[None, :], mask=h_mask[:, None] & dr_mask[None, :], other=0.0)
    if DOT_F32:
        q_lat = q_lat.to(tl.float32)
        q_pe = q_pe.to(tl.float32)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DL], dtype=tl.float32)

    for n0 in range(start, end, BLOCK_N):
        idx, valid = _valid(Idx, b, stride_ib, n0, end, num_slots, BLOCK_N)
        if ROW_LOAD:
            # rows as loaded [N, D]; the score dot takes the transposed view
            kv_lat = _load_rows(KV, idx, valid, stride_kvn, offs_dl, dl_mask, 0)
            k_lat = tl.trans(kv_lat)
            k_pe = tl.trans(_load_rows(KV, idx, valid, stride_kvn, offs_dr, dr_mask, D_LAT))
        else:
            k_lat = _load_cols(KV, idx, valid, stride_kvn, offs_dl, dl_mask, 0)
            kv_lat = tl.trans(k_lat)
            k_pe = _load_cols(KV, idx, valid, stride_kvn, offs_dr, dr_mask, D_LAT)
        if DOT_F32:
            k_lat = k_lat.to(tl.float32)
            kv_lat = kv_lat.to(tl.float32)
            k_pe = k_pe.to(tl.float32)
        s = tl.dot(q_lat, k_lat)
        s = tl.dot(q_pe, k_pe, s)
        m_i, l_i, acc = _online_softmax_step(s, valid, m_i, l_i, acc, kv_lat, qk_scale_log2)

    _store_split_result(acc, l_i, m_i, Out, OutPartial, LsePartial, b, split, offs_h, offs_dl, h_mask, dl_mask, h_mask,
                        stride_ob, stride_oh, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, SPLIT)


@triton.jit
def _mla_scores(
    Q, KV, Idx, S, Mblk,
    qk_scale_log2,
    stride_qb, stride_qh, stride_kvn, stride_ib,
    stride_sb, stride_sh, stride_mb, stride_mh,
    num_heads, num_idx, num_slots,
    D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    """Pass 1: ``S[b, h, n] = q[b, h] . kv[idx[b, n]] * scale * log2(e)`` (``-inf`` where the
    index is invalid) for one [BLOCK_H, BLOCK_N] block, and that block's row maxima.
    A plain GEMM loop over D: the gather addresses are fixed for the whole loop, so the
    cp.async pipeline runs ahead with no index load on its critical path."""
    nb = tl.program_id(0)
    b = tl.program_id(1)
    hb = tl.program_id(2)
    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    h_mask = offs_h < num_heads
    idx, valid = _valid(Idx, b, stride_ib, nb * BLOCK_N, num_idx, num_slots, BLOCK_N)
    in_row = offs_n < num_idx
    kv_base = tl.where(valid, idx, 0).to(tl.int64) * stride_kvn
    q_ptrs = Q + b.to(tl.int64) * stride_qb + offs_h[:, None] * stride_qh + offs_k[None, :]
    k_ptrs = KV + kv_base[None, :] + offs_k[:, None]
    acc = tl.zeros([BLOCK_H, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, D, BLOCK_K):
        k_mask = (k0 + offs_k) < D
        a = tl.load(q_ptrs + k0, mask=h_mask[:, None] & k_mask[None, :], other=0.0)
        kt = tl.load(k_ptrs + k0, mask=k_mask[:, None] & valid[None, :], other=0.0)
        if DOT_F32:
            a = a.to(tl.float32)
            kt = kt.to(tl.float32)
        acc = tl.dot(a, kt, acc)
    s = tl.where(valid[None, :], acc * qk_scale_log2, float("-inf"))
    tl.store(S + b.to(tl.int64) * stride_sb + offs_h[:, None] * stride_sh + offs_n[None, :], s,
             mask=h_mask[:, None] & in_row[None, :])
    tl.store(Mblk + b.to(tl.int64) * stride_mb + offs_h * stride_mh + nb, tl.max(s, 1), mask=h_mask)


@triton.jit
def _mla_pv(
    S, Mblk, KV, Idx, Out, OutPartial, LsePartial,
    stride_sb, stride_sh, stride_mb, stride_mh,
    stride_kvn, stride_ib,
    stride_ob, stride_oh,
    stride_pb, stride_ph, stride_ps,
    stride_lb, stride_lh,
    num_heads, num_idx, tokens_per_split, num_slots, num_blocks,
    D_LAT: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_NB: tl.constexpr, NUM_DVB: tl.constexpr, SPLIT: tl.constexpr, DOT_F32: tl.constexpr,
):
    """Pass 2: ``out = softmax(S) @ kv[idx, :D_LAT]`` for one [BLOCK_H, BLOCK_DV] output block
    and one token split. The row max is the max of pass 1's block maxima, so there is no
    rescaling inside the loop and the only dot is the value product."""
    pid0 = tl.program_id(0)
    hb = pid0 // NUM_DVB
    dvb = pid0 % NUM_DVB
    b = tl.program_id(1)
    split = tl.program_id(2)
    start = split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, num_idx)
    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_dv = dvb * BLOCK_DV + tl.arange(0, BLOCK_DV)
    offs_nb = tl.arange(0, BLOCK_NB)
    h_mask = offs_h < num_heads
    dv_mask = offs_dv < D_LAT
    mb = tl.load(Mblk + b.to(tl.int64) * stride_mb + offs_h[:, None] * stride_mh + offs_nb[None, :],
                 mask=h_mask[:, None] & (offs_nb < num_blocks)[None, :], other=float("-inf"))
    m = tl.max(mb, 1)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    s_base = S + b.to(tl.int64) * stride_sb + offs_h[:, None] * stride_sh
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        idx, valid = _valid(Idx, b, stride_ib, n0, end, num_slots, BLOCK_N)
        offs_n = n0 + tl.arange(0, BLOCK_N)
        s = tl.load(s_base + offs_n[None, :], mask=h_mask[:, None] & (offs_n < end)[None, :], other=float("-inf"))
        p = tl.exp2(s - m_safe[:, None])
        l_i += tl.sum(p, 1)
        v = _load_rows(KV, idx, valid, stride_kvn, offs_dv, dv_mask, 0)
        if DOT_F32:
            v = v.to(tl.float32)
        acc = tl.dot(p.to(v.dtype), v, acc)
    # every value block of a head computes the same lse; block 0 writes it
    _store_split_result(acc, l_i, m_safe, Out, OutPartial, LsePartial, b, split, offs_h, offs_dv, h_mask, dv_mask,
                        h_mask & ((offs_h * 0 + dvb) == 0),
                        stride_ob, stride_oh, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, SPLIT)


# ----------------------------------------------------------------------------- Gluon (Hopper)
try:  # Triton >= 3.5 with Gluon; the API moves between releases, so any failure -> no Gluon path
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (async_copy, fence_async_shared, warpgroup_mma,
                                                                  warpgroup_mma_wait)

    @gluon.jit
    def _gl_rows(idx_row, start, end, t, num_slots, offs_n, BLOCK_N: gl.constexpr):
        """Slots of tile ``t``, -1 where masked (padding, past the split, out of the pool)."""
        offs = start + t * BLOCK_N + offs_n
        in_row = offs < end
        idx = gl.load(idx_row + offs, mask=in_row, other=-1)
        return gl.where(in_row & (idx < num_slots), idx, -1)

    @gluon.jit
    def _gl_copy(KV, rows, stride_kvn, col0, buf, offs_d):
        """cp.async gather ``KV[rows, col0 + offs_d]`` into ``buf`` (zero fill where rows < 0)."""
        valid = rows >= 0
        base = gl.maximum(rows, 0).to(gl.int64) * stride_kvn + col0
        async_copy.async_copy_global_to_shared(buf, KV + base[:, None] + offs_d[None, :], mask=valid[:, None])

    @gluon.jit
    def _mla_gluon_kernel(
        Q, KV, Idx, Out, OutPartial, LsePartial,
        qk_scale_log2,
        stride_qb, stride_qh, stride_kvn, stride_ib,
        stride_ob, stride_oh,
        stride_pb, stride_ph, stride_ps,
        stride_lb, stride_lh,
        num_heads, num_idx, tokens_per_split, num_slots,
        D_LAT: gl.constexpr, D_ROPE: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr,
        NUM_BUF: gl.constexpr, LATE_ISSUE: gl.constexpr, SPLIT: gl.constexpr,
    ):
        """Hopper sparse MLA decode in Gluon, 8 warps = 2 warpgroups, one 64-head block.

        Explicit layouts: both the score MMA ``S = q kv^T`` (wgmma m64n(N/2)) and the value
        MMA ``O += P kv_lat`` (m64n256) split over the two warpgroups (``warps [4, 2]``), so no
        MMA is issued twice; ``P`` goes to the value MMA through shared memory; the gathered
        KV rows land by ``cp.async`` in a ``NUM_BUF``-deep shared ring (tiles t+1 .. t+NUM_BUF-1
        in flight while tile t is computed; padding rows zero-filled); the index tiles are
        read one iteration before their gathers / masks need them; q is loaded (while the
        first tiles fly) into shared memory once. Row sums are kept per token column (``l2``)
        and reduced after the loop; the score MMA starts from zero, the value MMA
        accumulates into the rescaled ``O`` in registers (m64n256 per warpgroup)."""
        hb = gl.program_id(0)
        b = gl.program_id(1)
        split = gl.program_id(2)
        start = split * tokens_per_split
        end = gl.minimum(start + tokens_per_split, num_idx)
        n_tiles = (end - start + BLOCK_N - 1) // BLOCK_N

        ld_lat: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [8, 1], [1, 0])
        ld_pe: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [8, 1], [1, 0])
        mma_s: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                        instr_shape=[16, BLOCK_N // 2, 16])
        mma_o: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                        instr_shape=[16, D_LAT // 2, 16])
        sh: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        dtype: gl.constexpr = KV.dtype.element_ty

        offs_h_lat = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, ld_lat))
        offs_d_lat = gl.arange(0, D_LAT, layout=gl.SliceLayout(0, ld_lat))
        offs_h_pe = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, ld_pe))
        offs_d_pe = gl.arange(0, D_ROPE, layout=gl.SliceLayout(0, ld_pe))
        lat_s = gl.allocate_shared_memory(dtype, [NUM_BUF, BLOCK_N, D_LAT], sh)
        pe_s = gl.allocate_shared_memory(dtype, [NUM_BUF, BLOCK_N, D_ROPE], sh)
        sh_p: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, BLOCK_N], dtype)
        p_s = gl.allocate_shared_memory(dtype, [BLOCK_H, BLOCK_N], sh_p)

        idx_row = Idx + b.to(gl.int64) * stride_ib
        offs_n_lat = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ld_lat))
        offs_n_pe = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ld_pe))
        offs_n_s = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, mma_s))

        m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=gl.SliceLayout(1, mma_s))
        l2 = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, layout=mma_s)
        zero_s = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, layout=mma_s)
        o = gl.zeros([BLOCK_H, D_LAT], gl.float32, layout=mma_o)

        for t in gl.static_range(NUM_BUF - 1):
            rl = _gl_rows(idx_row, start, end, t, num_slots, offs_n_lat, BLOCK_N)
            rp = _gl_rows(idx_row, start, end, t, num_slots, offs_n_pe, BLOCK_N)
            _gl_copy(KV, rl, stride_kvn, 0, lat_s.index(t), offs_d_lat)
            _gl_copy(KV, rp, stride_kvn, D_LAT, pe_s.index(t), offs_d_pe)
            async_copy.commit_group()
        # index tiles are read one iteration ahead of their use (their latency off the loop's path)
        rl = _gl_rows(idx_row, start, end, NUM_BUF - 1, num_slots, offs_n_lat, BLOCK_N)
        rp = _gl_rows(idx_row, start, end, NUM_BUF - 1, num_slots, offs_n_pe, BLOCK_N)
        vs = _gl_valid_s(idx_row, start, end, 0, num_slots, offs_n_s, BLOCK_N)
        # q [BLOCK_H, D_LAT] and [BLOCK_H, D_ROPE] -> shared (once), while the first tiles fly
        q_row = Q + b.to(gl.int64) * stride_qb
        q_lat = gl.load(q_row + offs_h_lat[:, None] * stride_qh + offs_d_lat[None, :],
                        mask=(offs_h_lat < num_heads)[:, None], other=0.0)
        q_pe = gl.load(q_row + offs_h_pe[:, None] * stride_qh + D_LAT + offs_d_pe[None, :],
                       mask=(offs_h_pe < num_heads)[:, None], other=0.0)
        q_lat_s = gl.allocate_shared_memory(dtype, [BLOCK_H, D_LAT], sh, q_lat)
        q_pe_s = gl.allocate_shared_memory(dtype, [BLOCK_H, D_ROPE], sh, q_pe)
        for t in range(0, n_tiles):
            cur = t % NUM_BUF
            # the slot of tile t-1 (its value MMA finished last iteration) gets tile t+NUM_BUF-1
            nxt = (t + NUM_BUF - 1) % NUM_BUF
            if LATE_ISSUE:
                # tile t landed; past this barrier every warpgroup is done with tile t-1
                async_copy.wait_group(NUM_BUF - 2)
                fence_async_shared()
                gl.thread_barrier()
            _gl_copy(KV, rl, stride_kvn, 0, lat_s.index(nxt), offs_d_lat)
            _gl_copy(KV, rp, stride_kvn, D_LAT, pe_s.index(nxt), offs_d_pe)
            async_copy.commit_group()
            rl = _gl_rows(idx_row, start, end, t + NUM_BUF, num_slots, offs_n_lat, BLOCK_N)
            rp = _gl_rows(idx_row, start, end, t + NUM_BUF, num_slots, offs_n_pe, BLOCK_N)
            valid = vs
            vs = _gl_valid_s(idx_row, start, end, t + 1, num_slots, offs_n_s, BLOCK_N)
            if not LATE_ISSUE:
                async_copy.wait_group(NUM_BUF - 1)      # tile t landed (tile t+NUM_BUF-1 may fly)
                fence_async_shared()
                gl.thread_barrier()
            kl = lat_s.index(cur)
            s_tok = warpgroup_mma(q_lat_s, kl.permute((1, 0)), zero_s, is_async=True)
            s_tok = warpgroup_mma(q_pe_s, pe_s.index(cur).permute((1, 0)), s_tok, is_async=True)
            s = warpgroup_mma_wait(num_outstanding=0, deps=[s_tok])
            s = s * qk_scale_log2
            s = gl.where(valid[None, :], s, float("-inf"))
            m_new = gl.maximum(m_i, gl.max(s, axis=1))
            m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = gl.exp2(m_i - m_safe)
            p = gl.exp2(s - m_safe[:, None])
            l2 = l2 * alpha[:, None] + p
            m_i = m_new
            o = o * gl.convert_layout(alpha, gl.SliceLayout(1, mma_o))[:, None]
            p_s.store(p.to(dtype))
            fence_async_shared()
            gl.thread_barrier()
            o_tok = warpgroup_mma(p_s, kl, o, is_async=True)
            o = warpgroup_mma_wait(num_outstanding=0, deps=[o_tok])
            if not LATE_ISSUE:
                gl.thread_barrier()                     # slot `cur` and P free for the next gather
        async_copy.wait_group(0)

        l_i = gl.convert_layout(gl.sum(l2, axis=1), gl.SliceLayout(1, mma_o))
        has = l_i > 0
        l_safe = gl.where(has, l_i, 1.0)
        out = o / l_safe[:, None]
        offs_h = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, mma_o))
        offs_d = gl.arange(0, D_LAT, layout=gl.SliceLayout(0, mma_o))
        h_mask = (offs_h < num_heads)[:, None]
        if not SPLIT:
            gl.store(Out + b.to(gl.int64) * stride_ob + offs_h[:, None] * stride_oh + offs_d[None, :],
                     out.to(Out.dtype.element_ty), mask=h_mask)
        else:
            m_o = gl.convert_layout(m_i, gl.SliceLayout(1, mma_o))
            lse = gl.where(has, (m_o + gl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
            gl.store(OutPartial + b.to(gl.int64) * stride_pb + offs_h[:, None] * stride_ph + split * stride_ps
                     + offs_d[None, :], out, mask=h_mask)
            gl.store(LsePartial + b.to(gl.int64) * stride_lb + offs_h * stride_lh + split, lse,
                     mask=offs_h < num_heads)

    @gluon.jit
    def _gl_valid_s(idx_row, start, end, t, num_slots, offs_n_s, BLOCK_N: gl.constexpr):
        offs = start + t * BLOCK_N + offs_n_s
        in_row = offs < end
        idx = gl.load(idx_row + offs, mask=in_row, other=-1)
        return in_row & (idx >= 0) & (idx < num_slots)

    _HAS_GLUON = True
except Exception as _e:  # noqa: BLE001 - older/newer Triton without this Gluon API
    _HAS_GLUON = False
    _GLUON_ERROR = repr(_e)


def _check_mla(q: torch.Tensor, kv_buffer: torch.Tensor, indices: torch.Tensor, kv_lora_rank: int) -> torch.Tensor:
    """Validate; returns kv as a 2-D ``[num_slots, Dl + Dr]`` view."""
    if not isinstance(q, torch.Tensor) or q.dim() != 3:
        _fail("q", "a [B, H, kv_lora_rank + rope_dim] tensor", getattr(q, "shape", type(q)))
    if q.dtype not in _FLOAT_DTYPES:
        _fail("q", f"of dtype in {_FLOAT_DTYPES}", q.dtype)
    if not isinstance(kv_buffer, torch.Tensor) or kv_buffer.dim() not in (2, 3) or (
            kv_buffer.dim() == 3 and kv_buffer.shape[1] != 1):
        _fail("kv_buffer", "a [num_slots, 1, kv_lora_rank + rope_dim] tensor", getattr(kv_buffer, "shape", type(kv_buffer)))
    kv = kv_buffer.reshape(kv_buffer.shape[0], kv_buffer.shape[-1]) if kv_buffer.dim() == 3 else kv_buffer
    if kv.dtype != q.dtype:
        _fail("kv_buffer", f"of q's dtype {q.dtype}", kv.dtype)
    if kv.device != q.device:
        _fail("kv_buffer", f"on q's device {q.device}", kv.device)
    if kv.shape[1] != q.shape[2]:
        _fail("kv_buffer", f"with last dim {q.shape[2]} (q's)", kv.shape[1])
    if not isinstance(kv_lora_rank, int) or not (0 < kv_lora_rank < q.shape[2]):
        _fail("kv_lora_rank", f"an int in (0, {q.shape[2]})", kv_lora_rank)
    if kv.stride(1) != 1 or q.stride(2) != 1:
        _fail("kv_buffer/q", "contiguous in the last dim", (kv.stride(), q.stride()))
    if not isinstance(indices, torch.Tensor) or indices.dim() != 2 or indices.shape[0] != q.shape[0]:
        _fail("indices", f"a [B={q.shape[0]}, K] tensor", getattr(indices, "shape", type(indices)))
    if indices.dtype not in (torch.int32, torch.int64):
        _fail("indices", "int32 or int64", indices.dtype)
    if indices.device != q.device:
        _fail("indices", f"on q's device {q.device}", indices.device)
    return kv


def _split_tokens(K: int, splits: int, block_n: int) -> tuple[int, int]:
    """(splits, tokens per split): splits clamped, each split a whole number of tiles."""
    splits = max(1, min(int(splits), _MAX_SPLITS))
    tps = -(-max(1, K) // splits)
    tps = -(-tps // block_n) * block_n
    return max(1, -(-max(1, K) // tps)), tps


def _two_pass(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, out: torch.Tensor,
              Dl: int, sm_scale: float, cfg: MlaTwoPassConfig) -> torch.Tensor:
    B, H, Dq = q.shape
    K = indices.shape[1]
    if K == 0:
        return out.zero_()
    dot_f32 = dot_in_fp32(q)
    bh1 = max(16, min(cfg.score_block_h, triton.next_power_of_2(H)))
    nblk = -(-K // cfg.score_block_n)
    scores = torch.empty((B, H, K), dtype=torch.float32, device=q.device)
    mblk = torch.empty((B, H, nblk), dtype=torch.float32, device=q.device)
    _mla_scores[(nblk, B, -(-H // bh1))](
        q, kv, indices, scores, mblk,
        float(sm_scale) * 1.4426950408889634,
        q.stride(0), q.stride(1), kv.stride(0), indices.stride(0),
        scores.stride(0), scores.stride(1), mblk.stride(0), mblk.stride(1),
        H, K, kv.shape[0],
        D=Dq, BLOCK_H=bh1, BLOCK_N=cfg.score_block_n, BLOCK_K=cfg.score_block_k, DOT_F32=dot_f32,
        num_warps=cfg.score_warps, num_stages=cfg.score_stages,
    )
    bh2 = max(16, min(cfg.pv_block_h, triton.next_power_of_2(H)))
    block_dl = max(16, triton.next_power_of_2(Dl))
    bdv = max(16, min(triton.next_power_of_2(cfg.pv_block_dv), block_dl))
    num_dvb = block_dl // bdv
    work = -(-H // bh2) * num_dvb
    splits, tps = _split_tokens(K, cfg.num_splits or mla_num_splits(B * work, K, cfg.pv_block_n, sm_count(q.device)),
                                cfg.pv_block_n)
    if splits > 1:
        part = torch.empty((B, H, splits, Dl), dtype=torch.float32, device=q.device)
        lse = torch.empty((B, H, splits), dtype=torch.float32, device=q.device)
        pstr = (part.stride(0), part.stride(1), part.stride(2), lse.stride(0), lse.stride(1))
    else:
        part, lse, pstr = out, out, (0, 0, 0, 0, 0)
    _mla_pv[(work, B, splits)](
        scores, mblk, kv, indices, out, part, lse,
        scores.stride(0), scores.stride(1), mblk.stride(0), mblk.stride(1),
        kv.stride(0), indices.stride(0),
        out.stride(0), out.stride(1),
        *pstr,
        H, K, tps, kv.shape[0], nblk,
        D_LAT=Dl, BLOCK_H=bh2, BLOCK_N=cfg.pv_block_n, BLOCK_DV=bdv,
        BLOCK_NB=max(2, triton.next_power_of_2(nblk)), NUM_DVB=num_dvb, SPLIT=splits > 1, DOT_F32=dot_f32,
        num_warps=cfg.pv_warps, num_stages=cfg.pv_stages,
    )
    if splits > 1:
        merge_splits(part, lse, out, block_dl)
    return out


def _gluon_ok(q: torch.Tensor, Dl: int, Dr: int) -> bool:
    """Gluon kernel usable here: Triton with the Gluon API, a Hopper GPU (not the
    interpreter), 16-bit inputs, a power-of-two latent of 64..512 and a rope part of 64."""
    if not (_HAS_GLUON and q.is_cuda and not interpreter_enabled()):
        return False
    if torch.cuda.get_device_capability(q.device)[0] != 9 or q.dtype not in (torch.float16, torch.bfloat16):
        return False
    return Dl in (64, 128, 256, 512) and Dr == 64


def _gluon(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, out: torch.Tensor,
           Dl: int, sm_scale: float, cfg: MlaGluonConfig) -> torch.Tensor:
    B, H, Dq = q.shape
    K = indices.shape[1]
    if cfg.block_n not in (32, 64) or not (1 <= cfg.num_buf <= 4) or (cfg.late_issue and cfg.num_buf < 2):
        _fail("config", "an MlaGluonConfig with block_n in (32, 64), num_buf in 1..4 (>= 2 with late_issue)", cfg)
    head_blocks = -(-H // 64)
    splits, tps = _split_tokens(K, cfg.num_splits or mla_num_splits(B * head_blocks, K, cfg.block_n, sm_count(q.device)),
                                cfg.block_n)
    return _launch_split(_mla_gluon_kernel, (head_blocks, B, splits), q, kv, indices, out, sm_scale, tps, splits,
                         D_LAT=Dl, D_ROPE=Dq - Dl, BLOCK_H=64, BLOCK_N=cfg.block_n, NUM_BUF=cfg.num_buf,
                         LATE_ISSUE=cfg.late_issue, num_warps=8)


def _launch_split(kernel, grid: tuple[int, int, int], q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor,
                  out: torch.Tensor, sm_scale: float, tokens_per_split: int, splits: int, **meta) -> torch.Tensor:
    """Launch an MLA decode kernel (the fused Triton one or the Gluon one: same leading
    arguments) over ``grid = (head blocks, B, splits)``; with ``splits > 1`` each split writes
    fp32 partials ``[B, H, splits, Dl]`` and their log-sum-exp, merged into ``out``."""
    B, H, _ = q.shape
    Dl = out.shape[2]
    if splits > 1:
        part = torch.empty((B, H, splits, Dl), dtype=torch.float32, device=q.device)
        lse = torch.empty((B, H, splits), dtype=torch.float32, device=q.device)
        pstr = (part.stride(0), part.stride(1), part.stride(2), lse.stride(0), lse.stride(1))
    else:
        part, lse, pstr = out, out, (0, 0, 0, 0, 0)
    kernel[grid](
        q, kv, indices, out, part, lse,
        float(sm_scale) * 1.4426950408889634,
        q.stride(0), q.stride(1), kv.stride(0), indices.stride(0),
        out.stride(0), out.stride(1),
        *pstr,
        H, indices.shape[1], tokens_per_split, kv.shape[0],
        SPLIT=splits > 1, **meta,
    )
    if splits > 1:
        merge_splits(part, lse, out, max(16, triton.next_power_of_2(Dl)))
    return out


def sparse_mla_decode_triton(q: torch.Tensor, kv_buffer: torch.Tensor, indices: torch.Tensor, *,
                             kv_lora_rank: int, sm_scale: float,
                             config: Optional[MlaLaunchConfig | MlaGluonConfig | MlaTwoPassConfig] = None) -> torch.Tensor:
    """Triton sparse MLA decode.

    q:          ``[B, H, kv_lora_rank + rope_dim]`` fp16/bf16 absorbed query.
    kv_buffer:  ``[num_slots, 1, kv_lora_rank + rope_dim]`` (or ``[num_slots, Dl+Dr]``).
    indices:    ``[B, K]`` int32 slots, ``-1`` padding (masked wherever it is).
    config:     :class:`MlaLaunchConfig` (fused kernel), :class:`MlaGluonConfig` (Hopper
                Gluon kernel; Triton fallback elsewhere) or :class:`MlaTwoPassConfig`
                (score GEMM + value pass); None = the Gluon kernel on Hopper for launches of
                at least ``GLUON_MIN_HEAD_BLOCKS`` 64-head blocks, else :func:`default_mla_config`.
    Returns ``[B, H, kv_lora_rank]`` in q's dtype; rows without a valid index are zeros.
    """
    kv = _check_mla(q, kv_buffer, indices, kv_lora_rank)
    B, H, Dq = q.shape
    Dl, Dr = kv_lora_rank, Dq - kv_lora_rank
    K = indices.shape[1]
    out = torch.empty((B, H, Dl), dtype=q.dtype, device=q.device)
    if B == 0:
        return out
    if indices.stride(1) != 1:
        indices = indices.contiguous()
    if config is None and B * (-(-H // 64)) >= GLUON_MIN_HEAD_BLOCKS and _gluon_ok(q, Dl, Dr):
        config = MlaGluonConfig()
    cfg = config or default_mla_config(q.device, H, B, K)
    if isinstance(cfg, MlaTwoPassConfig):
        return _two_pass(q, kv, indices, out, Dl, sm_scale, cfg)
    if isinstance(cfg, MlaGluonConfig):
        if _gluon_ok(q, Dl, Dr):
            announce_path("sparse_mla_decode", "gluon")
            return _gluon(q, kv, indices, out, Dl, sm_scale, cfg)
        announce_path("sparse_mla_decode", "triton (gluon unavailable)")
        cfg = (MlaLaunchConfig(block_h=64, block_n=64, num_warps=8, num_stages=3, num_splits=cfg.num_splits)
               if q.is_cuda and not interpreter_enabled() else
               MlaLaunchConfig(block_h=16, block_n=16, num_warps=4, num_stages=1, num_splits=cfg.num_splits))
    if not isinstance(cfg, MlaLaunchConfig):
        _fail("config", "an MlaLaunchConfig, an MlaGluonConfig, an MlaTwoPassConfig or None", type(cfg).__name__)
    block_h = max(16, min(cfg.block_h, triton.next_power_of_2(H)))
    head_blocks = -(-H // block_h)
    splits, tps = _split_tokens(K, cfg.num_splits or mla_num_splits(B * head_blocks, K, cfg.block_n, sm_count(q.device)),
                                cfg.block_n)
    return _launch_split(_mla_stage1, (head_blocks, B, splits), q, kv, indices, out, sm_scale, tps, splits,
                         D_LAT=Dl, D_ROPE=Dr, BLOCK_H=block_h, BLOCK_N=cfg.block_n,
                         BLOCK_DL=max(16, triton.next_power_of_2(Dl)), BLOCK_DR=max(16, triton.next_power_of_2(Dr)),
                         DOT_F32=dot_in_fp32(q), ROW_LOAD=cfg.row_load,
                         num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def sparse_mla_decode_reference(q: torch.Tensor, kv_buffer: torch.Tensor, indices: torch.Tensor, *,
                                kv_lora_rank: int, sm_scale: float,
                                config: Optional[MlaLaunchConfig | MlaGluonConfig | MlaTwoPassConfig] = None) -> torch.Tensor:
    """Torch reference of :func:`sparse_mla_decode_triton` (same arguments and result)."""
    kv = _check_mla(q, kv_buffer, indices, kv_lora_rank)
    idx = indices.long()
    valid = (idx >= 0) & (idx < kv.shape[0])
    rows = kv[torch.where(valid, idx, torch.zeros_like(idx))].float()      # [B, K, Dl+Dr]
    s = torch.einsum("bhd,bkd->bhk", q.float(), rows) * sm_scale
    s = s.masked_fill(~valid[:, None, :], float("-inf"))
    p = torch.nan_to_num(torch.softmax(s, dim=-1), nan=0.0)
    return torch.einsum("bhk,bkd->bhd", p, rows[..., :kv_lora_rank]).to(q.dtype)


def sparse_mla_decode(q: torch.Tensor, kv_buffer: torch.Tensor, indices: torch.Tensor, *,
                      kv_lora_rank: int, sm_scale: float,
                      config: Optional[MlaLaunchConfig | MlaGluonConfig | MlaTwoPassConfig] = None) -> torch.Tensor:
    """Sparse MLA decode; Triton on CUDA, the torch reference elsewhere."""
    impl = dispatch("sparse_mla_decode", q, sparse_mla_decode_triton, sparse_mla_decode_reference)
    return impl(q, kv_buffer, indices, kv_lora_rank=kv_lora_rank, sm_scale=sm_scale, config=config)
