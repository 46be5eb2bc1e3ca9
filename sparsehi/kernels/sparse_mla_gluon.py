"""Sparse MLA decode on Hopper in Gluon (:class:`MlaGluonConfig`; the rows and indices as
``sparse_mla_decode``, which runs these kernels by default for large launches on Hopper,
through ``sparse_mla_gluon_launch``).

:func:`_mla_gluon_kernel` sets its layouts explicitly: one 64-head block on 8 warps (two
warpgroups) splits both the score MMA's tokens and the value MMA's latent columns over the
warpgroups (``warps [4, 2]``), passes ``P`` to the value MMA through shared memory, gathers
KV rows by ``cp.async`` into a ``NUM_BUF``-deep shared ring and reads the index tiles one
iteration ahead. Split-K as the fused kernel (``sparse_mla_common.launch_split``). This module also holds
the config checks and the Gluon helpers the warp-specialised kernel shares.
:func:`_mla_gluon_fp8_kernel` is the same loop over FP8 latent rows (``mla_fp8_latents``):
the ring holds their E4M3 bytes, which the warps scale into one 16-bit tile before the MMAs.
``sparse_mla_gluon_ws`` (the default over FP8 rows; ``MlaGluonConfig.producer_warps``) splits
the loop over three warpgroups: producer warps fill a ring of 16-bit tiles (FP8 rows:
loaded into registers and scaled; 16-bit rows: gathered by ``cp.async``), a score warpgroup
runs the score MMA, the softmax and half the value MMA, a value warpgroup the other half.
``gluon_ok`` says where each runs (Triton with this Gluon API, a Hopper GPU, 16-bit q; FP8
rows: bf16 q, DeepSeek's 512 + 64 layout on 16-byte boundaries). Their measurements and
the variants tried: docs/kernels.md.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from hicache.triton_support import interpreter_enabled
from sparsehi.kernels.flash_decoding import fail
from sparsehi.kernels.mla_fp8_latents import fp8_row_bytes


@dataclass(frozen=True)
class MlaGluonConfig:
    """Hopper Gluon kernels :func:`_mla_gluon_kernel` / :func:`_mla_gluon_fp8_kernel` (64-head
    blocks, 8 warps): ``block_n`` tokens per tile, a ``num_buf``-deep cp.async ring (64 x 2
    fills the shared memory; 32-token tiles take up to 4). ``late_issue``: issue the next
    tile's gather after the loop-top barrier instead of behind a trailing one (16-bit rows
    only: over FP8 rows it is a ValueError, as is a ring that does not fit,
    :func:`check_gluon_config`). ``producer_warps``: 4 runs the warp-specialised
    ``sparse_mla_gluon_ws._mla_gluon_ws_kernel`` (a producer warpgroup fills a ring of 16-bit tiles, a score
    and a value warpgroup consume it; not with ``late_issue``), 0 the 8-warp kernels
    (:func:`_mla_gluon_kernel`, :func:`_mla_gluon_fp8_kernel`, whose MMA warps scale each
    FP8 tile themselves); None: 4 over FP8 rows, ``WS_DEFAULT_BF16`` over 16-bit rows.
    ``token_rows`` (up to 32 heads; 64-token tiles x 2, producer warps) runs
    ``sparse_mla_gluon_narrow._mla_gluon_narrow_kernel``: 16- or 32-head blocks with the
    tokens as the MMA's rows, where the other kernels pad the heads to 64 rows. Falls back to
    the Triton kernel (logged once) where Gluon or a Hopper GPU is unavailable.
    ``fp8_stages`` (the warp-specialised kernel over FP8 rows): 0 has the producer warps load
    each tile's rows into registers; ``n > 0`` gives them an ``n``-deep ``cp.async`` staging
    ring of raw rows in shared memory, so up to ``n`` tiles of loads fly while they scale one
    (unread over 16-bit rows; a ValueError with ``token_rows`` or without producer warps).
    ``mma_groups`` (the token-rows kernel over 16-bit rows): 2 splits each program's tiles
    between two MMA warpgroups (even and odd tiles, each with its own online softmax, merged at
    the end), 1 keeps one; None: :func:`token_rows_mma_groups` by the shape (2 only at up to
    ``TWO_MMA_MAX_HEADS`` heads a block). ``gather_ahead`` (the warp-specialised kernel over
    16-bit rows): how many tiles ahead of the one it hands over next the gather producer
    keeps in flight, 1 to ``num_buf - 1`` (a tile is handed over only once the slot of the
    tile that many ahead is claimed); None: :func:`ws_gather_ahead` by the shape.
    ``stream_k`` (the warp-specialised kernel): True runs ``sparse_mla_gluon_stream``, one
    program an SM walking an equal share of all (request, head block) pairs' tiles, in place
    of split-K (``num_splits`` unread); None: ``sparse_mla_gluon_launch.stream_k`` by the shape.
    """

    block_n: int = 64
    num_buf: int = 2
    late_issue: bool = False
    num_splits: Optional[int] = None
    producer_warps: Optional[int] = None
    token_rows: bool = False
    fp8_stages: int = 0
    mma_groups: Optional[int] = None
    gather_ahead: Optional[int] = None
    stream_k: Optional[bool] = None


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
    def _gl_copy_aligned(ptr, rows, stride, buf, offs_d, ALIGN: gl.constexpr):
        """:func:`_gl_copy` of rows whose starts are ``ALIGN``-element multiples, which the
        compiler can't infer from a row stride that isn't a multiple of 16 (the FP8 rows'
        rope view: 328 bf16 values)."""
        valid = rows >= 0
        base = gl.multiple_of(gl.maximum(rows, 0).to(gl.int64) * stride, ALIGN)
        async_copy.async_copy_global_to_shared(buf, ptr + base[:, None] + offs_d[None, :], mask=valid[:, None])

    @gluon.jit
    def _gl_scale_tile(raw, lat_s, j: gl.constexpr, sc, ld_deq: gl.constexpr, TILE: gl.constexpr):
        """Scale tile ``j`` (columns ``j * TILE ..``) of the E4M3 bytes ``raw`` by its row scales
        ``sc [N]`` into the 16-bit latent tile ``lat_s`` (exact: power-of-two scales)."""
        _gl_scale_regs(raw.slice(j * TILE, TILE, dim=1).load(ld_deq), sc, lat_s, j, TILE)

    @gluon.jit
    def _gl_scale_regs(x, sc, lat_rows, j: gl.constexpr, TILE: gl.constexpr):
        """E4M3 bytes ``x [N, TILE]`` times their row scales ``sc [N]`` into columns ``j *
        TILE ..`` of the 16-bit shared rows ``lat_rows`` (exact: power-of-two scales)."""
        y = x.to(gl.float8e4nv, bitcast=True).to(gl.float32) * sc[:, None]
        lat_rows.slice(j * TILE, TILE, dim=1).store(y.to(lat_rows.dtype))

    @gluon.jit
    def _gl_q_to_shared(q_row, stride_qh, num_heads, offs_h_lat, offs_d_lat, offs_h_pe, offs_d_pe, sh: gl.constexpr,
                        D_LAT: gl.constexpr):
        """One request's absorbed query for a head block, latent and rope parts, into shared
        memory (rows of heads past ``num_heads`` zero)."""
        q_lat = gl.load(q_row + offs_h_lat[:, None] * stride_qh + offs_d_lat[None, :],
                        mask=(offs_h_lat < num_heads)[:, None], other=0.0)
        q_pe = gl.load(q_row + offs_h_pe[:, None] * stride_qh + D_LAT + offs_d_pe[None, :],
                       mask=(offs_h_pe < num_heads)[:, None], other=0.0)
        q_lat_s = gl.allocate_shared_memory(q_lat.dtype, q_lat.shape, sh, q_lat)
        q_pe_s = gl.allocate_shared_memory(q_pe.dtype, q_pe.shape, sh, q_pe)
        return q_lat_s, q_pe_s

    @gluon.jit
    def _gl_q_tile(q_row, stride_qh, num_heads, hb, sh: gl.constexpr, BLOCK_H: gl.constexpr, D_LAT: gl.constexpr,
                   D_ROPE: gl.constexpr):
        """:func:`_gl_q_to_shared` for head block ``hb`` with the calling partition's warps,
        fenced and synchronised for the MMAs and for partitions started after it."""
        ld_lat: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [gl.num_warps(), 1], [1, 0])
        ld_pe: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [gl.num_warps(), 1], [1, 0])
        offs_h_lat = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, ld_lat))
        offs_d_lat = gl.arange(0, D_LAT, layout=gl.SliceLayout(0, ld_lat))
        offs_h_pe = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, ld_pe))
        offs_d_pe = gl.arange(0, D_ROPE, layout=gl.SliceLayout(0, ld_pe))
        q_lat_s, q_pe_s = _gl_q_to_shared(q_row, stride_qh, num_heads, offs_h_lat, offs_d_lat, offs_h_pe, offs_d_pe, sh,
                                          D_LAT)
        fence_async_shared()
        gl.thread_barrier()
        return q_lat_s, q_pe_s

    @gluon.jit
    def _gl_split_range(tokens_per_split, num_idx, BLOCK_N: gl.constexpr):
        """This program's head block, request and split (grid axes 0, 1, 2), the split's
        index range ``start .. end`` and its count of ``BLOCK_N``-token tiles."""
        hb = gl.program_id(0)
        b = gl.program_id(1)
        split = gl.program_id(2)
        start = split * tokens_per_split
        end = gl.minimum(start + tokens_per_split, num_idx)
        n_tiles = (end - start + BLOCK_N - 1) // BLOCK_N
        return hb, b, split, start, end, n_tiles

    @gluon.jit
    def _gl_attend_tile(q_lat_s, q_pe_s, lat_tile, pe_tile, p_s, zero_s, valid, m_i, l2, o, qk_scale_log2,
                        mma_o: gl.constexpr):
        """One tile of online softmax attention: the score MMAs ``q . kv^T`` over the latent and
        rope tiles in shared memory, the softmax update of the running max ``m_i`` and row sums
        ``l2`` (masked where not ``valid``), ``P`` through shared memory into the value MMA
        ``o += P lat_tile``. Returns ``(m_i, l2, o)``."""
        s_tok = warpgroup_mma(q_lat_s, lat_tile.permute((1, 0)), zero_s, is_async=True)
        s_tok = warpgroup_mma(q_pe_s, pe_tile.permute((1, 0)), s_tok, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=[s_tok])
        s = s * qk_scale_log2
        s = gl.where(valid[None, :], s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=1))
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_safe)
        p = gl.exp2(s - m_safe[:, None])
        l2 = l2 * alpha[:, None] + p
        o = o * gl.convert_layout(alpha, gl.SliceLayout(1, mma_o))[:, None]
        p_s.store(p.to(p_s.dtype))
        fence_async_shared()
        gl.thread_barrier()
        o_tok = warpgroup_mma(p_s, lat_tile, o, is_async=True)
        o = warpgroup_mma_wait(num_outstanding=0, deps=[o_tok])
        return m_new, l2, o

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
        hb, b, split, start, end, n_tiles = _gl_split_range(tokens_per_split, num_idx, BLOCK_N)

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
        q_lat_s, q_pe_s = _gl_q_to_shared(Q + b.to(gl.int64) * stride_qb, stride_qh, num_heads, offs_h_lat, offs_d_lat,
                                          offs_h_pe, offs_d_pe, sh, D_LAT)
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
            m_i, l2, o = _gl_attend_tile(q_lat_s, q_pe_s, lat_s.index(cur), pe_s.index(cur), p_s, zero_s, valid,
                                         m_i, l2, o, qk_scale_log2, mma_o)
            if not LATE_ISSUE:
                gl.thread_barrier()                     # slot `cur` and P free for the next gather
        async_copy.wait_group(0)

        _gl_store_out(o, l2, m_i, Out, OutPartial, LsePartial, b, hb, split, num_heads, stride_ob, stride_oh,
                      stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, mma_o, D_LAT, BLOCK_H, SPLIT)

    @gluon.jit
    def _gl_store_out(o, l2, m_i, Out, OutPartial, LsePartial, b, hb, split, num_heads, stride_ob, stride_oh,
                      stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
                      mma_o: gl.constexpr, D_LAT: gl.constexpr, BLOCK_H: gl.constexpr, SPLIT: gl.constexpr):
        """:func:`_gl_store_cols` of all of ``o``, with the row sums ``l2`` kept per token
        column summed first."""
        row: gl.constexpr = gl.SliceLayout(1, mma_o)
        _gl_store_cols(o, gl.convert_layout(gl.sum(l2, axis=1), row), gl.convert_layout(m_i, row), Out, OutPartial,
                       LsePartial, b, hb, split, num_heads, stride_ob, stride_oh, stride_pb, stride_ph, stride_ps,
                       stride_lb, stride_lh, 0, mma_o, D_LAT, BLOCK_H, SPLIT, True)

    @gluon.jit
    def _gl_store_cols(o, l_i, m_i, Out, OutPartial, LsePartial, b, hb, split, num_heads, stride_ob, stride_oh,
                       stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, col0: gl.constexpr,
                       mma_o: gl.constexpr, D_COLS: gl.constexpr, BLOCK_H: gl.constexpr, SPLIT: gl.constexpr,
                       WITH_LSE: gl.constexpr):
        """Columns ``col0 .. col0 + D_COLS`` of the output: ``o`` normalised by the row sums
        ``l_i``, or (``SPLIT``) the fp32 partial, with the log-sum-exp where ``WITH_LSE``."""
        has = l_i > 0
        l_safe = gl.where(has, l_i, 1.0)
        out = o / l_safe[:, None]
        offs_h = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, mma_o))
        offs_d = col0 + gl.arange(0, D_COLS, layout=gl.SliceLayout(0, mma_o))
        h_mask = (offs_h < num_heads)[:, None]
        if not SPLIT:
            gl.store(Out + b.to(gl.int64) * stride_ob + offs_h[:, None] * stride_oh + offs_d[None, :],
                     out.to(Out.dtype.element_ty), mask=h_mask)
        else:
            gl.store(OutPartial + b.to(gl.int64) * stride_pb + offs_h[:, None] * stride_ph + split * stride_ps
                     + offs_d[None, :], out, mask=h_mask)
            if WITH_LSE:
                lse = gl.where(has, (m_i + gl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
                gl.store(LsePartial + b.to(gl.int64) * stride_lb + offs_h * stride_lh + split, lse,
                         mask=offs_h < num_heads)

    @gluon.jit
    def _mla_gluon_fp8_kernel(
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
    ):
        """:func:`_mla_gluon_kernel` over FP8 latent rows (``mla_fp8_latents``): ``KV`` the
        uint8 rows, ``Scales`` / ``Rope`` their float32 scale and bf16 rope views; DeepSeek's
        512 + 64 layout (4 scale tiles of ``TILE`` = 128 values, written out below).

        The gather ring holds the rows' E4M3 bytes (half the bytes of bf16) and their rope
        values; once a tile has landed, the 8 warps scale it in registers, one 128-value
        scale tile at a time (``fp8 * scale``, exact: the scales are powers of two), into one
        16-bit latent tile in shared memory, which both MMAs read as in the 16-bit kernel.
        A tile's scales are loaded from global memory before the wait for its bytes."""
        hb, b, split, start, end, n_tiles = _gl_split_range(tokens_per_split, num_idx, BLOCK_N)

        ld_lat: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [8, 1], [1, 0])
        ld_pe: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [8, 1], [1, 0])
        ld_fp8: gl.constexpr = gl.BlockedLayout([1, 16], [1, 32], [8, 1], [1, 0])     # gather: 16 bytes a lane
        ld_deq: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [8, 1], [1, 0])      # a scale tile: 8 lanes a row
        mma_s: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                        instr_shape=[16, BLOCK_N // 2, 16])
        mma_o: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                        instr_shape=[16, D_LAT // 2, 16])
        sh: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        sh8: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
        dtype: gl.constexpr = Q.dtype.element_ty

        offs_h_lat = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, ld_lat))
        offs_d_lat = gl.arange(0, D_LAT, layout=gl.SliceLayout(0, ld_lat))
        offs_h_pe = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, ld_pe))
        offs_d_pe = gl.arange(0, D_ROPE, layout=gl.SliceLayout(0, ld_pe))
        offs_d8 = gl.arange(0, D_LAT, layout=gl.SliceLayout(0, ld_fp8))
        lat8_s = gl.allocate_shared_memory(gl.uint8, [NUM_BUF, BLOCK_N, D_LAT], sh8)
        pe_s = gl.allocate_shared_memory(dtype, [NUM_BUF, BLOCK_N, D_ROPE], sh)
        lat_s = gl.allocate_shared_memory(dtype, [BLOCK_N, D_LAT], sh)
        sh_p: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, BLOCK_N], dtype)
        p_s = gl.allocate_shared_memory(dtype, [BLOCK_H, BLOCK_N], sh_p)

        idx_row = Idx + b.to(gl.int64) * stride_ib
        offs_n8 = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ld_fp8))
        offs_n_pe = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ld_pe))
        offs_n_dq = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ld_deq))
        offs_n_s = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, mma_s))

        m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=gl.SliceLayout(1, mma_s))
        l2 = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, layout=mma_s)
        zero_s = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, layout=mma_s)
        o = gl.zeros([BLOCK_H, D_LAT], gl.float32, layout=mma_o)

        for t in gl.static_range(NUM_BUF - 1):
            r8 = _gl_rows(idx_row, start, end, t, num_slots, offs_n8, BLOCK_N)
            rp = _gl_rows(idx_row, start, end, t, num_slots, offs_n_pe, BLOCK_N)
            _gl_copy_aligned(KV, r8, stride_kvn, lat8_s.index(t), offs_d8, 16)
            _gl_copy_aligned(Rope, rp, stride_rn, pe_s.index(t), offs_d_pe, 8)
            async_copy.commit_group()
        r8 = _gl_rows(idx_row, start, end, NUM_BUF - 1, num_slots, offs_n8, BLOCK_N)
        rp = _gl_rows(idx_row, start, end, NUM_BUF - 1, num_slots, offs_n_pe, BLOCK_N)
        vs = _gl_valid_s(idx_row, start, end, 0, num_slots, offs_n_s, BLOCK_N)
        # q [BLOCK_H, D_LAT] and [BLOCK_H, D_ROPE] -> shared (once), while the first tiles fly
        q_lat_s, q_pe_s = _gl_q_to_shared(Q + b.to(gl.int64) * stride_qb, stride_qh, num_heads, offs_h_lat, offs_d_lat,
                                          offs_h_pe, offs_d_pe, sh, D_LAT)
        for t in range(0, n_tiles):
            cur = t % NUM_BUF
            nxt = (t + NUM_BUF - 1) % NUM_BUF
            _gl_copy_aligned(KV, r8, stride_kvn, lat8_s.index(nxt), offs_d8, 16)
            _gl_copy_aligned(Rope, rp, stride_rn, pe_s.index(nxt), offs_d_pe, 8)
            async_copy.commit_group()
            r8 = _gl_rows(idx_row, start, end, t + NUM_BUF, num_slots, offs_n8, BLOCK_N)
            rp = _gl_rows(idx_row, start, end, t + NUM_BUF, num_slots, offs_n_pe, BLOCK_N)
            valid = vs
            vs = _gl_valid_s(idx_row, start, end, t + 1, num_slots, offs_n_s, BLOCK_N)
            # the tile's 4 scale columns, loaded in the scaling pass's row layout before the wait
            rs = _gl_rows(idx_row, start, end, t, num_slots, offs_n_dq, BLOCK_N)
            sc_row = Scales + gl.maximum(rs, 0).to(gl.int64) * stride_sn
            sc0 = gl.load(sc_row, mask=rs >= 0, other=0.0)
            sc1 = gl.load(sc_row + 1, mask=rs >= 0, other=0.0)
            sc2 = gl.load(sc_row + 2, mask=rs >= 0, other=0.0)
            sc3 = gl.load(sc_row + 3, mask=rs >= 0, other=0.0)
            async_copy.wait_group(NUM_BUF - 1)          # tile t landed (tile t+NUM_BUF-1 may fly)
            gl.thread_barrier()
            raw = lat8_s.index(cur)
            _gl_scale_tile(raw, lat_s, 0, sc0, ld_deq, TILE)
            _gl_scale_tile(raw, lat_s, 1, sc1, ld_deq, TILE)
            _gl_scale_tile(raw, lat_s, 2, sc2, ld_deq, TILE)
            _gl_scale_tile(raw, lat_s, 3, sc3, ld_deq, TILE)
            fence_async_shared()
            gl.thread_barrier()
            m_i, l2, o = _gl_attend_tile(q_lat_s, q_pe_s, lat_s, pe_s.index(cur), p_s, zero_s, valid,
                                         m_i, l2, o, qk_scale_log2, mma_o)
            gl.thread_barrier()                         # the latent tile, slot `cur` and P free again
        async_copy.wait_group(0)
        _gl_store_out(o, l2, m_i, Out, OutPartial, LsePartial, b, hb, split, num_heads, stride_ob, stride_oh,
                      stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, mma_o, D_LAT, BLOCK_H, SPLIT)

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


