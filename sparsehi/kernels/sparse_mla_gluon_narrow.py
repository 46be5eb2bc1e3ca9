"""Sparse MLA decode on Hopper in Gluon for narrow head blocks (16 or 32 query heads a
request, the per-GPU head count of DeepSeek under tensor parallelism;
``MlaGluonConfig.token_rows``): :func:`_mla_gluon_narrow_kernel`.

The 64-head kernels pad 16 heads to the MMA's 64 rows and so run 4x the MMA work the
heads need. Here the tokens are the MMA's rows and the heads its columns: the score MMA is
``S^T = K Q^T`` (``[BLOCK_N tokens, BLOCK_H]``), the softmax runs down each column and
the value MMA is ``O^T += V^T P^T`` (``[D_LAT, BLOCK_H]``, ``V^T`` the latent tile read
transposed from shared memory, ``P^T`` through shared memory). One warpgroup runs the MMAs
and the softmax (over 16-bit rows at 16-head blocks two, on alternate tiles,
``MlaGluonConfig.mma_groups``); the producer warps of ``sparse_mla_gluon_ws`` fill the ring
of 16-bit tiles: over FP8 rows one warpgroup scaling the tiles (two scaling alternate tiles
at 16-head blocks), over 16-bit rows one gathering by ``cp.async``.
"""
from __future__ import annotations

import torch

from sparsehi.kernels.mla_fp8_latents import FP8_TILE
from sparsehi.kernels.sparse_mla_common import launch_split
from sparsehi.kernels.sparse_mla_gluon import MlaGluonConfig, token_rows_mma_groups
from sparsehi.kernels.sparse_mla_gluon_ws import producer_operands