def gluon_ok(q: torch.Tensor, Dl: int, Dr: int, kv: Optional[torch.Tensor] = None) -> bool:
    """Gluon kernel usable here: Triton with the Gluon API, a Hopper GPU (not the
    interpreter), 16-bit q, a rope part of 64 and a power-of-two latent of 64..512. Over FP8
    rows (``kv`` uint8): bf16 q (the rows' rope values are bf16) and DeepSeek's 512 + 64
    layout only, its 656-byte rows on 16-byte boundaries (the gathers move 16 bytes a lane)."""
    if not (_HAS_GLUON and q.is_cuda and not interpreter_enabled()):
        return False
    if torch.cuda.get_device_capability(q.device)[0] != 9 or q.dtype not in (torch.float16, torch.bfloat16):
        return False
    if kv is not None and kv.dtype == torch.uint8:
        # the rope values are gathered into the MMA's tile unconverted: bf16 q only
        return ((Dl, Dr) == (512, 64) and q.dtype == torch.bfloat16 and kv.stride(0) % 16 == 0
                and kv.data_ptr() % 16 == 0)
    return Dl in (64, 128, 256, 512) and Dr == 64


# Hopper's shared memory per block (227 KiB); a Gluon kernel's ring must fit beside q's tile
_SMEM_BYTES = 232448
# producer warps over 16-bit rows when the config leaves it open
WS_DEFAULT_BF16 = 0
# the default dispatch over 16-bit rows runs the warp-specialised kernel with 32-token tiles
# x 4 from this head count up (two 64-head blocks share each row): 1-9 % faster than the
# 8-warp kernel at 128 heads, 1 % faster to 4 % slower at 64 (attention_mla_bf16_sweep.json)
WS_BF16_MIN_HEADS = 65
# the widest head block of the token-rows kernel (``token_rows``; its MMAs' N and q's tile
# grow with it), and the default over FP8 rows up to it: 1.33-1.41x the warp-specialised
# kernel at 16 heads from B=16, 1.15-1.19x at 32 (H100, 2026-11-27; docs/kernels.md)
NARROW_MAX_HEADS = 32
# up to this many heads the default dispatch runs the token-rows kernel over 16-bit rows too,
# at every batch: at 16 heads 1.03-1.24x the fused or 8-warp kernel up to 4 query rows
# (attention_mla_token_rows_16bit.json) and, with two MMA warpgroups where a program walks
# TWO_MMA_MIN_TOKENS indices or more, 1.04-1.09x the 8-warp kernel from 8 rows
# (attention_mla_two_mma.json); at 32 heads 0.93-0.98x at large batches, so not there
# (H100, 2026-11-27)
TOKEN_ROWS_16BIT_MAX_HEADS = 16
# the token-rows kernel over 16-bit rows splits a program's tiles between two MMA warpgroups
# from this many indices a program (8 tiles) at up to TWO_MMA_MAX_HEADS heads a block (at 32
# the merge buffer does not fit): 1.04-1.27x one warpgroup from 512 indices, 0.89-0.97x at
# 128-256 (attention_mla_two_mma.json)
TWO_MMA_MIN_TOKENS = 512
TWO_MMA_MAX_HEADS = 16
# the warp-specialised kernel's gather producer over 16-bit rows keeps two tiles in flight
# ahead of the one it hands over next (one otherwise) where the ring has 4 slots or more and
# a program walks this many indices or more: at 128 heads with 32-token tiles x 4 1.019-1.054x
# from 2048 indices a program (B=64-128, K=2048; B=16, K=32768), level at 1024, 0.974-0.975x
# at 128-512; three ahead of four slots 0.63-0.92x (attention_mla_gather_ahead.json; H100,
# 2026-11-27)
GATHER_TWO_AHEAD_MIN_TOKENS = 2048
# from this many query rows, one 64-head block over FP8 rows runs the warp-specialised kernel
# with a one-tile cp.async staging ring (64-token tiles x 1, ``fp8_stages=1``): 1.03-1.09x the
# register-loading producer at 64 heads from B=16 (B=4 at K=8192), level with 2 query tokens,
# 0.89-0.91x at B <= 4 with K=2048; 0.95-0.99x at 128 heads, which keep the registers
# (attention_mla_fp8_staging.json, H100, 2026-11-27)
STAGED_FP8_MIN_ROWS = 16


def gluon_smem_bytes(block_n: int, num_buf: int, Dl: int, Dr: int, producer_warps: int, fp8_stages: int = 0) -> int:
    """Shared memory a Gluon kernel allocates beyond the 8-warp 16-bit one: with
    ``producer_warps`` (the warp-specialised kernel, either row format) a ring of 16-bit latent
    and rope tiles; without (the 8-warp FP8 kernel) the FP8 byte ring and rope ring plus one
    16-bit latent tile. Both: P and q's tile of 64 heads. The compiler's scratch and mbarriers
    come on top (the sm_90 builds at 64 x 2: 229,888 bytes without producer warps, 230,472
    with). ``fp8_stages`` staging slots of raw FP8 rows (bytes, scales, rope) come on top.
    """
    if producer_warps:
        ring = num_buf * block_n * 2 * (Dl + Dr) + (fp8_stages * block_n * fp8_row_bytes(Dl, Dr) if fp8_stages else 0)
    else:
        ring = num_buf * block_n * (Dl + 2 * Dr) + 2 * block_n * Dl
    return ring + 2 * 64 * block_n + 2 * 64 * (Dl + Dr)


def token_rows_default(num_heads: int, fp8: bool) -> bool:
    """Whether the default dispatch runs the token-rows kernel for ``num_heads`` heads: over
    FP8 rows (``fp8``) up to ``NARROW_MAX_HEADS`` heads, over 16-bit rows up to
    ``TOKEN_ROWS_16BIT_MAX_HEADS``, at any batch."""
    return num_heads <= (NARROW_MAX_HEADS if fp8 else TOKEN_ROWS_16BIT_MAX_HEADS)