# registers of a launch by (FP8 rows, MMA warpgroups, producer warpgroups): the kernel's
# maxnreg (65536 over its warps, rounded down to 8), each producer's and the second MMA
# warpgroup's; the first MMA warpgroup (the kernel's own warps) gets the rest. One MMA
# warpgroup: 184 a thread beside one producer (FP8 152, gather 112), 200 beside two FP8
# producers of 152 (alternate tiles, two tiles' loads in flight; at 16-head blocks, where
# they win). Two MMA warpgroups, 200 and 192, beside the gather's 112 (sm_90 builds: 4 bytes
# spilled there, none otherwise; docs/kernels.md)
_LAUNCH_REGS = {
    (True, 1, 1): (184, 152, 0),
    (True, 1, 2): (168, 152, 0),
    (False, 1, 1): (184, 112, 0),
    (False, 2, 1): (168, 112, 192),
}

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                                  warpgroup_mma_wait)

    from sparsehi.kernels.sparse_mla_gluon import _gl_q_tile, _gl_split_range, _gl_valid_s
    from sparsehi.kernels.sparse_mla_gluon_ws import _gl_fp8_scale_partition, _gl_producer_partition

    @gluon.jit
    def _gl_token_rows_partition(q_lat_s, q_pe_s, lat_s, pe_s, pt_s, ready, empty, idx_row, start, end, num_slots,
                                 n_tiles, qk_scale_log2, Out, OutPartial, LsePartial, b, hb, split, num_heads,
                                 stride_ob, stride_oh, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
                                 o_sh, m_sh, l_sh, merged, D_LAT: gl.constexpr, BLOCK_H: gl.constexpr,
                                 BLOCK_N: gl.constexpr, SPLIT: gl.constexpr, FIRST: gl.constexpr,
                                 STEP: gl.constexpr):
        """MMA warpgroup of :func:`_mla_gluon_narrow_kernel` for tiles ``FIRST, FIRST + STEP,
        ..``: for each, once its slot is ready, ``S^T = K Q^T`` over the latent and rope
        tiles, the online softmax down each head's column (running max ``m_i``; the sums
        ``l_i`` kept per thread and reduced after the loop), ``P^T`` into its shared tile
        ``pt_s`` and ``O^T += V^T P^T``; then the slot is freed (``empty``). At the end ``O``
        (or the split's fp32 partial and log-sum-exp) is stored, transposed back. With two MMA
        warpgroups (``STEP`` 2) the one of the odd tiles hands its ``O^T``, max and sums over
        ``o_sh`` / ``m_sh`` / ``l_sh`` to the one of the even tiles (``merged``), which merges
        them into its own before the store."""
        NUM_BUF: gl.constexpr = lat_s.shape[0]
        mma_s: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, BLOCK_H, 16])
        mma_o: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, BLOCK_H, 16])
        cols_s: gl.constexpr = gl.SliceLayout(0, mma_s)
        cols_o: gl.constexpr = gl.SliceLayout(0, mma_o)
        offs_n_s = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, mma_s))
        m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=cols_s)
        l_tok = gl.zeros([BLOCK_N, BLOCK_H], gl.float32, layout=mma_s)   # per-thread partial sums
        zero_s = gl.zeros([BLOCK_N, BLOCK_H], gl.float32, layout=mma_s)
        o = gl.zeros([D_LAT, BLOCK_H], gl.float32, layout=mma_o)
        vs = _gl_valid_s(idx_row, start, end, FIRST, num_slots, offs_n_s, BLOCK_N)
        for t in range(FIRST, n_tiles, STEP):
            slot = t % NUM_BUF
            lat = lat_s.index(slot)
            valid = vs
            vs = _gl_valid_s(idx_row, start, end, t + STEP, num_slots, offs_n_s, BLOCK_N)
            mbarrier.wait(ready.index(slot), (t // NUM_BUF) & 1)
            s_tok = warpgroup_mma(lat, q_lat_s.permute((1, 0)), zero_s, use_acc=False, is_async=True)
            s_tok = warpgroup_mma(pe_s.index(slot), q_pe_s.permute((1, 0)), s_tok, is_async=True)
            st = warpgroup_mma_wait(num_outstanding=0, deps=[s_tok])
            st = gl.where(valid[:, None], st * qk_scale_log2, float("-inf"))
            m_new = gl.maximum(m_i, gl.max(st, axis=0))
            m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = gl.exp2(m_i - m_safe)
            p = gl.exp2(st - m_safe[None, :])
            l_tok = l_tok * alpha[None, :] + p     # summed down the tokens once, after the loop
            m_i = m_new
            pt_s.store(p.to(pt_s.dtype))        # the previous tile's value MMA has completed
            fence_async_shared()
            gl.thread_barrier()
            o = o * gl.convert_layout(alpha, cols_o)[None, :]
            o_tok = warpgroup_mma(lat.permute((1, 0)), pt_s, o, is_async=True)
            o = warpgroup_mma_wait(num_outstanding=0, deps=[o_tok])
            gl.thread_barrier()
            mbarrier.arrive(empty.index(slot), count=1)
        l_i = gl.sum(l_tok, axis=0)
        if STEP == 2 and FIRST == 1:
            o_sh.store(o)
            m_sh.store(m_i)
            l_sh.store(l_i)
            fence_async_shared()
            gl.thread_barrier()
            mbarrier.arrive(merged, count=1)
        else:
            if STEP == 2:
                mbarrier.wait(merged, 0)
                m_b = m_sh.load(cols_s)
                m_new = gl.maximum(m_i, m_b)
                m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
                alpha = gl.exp2(m_i - m_safe)
                beta = gl.exp2(m_b - m_safe)
                l_i = l_i * alpha + l_sh.load(cols_s) * beta
                m_i = m_new
                o = (o * gl.convert_layout(alpha, cols_o)[None, :]
                     + o_sh.load(mma_o) * gl.convert_layout(beta, cols_o)[None, :])
            l_o = gl.convert_layout(l_i, cols_o)
            has = l_o > 0
            l_safe = gl.where(has, l_o, 1.0)
            out = o / l_safe[None, :]
            offs_d = gl.arange(0, D_LAT, layout=gl.SliceLayout(1, mma_o))
            offs_h = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=cols_o)
            h_ok = offs_h < num_heads
            if not SPLIT:
                gl.store(Out + b.to(gl.int64) * stride_ob + offs_h[None, :] * stride_oh + offs_d[:, None],
                         out.to(Out.dtype.element_ty), mask=h_ok[None, :])
            else:
                gl.store(OutPartial + b.to(gl.int64) * stride_pb + offs_h[None, :] * stride_ph + split * stride_ps
                         + offs_d[:, None], out, mask=h_ok[None, :])
                lse = gl.where(has, (gl.convert_layout(m_i, cols_o) + gl.log2(l_safe)) * 0.6931471805599453,
                               float("-inf"))
                gl.store(LsePartial + b.to(gl.int64) * stride_lb + offs_h * stride_lh + split, lse, mask=h_ok)

    @gluon.jit
    def _mla_gluon_narrow_kernel(
        Q, KV, Idx, Out, OutPartial, LsePartial,
        qk_scale_log2,
        stride_qb, stride_qh, stride_kvn, stride_ib,
        stride_ob, stride_oh,
        stride_pb, stride_ph, stride_ps,
        stride_lb, stride_lh,
        num_heads, num_idx, tokens_per_split, num_slots,
        Scales, Rope, stride_sn, stride_rn,
        D_LAT: gl.constexpr, D_ROPE: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr,
        NUM_BUF: gl.constexpr, TILE: gl.constexpr, SPLIT: gl.constexpr,
        PRODUCER_REGS: gl.constexpr, FP8: gl.constexpr, FP8_PRODUCERS: gl.constexpr,
        MMA_GROUPS: gl.constexpr, MMA_REGS: gl.constexpr,
    ):
        """Sparse MLA decode for ``BLOCK_H`` (16 or 32) heads a program with the tokens as
        the MMA's rows: ``MMA_GROUPS`` MMA warpgroups (:func:`_gl_token_rows_partition`; the
        kernel's 4 warps, and with two a second warpgroup of ``MMA_REGS`` registers a thread,
        the two taking the even and the odd tiles and merging their results through shared
        memory at the end) and producer warps (``PRODUCER_REGS`` registers a thread; FP8 rows:
        ``FP8_PRODUCERS`` warpgroups of ``_gl_fp8_scale_partition``, two taking the even and
        the odd tiles, each with its own slot of the 2-slot ring; 16-bit rows: one of
        ``_gl_gather_partition``) over a ``NUM_BUF``-deep ring of 16-bit tiles, passed through
        mbarriers ``ready`` and ``empty``. Two MMA warpgroups run over 16-bit rows only
        (``check_gluon_config``)."""
        hb, b, split, start, end, n_tiles = _gl_split_range(tokens_per_split, num_idx, BLOCK_N)

        sh: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        dtype: gl.constexpr = Q.dtype.element_ty
        lat_s = gl.allocate_shared_memory(dtype, [NUM_BUF, BLOCK_N, D_LAT], sh)
        pe_s = gl.allocate_shared_memory(dtype, [NUM_BUF, BLOCK_N, D_ROPE], sh)
        sh_p: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_H], dtype)
        pt_s = gl.allocate_shared_memory(dtype, [MMA_GROUPS, BLOCK_N, BLOCK_H], sh_p)
        ready = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(NUM_BUF):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=1)
        if MMA_GROUPS == 2:
            sh_v: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
            sh_o: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
            o_sh = gl.allocate_shared_memory(gl.float32, [D_LAT, BLOCK_H], sh_o)
            m_sh = gl.allocate_shared_memory(gl.float32, [BLOCK_H], sh_v)
            l_sh = gl.allocate_shared_memory(gl.float32, [BLOCK_H], sh_v)
            merged = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout()).index(0)
            mbarrier.init(merged, count=1)
        else:      # unread
            o_sh = pt_s
            m_sh = pt_s
            l_sh = pt_s
            merged = ready.index(0)

        q_lat_s, q_pe_s = _gl_q_tile(Q + b.to(gl.int64) * stride_qb, stride_qh, num_heads, hb, sh, BLOCK_H, D_LAT,
                                     D_ROPE)
        idx_row = Idx + b.to(gl.int64) * stride_ib
        if FP8 and FP8_PRODUCERS == 2:
            gl.warp_specialize([
                (_gl_token_rows_partition, (q_lat_s, q_pe_s, lat_s, pe_s, pt_s.index(0), ready, empty, idx_row, start,
                                            end, num_slots, n_tiles, qk_scale_log2, Out, OutPartial, LsePartial, b,
                                            hb, split, num_heads, stride_ob, stride_oh, stride_pb, stride_ph,
                                            stride_ps, stride_lb, stride_lh, o_sh, m_sh, l_sh, merged, D_LAT,
                                            BLOCK_H, BLOCK_N, SPLIT, 0, 1)),
                (_gl_fp8_scale_partition, (KV, Scales, Rope, idx_row, start, end, num_slots, n_tiles, stride_kvn,
                                           stride_sn, stride_rn, lat_s, pe_s, ready, empty, D_LAT, D_ROPE, BLOCK_N,
                                           TILE, 0, 2)),
                (_gl_fp8_scale_partition, (KV, Scales, Rope, idx_row, start, end, num_slots, n_tiles, stride_kvn,
                                           stride_sn, stride_rn, lat_s, pe_s, ready, empty, D_LAT, D_ROPE, BLOCK_N,
                                           TILE, 1, 2)),
            ], [4, 4], [PRODUCER_REGS, PRODUCER_REGS])
        elif MMA_GROUPS == 2:
            gl.warp_specialize([
                (_gl_token_rows_partition, (q_lat_s, q_pe_s, lat_s, pe_s, pt_s.index(0), ready, empty, idx_row, start,
                                            end, num_slots, n_tiles, qk_scale_log2, Out, OutPartial, LsePartial, b,
                                            hb, split, num_heads, stride_ob, stride_oh, stride_pb, stride_ph,
                                            stride_ps, stride_lb, stride_lh, o_sh, m_sh, l_sh, merged, D_LAT,
                                            BLOCK_H, BLOCK_N, SPLIT, 0, 2)),
                (_gl_token_rows_partition, (q_lat_s, q_pe_s, lat_s, pe_s, pt_s.index(1), ready, empty, idx_row, start,
                                            end, num_slots, n_tiles, qk_scale_log2, Out, OutPartial, LsePartial, b,
                                            hb, split, num_heads, stride_ob, stride_oh, stride_pb, stride_ph,
                                            stride_ps, stride_lb, stride_lh, o_sh, m_sh, l_sh, merged, D_LAT,
                                            BLOCK_H, BLOCK_N, SPLIT, 1, 2)),
                (_gl_producer_partition, (KV, Scales, Rope, idx_row, start, end, num_slots, n_tiles, stride_kvn,
                                          stride_sn, stride_rn, lat_s, pe_s, ready, empty, D_LAT, D_ROPE, BLOCK_N,
                                          TILE, 0, 1, FP8, lat_s, lat_s, lat_s, 0)),
            ], [4, 4], [MMA_REGS, PRODUCER_REGS])
        else:
            gl.warp_specialize([
                (_gl_token_rows_partition, (q_lat_s, q_pe_s, lat_s, pe_s, pt_s.index(0), ready, empty, idx_row, start,
                                            end, num_slots, n_tiles, qk_scale_log2, Out, OutPartial, LsePartial, b,
                                            hb, split, num_heads, stride_ob, stride_oh, stride_pb, stride_ph,
                                            stride_ps, stride_lb, stride_lh, o_sh, m_sh, l_sh, merged, D_LAT,
                                            BLOCK_H, BLOCK_N, SPLIT, 0, 1)),
                (_gl_producer_partition, (KV, Scales, Rope, idx_row, start, end, num_slots, n_tiles, stride_kvn,
                                          stride_sn, stride_rn, lat_s, pe_s, ready, empty, D_LAT, D_ROPE, BLOCK_N,
                                          TILE, 0, 1, FP8, lat_s, lat_s, lat_s, 0)),
            ], [4], [PRODUCER_REGS])

    _HAS_NARROW = True