def token_rows_mma_groups(cfg: MlaGluonConfig, fp8: bool, block_h: int, tokens_per_split: int) -> int:
    """MMA warpgroups of a token-rows launch of ``cfg`` with ``block_h`` heads a program, each
    program walking up to ``tokens_per_split`` indices: ``cfg.mma_groups`` where set, else 2
    over 16-bit rows at up to ``TWO_MMA_MAX_HEADS`` heads a block from ``TWO_MMA_MIN_TOKENS``
    indices a program, 1 otherwise."""
    if cfg.mma_groups is not None:
        return cfg.mma_groups
    return 2 if not fp8 and block_h <= TWO_MMA_MAX_HEADS and tokens_per_split >= TWO_MMA_MIN_TOKENS else 1


def ws_gather_ahead(cfg: MlaGluonConfig, fp8: bool, tokens_per_split: int) -> int:
    """Tiles the warp-specialised kernel's gather producer keeps in flight ahead of the one it
    hands over next, each program walking up to ``tokens_per_split`` indices:
    ``cfg.gather_ahead`` where set, else 2 over 16-bit rows with 4 slots or more from
    ``GATHER_TWO_AHEAD_MIN_TOKENS`` indices a program, 1 otherwise (FP8 rows: unread)."""
    if cfg.gather_ahead is not None:
        return cfg.gather_ahead
    return 2 if not fp8 and cfg.num_buf >= 4 and tokens_per_split >= GATHER_TWO_AHEAD_MIN_TOKENS else 1


def default_gluon_config(num_heads: int, fp8: bool, rows: int) -> MlaGluonConfig:
    """The Gluon config the default dispatch (``config=None``) runs for ``rows`` query rows
    (requests x query tokens) of ``num_heads`` heads over FP8 (``fp8``) or 16-bit rows:
    ``MlaGluonConfig(token_rows=True)`` where :func:`token_rows_default`;
    ``MlaGluonConfig(64, 1, fp8_stages=1)`` over FP8 rows from there to one 64-head block
    at ``STAGED_FP8_MIN_ROWS`` rows or more; ``MlaGluonConfig(32, 4, producer_warps=4)`` over
    16-bit rows from ``WS_BF16_MIN_HEADS`` heads up; else ``MlaGluonConfig()``."""
    if token_rows_default(num_heads, fp8):
        return MlaGluonConfig(token_rows=True)
    if fp8 and NARROW_MAX_HEADS < num_heads <= 64 and rows >= STAGED_FP8_MIN_ROWS:
        return MlaGluonConfig(64, 1, fp8_stages=1)
    if not fp8 and num_heads >= WS_BF16_MIN_HEADS:
        return MlaGluonConfig(32, 4, producer_warps=4)
    return MlaGluonConfig()


def producer_warps(cfg: MlaGluonConfig, fp8: bool) -> int:
    """The producer warps ``cfg`` runs with over FP8 (``fp8``) or 16-bit rows: 0 or 4."""
    if cfg.producer_warps is None:
        return 0 if cfg.late_issue else 4 if fp8 or cfg.token_rows else WS_DEFAULT_BF16
    return cfg.producer_warps