except Exception as _e:  # noqa: BLE001 - a Triton without this Gluon API: gluon_ok is False there too
    _HAS_NARROW = False
    _NARROW_ERROR = repr(_e)


def launch_narrow(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, out: torch.Tensor, sm_scale: float,
                  grid: tuple[int, int, int], tokens_per_split: int, splits: int, cfg: MlaGluonConfig, Dl: int,
                  block_h: int, *, fp8: bool) -> torch.Tensor:
    """Launch :func:`_mla_gluon_narrow_kernel` with ``block_h`` heads a program over ``kv``
    (FP8 rows where ``fp8``, else 16-bit rows) for ``q [B, H, Dl + Dr]``, ``indices [B, K]``
    int32 into ``out [B, H, Dl]`` (the caller, ``sparse_mla_gluon``, has checked the inputs
    and ``cfg``)."""
    groups = token_rows_mma_groups(cfg, fp8, block_h, tokens_per_split)
    producers = 2 if fp8 and block_h == 16 else 1
    maxnreg, regs, mma_regs = _LAUNCH_REGS[(fp8, groups, producers)]
    extra = producer_operands(kv, Dl, regs, fp8=fp8)
    return launch_split(_mla_gluon_narrow_kernel, grid, q, kv, indices, out, sm_scale, tokens_per_split, splits,
                        D_LAT=Dl, D_ROPE=q.shape[2] - Dl, BLOCK_H=block_h, BLOCK_N=cfg.block_n, NUM_BUF=cfg.num_buf,
                        TILE=FP8_TILE, FP8=fp8, FP8_PRODUCERS=producers, MMA_GROUPS=groups, MMA_REGS=mma_regs,
                        maxnreg=maxnreg, num_warps=4, **extra)