def _plain_int(value) -> bool:
    """An int that is not a bool (``True`` is an int to Python, not a count to a config)."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_gluon_config(cfg: MlaGluonConfig, Dl: int, Dr: int, fp8: bool, num_heads: int) -> None:
    """ValueError naming ``config`` unless the FP8 kernels (``fp8``) or the warp-specialised
    kernel over 16-bit rows can run ``cfg``: no ``late_issue``, ``producer_warps`` None, 0 or
    4, a ring that fits the shared memory at latent ``Dl`` and rope ``Dr``, and over 16-bit
    rows at least 2 slots (the gather of tile t+1 is issued before tile t is handed over). The
    8-warp kernel over 16-bit rows has no such limits. ``token_rows`` needs producer warps,
    64-token tiles x 2 (its two FP8 producers take alternate slots) and at most
    ``NARROW_MAX_HEADS`` heads (``num_heads``); ``mma_groups`` is None, or 1 or 2 with
    ``token_rows``, 2 only over 16-bit rows at up to ``TWO_MMA_MAX_HEADS`` heads;
    ``gather_ahead`` is None, or 1 to ``num_buf - 1`` for the warp-specialised kernel over
    16-bit rows."""
    if cfg.token_rows and num_heads > NARROW_MAX_HEADS:
        fail("config", f"an MlaGluonConfig with token_rows only for up to {NARROW_MAX_HEADS} query heads",
             (cfg, num_heads))
    warps = producer_warps(cfg, fp8)
    if cfg.gather_ahead is not None and (
            not _plain_int(cfg.gather_ahead) or fp8 or cfg.token_rows or warps != 4
            or not 1 <= cfg.gather_ahead <= cfg.num_buf - 1):
        fail("config", "an MlaGluonConfig with gather_ahead None, or an int from 1 to num_buf - 1 for the "
             "warp-specialised kernel over 16-bit rows (producer_warps=4, without token_rows)",
             (cfg, "fp8" if fp8 else "16-bit"))
    if cfg.mma_groups is not None and (
            not _plain_int(cfg.mma_groups) or cfg.mma_groups not in (1, 2) or not cfg.token_rows
            or (cfg.mma_groups == 2 and (fp8 or num_heads > TWO_MMA_MAX_HEADS))):
        fail("config", f"an MlaGluonConfig with mma_groups None, or 1 or 2 with token_rows (2 only over 16-bit rows "
             f"at up to {TWO_MMA_MAX_HEADS} query heads)", (cfg, num_heads, "fp8" if fp8 else "16-bit"))
    stream_ok = cfg.stream_k is None or isinstance(cfg.stream_k, bool)
    if not stream_ok or (cfg.stream_k and (warps != 4 or cfg.token_rows)):
        fail("config", "an MlaGluonConfig with stream_k None, False, or True for the warp-specialised kernel "
             "(producer_warps 4, without token_rows)", (cfg, "fp8" if fp8 else "16-bit"))
    if not (fp8 or warps):
        return
    if (cfg.late_issue or cfg.producer_warps not in (None, 0, 4) or (not fp8 and cfg.num_buf < 2)
            or (cfg.token_rows and (warps != 4 or cfg.block_n != 64 or cfg.num_buf != 2))
            or not isinstance(cfg.fp8_stages, int) or cfg.fp8_stages < 0
            or (cfg.fp8_stages and (cfg.token_rows or not warps))
            or gluon_smem_bytes(cfg.block_n, cfg.num_buf, Dl, Dr, warps, cfg.fp8_stages if fp8 else 0) > _SMEM_BYTES):
        fail("config", f"an MlaGluonConfig without late_issue, with producer_warps None, 0 or 4 and a ring that fits "
             f"{_SMEM_BYTES} bytes of shared memory (block_n=64: num_buf <= 2; block_n=32: num_buf <= 4 at "
             f"kv_lora_rank 512; num_buf >= 2 for the warp-specialised kernel over 16-bit rows; token_rows only "
             f"with producer_warps 4, block_n=64 and num_buf=2; fp8_stages an int >= 0, with producer warps and "
             f"without token_rows; with fp8_stages=2 over FP8 rows block_n=32 takes num_buf <= 3)", cfg)
