"""Warp-specialised sparse MLA decode on Hopper in Gluon (:func:`_mla_gluon_ws_kernel`;
``MlaGluonConfig.producer_warps=4``, the default over FP8 rows; rows, indices and split-K
as ``sparse_mla_gluon``, whose helpers it shares).

Three warpgroups over a ring of 16-bit tiles in shared memory: producer warps fill a free
slot (FP8 rows: the bytes, scales and rope values loaded into registers, or with
``MlaGluonConfig.fp8_stages`` brought by ``cp.async`` into a staging ring in shared memory,
and the bytes scaled into the slot; 16-bit rows: gathered by ``cp.async``), the score
warpgroup runs the score MMA over the whole tile, the online softmax and the left half of
the value MMA, the value warpgroup the right half, overlapping the score MMA of the next
tile. Slots pass between them through mbarriers. Measurements: docs/kernels.md.
"""
from __future__ import annotations

import torch

from sparsehi.kernels.mla_fp8_latents import FP8_TILE
from sparsehi.kernels.sparse_mla_common import fp8_row_views, launch_split
from sparsehi.kernels.sparse_mla_gluon import MlaGluonConfig, ws_gather_ahead

# 12 warps share the 65536 registers (168 a thread); setmaxnreg moves them between the
# warpgroups: score 216, value 160, FP8 producer 128 (sm_90 build: 12 bytes spilled; a
# 152-register producer leaves the score warpgroup 192 and spills 92), gather producer 88
_WS_MAXNREG = 168
_SCALE_REGS = 128
_VALUE_REGS = 160
_GATHER_REGS = 88

try:  # the Gluon API of sparse_mla_gluon, plus warp specialisation and mbarriers
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (async_copy, fence_async_shared, mbarrier,
                                                                  warpgroup_mma, warpgroup_mma_wait)

    from sparsehi.kernels.sparse_mla_gluon import (_gl_copy, _gl_copy_aligned, _gl_q_tile, _gl_rows, _gl_scale_regs,
                                                   _gl_split_range, _gl_store_cols, _gl_valid_s)

    @gluon.jit
    def _gl_tile_rows(idx_row, start, end, t, part, num_slots, offs_n, BLOCK_N: gl.constexpr, PART: gl.constexpr,
                      row_tiles, head_blocks, stride_ib, num_idx, STREAM: gl.constexpr):
        """Slots (-1 where masked) of part ``part`` (indices ``part * PART + offs_n``, ``offs_n``
        spanning ``PART``) of a producer's tile ``t``. One range (not ``STREAM``): the tile's
        indices are ``start + t * BLOCK_N ..`` of the row ``idx_row``, up to ``end``. ``STREAM``
        (the stream-K kernel, ``sparse_mla_gluon_stream``): the program walks tiles ``start ..
        end`` of the concatenated (request, head block) pairs, ``row_tiles`` tiles each, the
        pairs ordered request-major over ``head_blocks``; ``idx_row`` is the index tensor's
        base, ``stride_ib`` its row stride and ``num_idx`` its indices a row."""
        if STREAM:
            g = start + t
            pair = g // row_tiles
            offs = (g - pair * row_tiles) * BLOCK_N + part * PART + offs_n
            in_row = (offs < num_idx) & (g < end)
            idx = gl.load(idx_row + (pair // head_blocks).to(gl.int64) * stride_ib + offs, mask=in_row, other=-1)
            return gl.where(in_row & (idx < num_slots), idx, -1)
        else:
            return _gl_rows(idx_row, start, end, t * (BLOCK_N // PART) + part, num_slots, offs_n, PART)

    @gluon.jit
    def _gl_fp8_scale_partition(KV, Scales, Rope, idx_row, start, end, num_slots, n_tiles, stride_kvn, stride_sn,
                                stride_rn, lat_s, pe_s, ready, empty, D_LAT: gl.constexpr, D_ROPE: gl.constexpr,
                                BLOCK_N: gl.constexpr, TILE: gl.constexpr, FIRST: gl.constexpr,
                                STEP: gl.constexpr, row_tiles=0, head_blocks=1, stride_ib=0, num_idx=0,
                                STREAM: gl.constexpr = False):
        """Producer warps of :func:`_mla_gluon_ws_kernel` (and of the token-rows kernel) for
        tiles ``FIRST, FIRST + STEP, ..``: for each, load its rows' E4M3 bytes, scales and
        rope values from global memory into registers (in rounds of 32 tokens, all issued
        together; the indices a tile ahead), and once the tile's ring slot is free (``empty``)
        scale the bytes into its 16-bit latent rows, copy the rope values beside them and
        signal ``ready``."""
        PART: gl.constexpr = 32
        RPT: gl.constexpr = BLOCK_N // PART
        NUM_BUF: gl.constexpr = lat_s.shape[0]
        ld8: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [gl.num_warps(), 1], [1, 0])   # [PART, TILE] bytes
        ldr: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [gl.num_warps(), 1], [1, 0])    # [PART, D_ROPE] bf16
        offs_n8 = gl.arange(0, PART, layout=gl.SliceLayout(1, ld8))
        offs_c8 = gl.arange(0, TILE, layout=gl.SliceLayout(0, ld8))
        offs_cr = gl.arange(0, D_ROPE, layout=gl.SliceLayout(0, ldr))
        ra = _gl_tile_rows(idx_row, start, end, FIRST, 0, num_slots, offs_n8, BLOCK_N, PART, row_tiles, head_blocks,
                           stride_ib, num_idx, STREAM)
        rb = _gl_tile_rows(idx_row, start, end, FIRST, RPT - 1, num_slots, offs_n8, BLOCK_N, PART, row_tiles,
                           head_blocks, stride_ib, num_idx, STREAM)
        for t in range(FIRST, n_tiles, STEP):
            slot = t % NUM_BUF
            lat = lat_s.index(slot)
            pe = pe_s.index(slot)
            # both rounds' loads in flight together; the next tile's indices behind them
            a0, a1, a2, a3, sa0, sa1, sa2, sa3, rope_a = _gl_fp8_round(KV, Scales, Rope, ra, stride_kvn, stride_sn,
                                                                       stride_rn, offs_c8, offs_cr, ldr, TILE)
            if RPT == 2:
                b0, b1, b2, b3, sb0, sb1, sb2, sb3, rope_b = _gl_fp8_round(KV, Scales, Rope, rb, stride_kvn, stride_sn,
                                                                           stride_rn, offs_c8, offs_cr, ldr, TILE)
            ra = _gl_tile_rows(idx_row, start, end, t + STEP, 0, num_slots, offs_n8, BLOCK_N, PART, row_tiles,
                               head_blocks, stride_ib, num_idx, STREAM)
            rb = _gl_tile_rows(idx_row, start, end, t + STEP, RPT - 1, num_slots, offs_n8, BLOCK_N, PART, row_tiles,
                               head_blocks, stride_ib, num_idx, STREAM)
            mbarrier.wait(empty.index(slot), ((t // NUM_BUF) & 1) ^ 1)
            _gl_store_round(lat.slice(0, PART, dim=0), pe.slice(0, PART, dim=0), a0, a1, a2, a3, sa0, sa1, sa2, sa3,
                            rope_a, TILE)
            if RPT == 2:
                _gl_store_round(lat.slice(PART, PART, dim=0), pe.slice(PART, PART, dim=0), b0, b1, b2, b3, sb0, sb1,
                                sb2, sb3, rope_b, TILE)
            fence_async_shared()
            mbarrier.arrive(ready.index(slot), count=1)

    @gluon.jit
    def _gl_stage_fp8_tile(KV, Scales, Rope, r8, rp, rs, stride_kvn, stride_sn, stride_rn, raw, raw_sc, raw_pe,
                           sc0, offs_d8, offs_cr, NSC: gl.constexpr):
        """cp.async one tile's FP8 rows into a staging slot: the E4M3 bytes of rows ``r8`` into
        ``raw [N, D_LAT]`` uint8, their ``NSC`` scales (rows ``rs``) into rows ``sc0 ..`` of
        ``raw_sc [.., N]`` float32 (one row of scales per scale tile) and their rope values
        (rows ``rp``) into ``raw_pe [N, D_ROPE]`` bf16 (zero fill where a row is < 0),
        committed as one group."""
        _gl_copy_aligned(KV, r8, stride_kvn, raw, offs_d8, 16)
        _gl_copy_aligned(Rope, rp, stride_rn, raw_pe, offs_cr, 8)
        sc = Scales + gl.maximum(rs, 0).to(gl.int64) * stride_sn
        for j in gl.static_range(NSC):
            async_copy.async_copy_global_to_shared(raw_sc.index(sc0 + j), sc + j, mask=rs >= 0)
        async_copy.commit_group()

    @gluon.jit
    def _gl_staged_rows(idx_row, start, end, t, num_slots, offs_n8, offs_nr, offs_ns, BLOCK_N: gl.constexpr, row_tiles,
                        head_blocks, stride_ib, num_idx, STREAM: gl.constexpr):
        """Tile ``t``'s slots (:func:`_gl_tile_rows`) in the layouts of its three staging
        copies: the E4M3 bytes (``offs_n8``), the rope values (``offs_nr``) and the scales
        (``offs_ns``)."""
        return (_gl_tile_rows(idx_row, start, end, t, 0, num_slots, offs_n8, BLOCK_N, BLOCK_N, row_tiles, head_blocks,
                              stride_ib, num_idx, STREAM),
                _gl_tile_rows(idx_row, start, end, t, 0, num_slots, offs_nr, BLOCK_N, BLOCK_N, row_tiles, head_blocks,
                              stride_ib, num_idx, STREAM),
                _gl_tile_rows(idx_row, start, end, t, 0, num_slots, offs_ns, BLOCK_N, BLOCK_N, row_tiles, head_blocks,
                              stride_ib, num_idx, STREAM))

    @gluon.jit
    def _gl_fp8_staged_partition(KV, Scales, Rope, idx_row, start, end, num_slots, n_tiles, stride_kvn, stride_sn,
                                 stride_rn, lat_s, pe_s, ready, empty, raw8, raw_sc, raw_pe, D_LAT: gl.constexpr,
                                 D_ROPE: gl.constexpr, BLOCK_N: gl.constexpr, TILE: gl.constexpr, row_tiles,
                                 head_blocks, stride_ib, num_idx, STREAM: gl.constexpr):
        """Producer warps of :func:`_mla_gluon_ws_kernel` over FP8 rows with a staging ring:
        ``cp.async`` brings each tile's raw row bytes (E4M3 bytes, scales, rope values) into
        staging slot ``t % STAGES`` up to ``STAGES`` tiles ahead; once tile t has landed and its
        16-bit ring slot is free (``empty``), the warps scale its bytes from the staging slot
        into the ring slot, copy its rope values beside them, signal ``ready`` and reuse the
        staging slot for tile t + STAGES. The loads in flight live in shared memory, so their
        depth is not bounded by the producer's registers."""
        STAGES: gl.constexpr = raw8.shape[0]
        NUM_BUF: gl.constexpr = lat_s.shape[0]
        NSC: gl.constexpr = D_LAT // TILE
        ld_fp8: gl.constexpr = gl.BlockedLayout([1, 16], [1, 32], [gl.num_warps(), 1], [1, 0])   # copy: 16 B a lane
        ld8: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [gl.num_warps(), 1], [1, 0])       # a scale tile
        ldr: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [gl.num_warps(), 1], [1, 0])        # rope
        lsc: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])                   # a scale column
        offs_d8 = gl.arange(0, D_LAT, layout=gl.SliceLayout(0, ld_fp8))
        offs_n8 = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ld_fp8))
        offs_cr = gl.arange(0, D_ROPE, layout=gl.SliceLayout(0, ldr))
        offs_nr = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ldr))
        offs_ns = gl.arange(0, BLOCK_N, layout=lsc)
        row: gl.constexpr = gl.SliceLayout(1, ld8)
        for s in gl.static_range(STAGES):
            r8, rp, rs = _gl_staged_rows(idx_row, start, end, s, num_slots, offs_n8, offs_nr, offs_ns, BLOCK_N,
                                         row_tiles, head_blocks, stride_ib, num_idx, STREAM)
            _gl_stage_fp8_tile(KV, Scales, Rope, r8, rp, rs, stride_kvn, stride_sn, stride_rn, raw8.index(s), raw_sc,
                               raw_pe.index(s), s * NSC, offs_d8, offs_cr, NSC)
        r8, rp, rs = _gl_staged_rows(idx_row, start, end, STAGES, num_slots, offs_n8, offs_nr, offs_ns, BLOCK_N,
                                     row_tiles, head_blocks, stride_ib, num_idx, STREAM)
        for t in range(n_tiles):
            stage = t % STAGES
            slot = t % NUM_BUF
            lat = lat_s.index(slot)
            raw = raw8.index(stage)
            async_copy.wait_group(STAGES - 1)           # tile t landed (tiles t+1 .. t+STAGES-1 may fly)
            gl.thread_barrier()
            mbarrier.wait(empty.index(slot), ((t // NUM_BUF) & 1) ^ 1)
            for j in gl.static_range(NSC):
                _gl_scale_regs(raw.slice(j * TILE, TILE, dim=1).load(ld8), raw_sc.index(stage * NSC + j).load(row), lat,
                               j, TILE)
            pe_s.index(slot).store(raw_pe.index(stage).load(ldr))
            fence_async_shared()
            gl.thread_barrier()                         # the ring slot written, the staging slot read
            mbarrier.arrive(ready.index(slot), count=1)
            _gl_stage_fp8_tile(KV, Scales, Rope, r8, rp, rs, stride_kvn, stride_sn, stride_rn, raw, raw_sc,
                               raw_pe.index(stage), stage * NSC, offs_d8, offs_cr, NSC)
            r8, rp, rs = _gl_staged_rows(idx_row, start, end, t + 1 + STAGES, num_slots, offs_n8, offs_nr, offs_ns,
                                         BLOCK_N, row_tiles, head_blocks, stride_ib, num_idx, STREAM)
        async_copy.wait_group(0)

    @gluon.jit
    def _gl_store_round(lat_rows, pe_rows, x0, x1, x2, x3, s0, s1, s2, s3, rope, TILE: gl.constexpr):
        """Scale one round's E4M3 bytes into the 16-bit latent rows ``lat_rows`` and store
        its rope values into ``pe_rows``."""
        _gl_scale_regs(x0, s0, lat_rows, 0, TILE)
        _gl_scale_regs(x1, s1, lat_rows, 1, TILE)
        _gl_scale_regs(x2, s2, lat_rows, 2, TILE)
        _gl_scale_regs(x3, s3, lat_rows, 3, TILE)
        pe_rows.store(rope)

    @gluon.jit
    def _gl_fp8_round(KV, Scales, Rope, rows, stride_kvn, stride_sn, stride_rn, offs_c8, offs_cr, ldr: gl.constexpr,
                      TILE: gl.constexpr):
        """One round's loads for :func:`_gl_fp8_scale_partition`: the 4 scale tiles' E4M3
        bytes ``[N, TILE]`` uint8, their scales ``[N]`` float32 and the rope values ``[N,
        D_ROPE]`` of slots ``rows [N]`` (zeros where ``rows < 0``)."""
        ok = rows >= 0
        row = gl.maximum(rows, 0).to(gl.int64)
        base = KV + gl.multiple_of(row * stride_kvn, 16)[:, None] + offs_c8[None, :]
        x0 = gl.load(base, mask=ok[:, None], other=0)
        x1 = gl.load(base + TILE, mask=ok[:, None], other=0)
        x2 = gl.load(base + 2 * TILE, mask=ok[:, None], other=0)
        x3 = gl.load(base + 3 * TILE, mask=ok[:, None], other=0)
        sc = Scales + row * stride_sn
        s0 = gl.load(sc, mask=ok, other=0.0)
        s1 = gl.load(sc + 1, mask=ok, other=0.0)
        s2 = gl.load(sc + 2, mask=ok, other=0.0)
        s3 = gl.load(sc + 3, mask=ok, other=0.0)
        rr = gl.convert_layout(rows, gl.SliceLayout(1, ldr))
        rope = gl.load(Rope + gl.multiple_of(gl.maximum(rr, 0).to(gl.int64) * stride_rn, 8)[:, None] + offs_cr[None, :],
                       mask=(rr >= 0)[:, None], other=0.0)
        return x0, x1, x2, x3, s0, s1, s2, s3, rope

    @gluon.jit
    def _gl_gather_partition(KV, idx_row, start, end, num_slots, n_tiles, stride_kvn, lat_s, pe_s, ready, empty,
                             D_LAT: gl.constexpr, D_ROPE: gl.constexpr, BLOCK_N: gl.constexpr,
                             GATHER_AHEAD: gl.constexpr, row_tiles, head_blocks, stride_ib, num_idx,
                             STREAM: gl.constexpr):
        """Producer warps of :func:`_mla_gluon_ws_kernel` (and of the token-rows kernel) over
        16-bit rows: gather each tile's rows by ``cp.async`` into its ring slot once the slot
        is free (``empty``), ``GATHER_AHEAD`` tiles ahead of the one whose landing it waits
        for, then signal that one ``ready``. Tile t is signalled only once the slot of tile
        t + ``GATHER_AHEAD`` has been claimed, so ``GATHER_AHEAD`` < ``NUM_BUF``."""
        NUM_BUF: gl.constexpr = lat_s.shape[0]
        ld_lat: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [gl.num_warps(), 1], [1, 0])
        ld_pe: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [gl.num_warps(), 1], [1, 0])
        offs_n_lat = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ld_lat))
        offs_n_pe = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ld_pe))
        offs_d_lat = gl.arange(0, D_LAT, layout=gl.SliceLayout(0, ld_lat))
        offs_d_pe = gl.arange(0, D_ROPE, layout=gl.SliceLayout(0, ld_pe))
        for i in gl.static_range(GATHER_AHEAD):
            mbarrier.wait(empty.index(i), 1)
            _gl_copy(KV, _gl_tile_rows(idx_row, start, end, i, 0, num_slots, offs_n_lat, BLOCK_N, BLOCK_N, row_tiles,
                                       head_blocks, stride_ib, num_idx, STREAM),
                     stride_kvn, 0, lat_s.index(i), offs_d_lat)
            _gl_copy(KV, _gl_tile_rows(idx_row, start, end, i, 0, num_slots, offs_n_pe, BLOCK_N, BLOCK_N, row_tiles,
                                       head_blocks, stride_ib, num_idx, STREAM),
                     stride_kvn, D_LAT, pe_s.index(i), offs_d_pe)
            async_copy.commit_group()
        rl = _gl_tile_rows(idx_row, start, end, GATHER_AHEAD, 0, num_slots, offs_n_lat, BLOCK_N, BLOCK_N, row_tiles,
                           head_blocks, stride_ib, num_idx, STREAM)
        rp = _gl_tile_rows(idx_row, start, end, GATHER_AHEAD, 0, num_slots, offs_n_pe, BLOCK_N, BLOCK_N, row_tiles,
                           head_blocks, stride_ib, num_idx, STREAM)
        for t in range(n_tiles):
            nxt = (t + GATHER_AHEAD) % NUM_BUF
            # tile t+GATHER_AHEAD (past the end: a zero fill of a free slot) in flight while tile t lands
            mbarrier.wait(empty.index(nxt), (((t + GATHER_AHEAD) // NUM_BUF) & 1) ^ 1)
            _gl_copy(KV, rl, stride_kvn, 0, lat_s.index(nxt), offs_d_lat)
            _gl_copy(KV, rp, stride_kvn, D_LAT, pe_s.index(nxt), offs_d_pe)
            async_copy.commit_group()
            rl = _gl_tile_rows(idx_row, start, end, t + GATHER_AHEAD + 1, 0, num_slots, offs_n_lat, BLOCK_N, BLOCK_N,
                               row_tiles, head_blocks, stride_ib, num_idx, STREAM)
            rp = _gl_tile_rows(idx_row, start, end, t + GATHER_AHEAD + 1, 0, num_slots, offs_n_pe, BLOCK_N, BLOCK_N,
                               row_tiles, head_blocks, stride_ib, num_idx, STREAM)
            async_copy.wait_group(GATHER_AHEAD)
            fence_async_shared()
            gl.thread_barrier()
            mbarrier.arrive(ready.index(t % NUM_BUF), count=1)
        async_copy.wait_group(0)

    @gluon.jit
    def _gl_producer_partition(KV, Scales, Rope, idx_row, start, end, num_slots, n_tiles, stride_kvn, stride_sn,
                               stride_rn, lat_s, pe_s, ready, empty, D_LAT: gl.constexpr, D_ROPE: gl.constexpr,
                               BLOCK_N: gl.constexpr, TILE: gl.constexpr, FIRST: gl.constexpr, STEP: gl.constexpr,
                               FP8: gl.constexpr, raw8, raw_sc, raw_pe, FP8_STAGES: gl.constexpr,
                               GATHER_AHEAD: gl.constexpr = 1, row_tiles=0, head_blocks=1, stride_ib=0, num_idx=0,
                               STREAM: gl.constexpr = False):
        """The producer warps for the rows' format: over FP8 rows (``FP8``)
        :func:`_gl_fp8_scale_partition` for tiles ``FIRST, FIRST + STEP, ..``, or with
        ``FP8_STAGES`` > 0 :func:`_gl_fp8_staged_partition` (every tile, through the staging
        ring ``raw8`` / ``raw_sc`` / ``raw_pe``, unread otherwise); over 16-bit rows
        :func:`_gl_gather_partition` for every tile, ``GATHER_AHEAD`` tiles ahead (``Scales``,
        ``Rope`` and their strides unread, ``FIRST`` 0 and ``STEP`` 1)."""
        if FP8 and FP8_STAGES > 0:
            _gl_fp8_staged_partition(KV, Scales, Rope, idx_row, start, end, num_slots, n_tiles, stride_kvn, stride_sn,
                                     stride_rn, lat_s, pe_s, ready, empty, raw8, raw_sc, raw_pe, D_LAT, D_ROPE, BLOCK_N,
                                     TILE, row_tiles, head_blocks, stride_ib, num_idx, STREAM)
        elif FP8:
            _gl_fp8_scale_partition(KV, Scales, Rope, idx_row, start, end, num_slots, n_tiles, stride_kvn, stride_sn,
                                    stride_rn, lat_s, pe_s, ready, empty, D_LAT, D_ROPE, BLOCK_N, TILE, FIRST, STEP,
                                    row_tiles, head_blocks, stride_ib, num_idx, STREAM)
        else:
            _gl_gather_partition(KV, idx_row, start, end, num_slots, n_tiles, stride_kvn, lat_s, pe_s, ready, empty,
                                 D_LAT, D_ROPE, BLOCK_N, GATHER_AHEAD, row_tiles, head_blocks, stride_ib, num_idx,
                                 STREAM)

    @gluon.jit
    def _gl_q_prefetch(q_row, stride_qh, num_heads, hb, q_lat_s, q_pe_s, BLOCK_H: gl.constexpr, D_LAT: gl.constexpr,
                       D_ROPE: gl.constexpr):
        """``cp.async`` head block ``hb`` of the query row ``q_row`` into ``q_lat_s [BLOCK_H,
        D_LAT]`` / ``q_pe_s [BLOCK_H, D_ROPE]`` in 64-column chunks (few address registers in
        a warpgroup holding its accumulators), rows past ``num_heads`` zero, committed as one
        group."""
        ld: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [gl.num_warps(), 1], [1, 0])
        offs_h = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, ld))
        offs_d = gl.arange(0, 64, layout=gl.SliceLayout(0, ld))
        ok = (offs_h < num_heads)[:, None]
        rows = q_row + offs_h[:, None] * stride_qh + offs_d[None, :]
        for c in gl.static_range(D_LAT // 64):
            async_copy.async_copy_global_to_shared(q_lat_s.slice(c * 64, 64, dim=1), rows + c * 64, mask=ok)
        for c in gl.static_range(D_ROPE // 64):
            async_copy.async_copy_global_to_shared(q_pe_s.slice(c * 64, 64, dim=1), rows + D_LAT + c * 64, mask=ok)
        async_copy.commit_group()

    @gluon.jit
    def _gl_softmax_partition(q_lat_s, q_pe_s, lat_s, pe_s, p_s, alpha_s, m_sh, l_sh, ready, empty, p_ready, p_free,
                              done, idx_row, start, end, num_slots, n_tiles, qk_scale_log2, Out, OutPartial, LsePartial,
                              b, hb, split, num_heads, stride_ob, stride_oh, stride_pb, stride_ph, stride_ps,
                              stride_lb, stride_lh, D_LAT: gl.constexpr, BLOCK_H: gl.constexpr,
                              BLOCK_N: gl.constexpr, SPLIT: gl.constexpr, t_base=0, q_next=None, hb_next=0,
                              stride_qh=0, has_next=False, D_ROPE: gl.constexpr = 64,
                              PREFETCH_Q: gl.constexpr = False):
        """Score warpgroup of :func:`_mla_gluon_ws_kernel` (the kernel's 4 warps): for each
        tile, once its slot is ready, the score MMA over all ``BLOCK_N`` tokens (m64nN),
        the online softmax (running max ``m_i``, row sums ``l_i``), ``P`` and the rescale
        factor into shared memory for the value warpgroup (``p_ready``, once it has freed
        them: ``p_free``), and the value MMA into the left half of ``O`` with ``P`` from
        registers, issued before ``P`` is published; at the end the
        row max and sums go to ``m_sh`` / ``l_sh`` (``done``) and the left half is stored.
        The tiles are the program's ring tiles ``t_base ..`` (slots and barrier phases). With
        ``PREFETCH_Q`` and ``has_next`` (the stream-K kernel's segments but its last), the next
        query row ``q_next``'s head block ``hb_next`` is brought into ``q_lat_s`` / ``q_pe_s`` by
        ``cp.async`` (:func:`_gl_q_prefetch`) as soon as the last tile's score MMA has read
        them; the caller waits for it."""
        NUM_BUF: gl.constexpr = lat_s.shape[0]
        HALF: gl.constexpr = D_LAT // 2
        mma_s: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, BLOCK_N, 16])
        mma_o: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, HALF, 16])
        p_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_o, k_width=2)
        offs_n_s = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, mma_s))
        m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=gl.SliceLayout(1, mma_s))
        l_i = gl.zeros([BLOCK_H], gl.float32, layout=gl.SliceLayout(1, mma_s))
        zero_s = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, layout=mma_s)
        o = gl.zeros([BLOCK_H, HALF], gl.float32, layout=mma_o)
        vs = _gl_valid_s(idx_row, start, end, 0, num_slots, offs_n_s, BLOCK_N)
        for i in range(n_tiles):
            t = t_base + i
            slot = t % NUM_BUF
            lat = lat_s.index(slot)
            valid = vs
            vs = _gl_valid_s(idx_row, start, end, i + 1, num_slots, offs_n_s, BLOCK_N)
            mbarrier.wait(ready.index(slot), (t // NUM_BUF) & 1)
            s_tok = warpgroup_mma(q_lat_s, lat.permute((1, 0)), zero_s, use_acc=False, is_async=True)
            s_tok = warpgroup_mma(q_pe_s, pe_s.index(slot).permute((1, 0)), s_tok, is_async=True)
            sc = warpgroup_mma_wait(num_outstanding=0, deps=[s_tok])
            if PREFETCH_Q:
                if (i == n_tiles - 1) & has_next:
                    _gl_q_prefetch(q_next, stride_qh, num_heads, hb_next, q_lat_s, q_pe_s, BLOCK_H, D_LAT, D_ROPE)
            sc = gl.where(valid[None, :], sc * qk_scale_log2, float("-inf"))
            m_new = gl.maximum(m_i, gl.max(sc, axis=1))
            m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = gl.exp2(m_i - m_safe)
            p = gl.exp2(sc - m_safe[:, None])
            l_i = l_i * alpha + gl.sum(p, axis=1)
            m_i = m_new
            pb = p.to(p_s.dtype)
            # this warpgroup's value MMA takes P from registers and runs while P is published
            o = o * gl.convert_layout(alpha, gl.SliceLayout(1, mma_o))[:, None]
            o_tok = warpgroup_mma(gl.convert_layout(pb, p_op), lat.slice(0, HALF, dim=1), o, is_async=True)
            mbarrier.wait(p_free, (t & 1) ^ 1)          # the value warpgroup is done with P and alpha of t-1
            p_s.store(pb)
            alpha_s.store(alpha)
            fence_async_shared()
            gl.thread_barrier()
            mbarrier.arrive(p_ready, count=1)
            o = warpgroup_mma_wait(num_outstanding=0, deps=[o_tok])
            gl.thread_barrier()
            mbarrier.arrive(empty.index(slot), count=1)
        m_sh.store(m_i)
        l_sh.store(l_i)
        gl.thread_barrier()
        mbarrier.arrive(done, count=1)
        row: gl.constexpr = gl.SliceLayout(1, mma_o)
        _gl_store_cols(o, gl.convert_layout(l_i, row), gl.convert_layout(m_i, row), Out, OutPartial, LsePartial, b,
                       hb, split, num_heads, stride_ob, stride_oh, stride_pb, stride_ph, stride_ps, stride_lb,
                       stride_lh, 0, mma_o, HALF, BLOCK_H, SPLIT, True)

    @gluon.jit
    def _gl_value_partition(lat_s, p_s, alpha_s, m_sh, l_sh, empty, p_ready, p_free, done, n_tiles, Out, OutPartial,
                            LsePartial, b, hb, split, num_heads, stride_ob, stride_oh, stride_pb, stride_ph, stride_ps,
                            stride_lb, stride_lh, D_LAT: gl.constexpr, BLOCK_H: gl.constexpr, SPLIT: gl.constexpr,
                            t_base=0, done_phase=0):
        """Value warpgroup of :func:`_mla_gluon_ws_kernel`: for each tile, once the score
        warpgroup has published ``P`` (``p_ready``), rescale the right half of ``O`` and run
        its value MMA, then free ``P`` (``p_free``) and its share of the slot (``empty``);
        at the end, with the row max and sums (``done`` at phase ``done_phase``), store the
        right half. The tiles are the program's ring tiles ``t_base ..``."""
        NUM_BUF: gl.constexpr = lat_s.shape[0]
        HALF: gl.constexpr = D_LAT // 2
        mma_o: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, HALF, 16])
        row: gl.constexpr = gl.SliceLayout(1, mma_o)
        o = gl.zeros([BLOCK_H, HALF], gl.float32, layout=mma_o)
        for i in range(n_tiles):
            t = t_base + i
            slot = t % NUM_BUF
            mbarrier.wait(p_ready, t & 1)
            o = o * alpha_s.load(row)[:, None]
            o_tok = warpgroup_mma(p_s, lat_s.index(slot).slice(HALF, HALF, dim=1), o, is_async=True)
            o = warpgroup_mma_wait(num_outstanding=0, deps=[o_tok])
            gl.thread_barrier()
            mbarrier.arrive(p_free, count=1)
            mbarrier.arrive(empty.index(slot), count=1)
        mbarrier.wait(done, done_phase)
        _gl_store_cols(o, l_sh.load(row), m_sh.load(row), Out, OutPartial, LsePartial, b, hb, split,
                       num_heads, stride_ob, stride_oh, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, HALF,
                       mma_o, HALF, BLOCK_H, SPLIT, False)

    @gluon.jit
    def _gl_ring_buffers(dtype: gl.constexpr, NUM_BUF: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_H: gl.constexpr,
                         D_LAT: gl.constexpr, D_ROPE: gl.constexpr, TILE: gl.constexpr, FP8_STAGES: gl.constexpr):
        """The shared memory the warp-specialised kernels' partitions pass tiles through:
        ``(lat_s [NUM_BUF, BLOCK_N, D_LAT], pe_s [NUM_BUF, BLOCK_N, D_ROPE])`` the 16-bit ring,
        ``p_s [BLOCK_H, BLOCK_N]`` and ``alpha_s [BLOCK_H]`` float32 from the score to the value
        warpgroup, the FP8 staging ring ``raw8, raw_sc, raw_pe`` (``FP8_STAGES`` > 0; else
        ``lat_s`` stands in, unread), and the initialised mbarriers ``ready``, ``empty`` (one a
        slot) and ``p_ready``, ``p_free``."""
        sh: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        sh_v: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
        lat_s = gl.allocate_shared_memory(dtype, [NUM_BUF, BLOCK_N, D_LAT], sh)
        pe_s = gl.allocate_shared_memory(dtype, [NUM_BUF, BLOCK_N, D_ROPE], sh)
        sh_p: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, BLOCK_N], dtype)
        p_s = gl.allocate_shared_memory(dtype, [BLOCK_H, BLOCK_N], sh_p)
        alpha_s = gl.allocate_shared_memory(gl.float32, [BLOCK_H], sh_v)
        if FP8_STAGES > 0:
            sh8: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
            raw8 = gl.allocate_shared_memory(gl.uint8, [FP8_STAGES, BLOCK_N, D_LAT], sh8)
            raw_sc = gl.allocate_shared_memory(gl.float32, [FP8_STAGES * (D_LAT // TILE), BLOCK_N], sh_v)
            raw_pe = gl.allocate_shared_memory(dtype, [FP8_STAGES, BLOCK_N, D_ROPE], sh8)
        else:
            raw8 = lat_s
            raw_sc = lat_s
            raw_pe = lat_s
        ready = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
        bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(NUM_BUF):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=2)     # the score and the value warpgroup
        for i in gl.static_range(2):
            mbarrier.init(bars.index(i), count=1)
        return lat_s, pe_s, p_s, alpha_s, raw8, raw_sc, raw_pe, ready, empty, bars.index(0), bars.index(1)

    @gluon.jit
    def _mla_gluon_ws_kernel(
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
        VALUE_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, FP8: gl.constexpr, FP8_STAGES: gl.constexpr,
        GATHER_AHEAD: gl.constexpr,
    ):
        """Sparse MLA decode as three warp-specialised warpgroups over a ``NUM_BUF``-deep ring
        of 16-bit tiles in shared memory. Producer warps (``PRODUCER_REGS`` registers a
        thread) fill a free slot with a tile: over FP8 rows (``FP8``,
        :func:`_gl_fp8_scale_partition`) they load the rows' bytes into registers and scale
        them into the slot (with ``FP8_STAGES`` > 0, :func:`_gl_fp8_staged_partition`, from a
        ``cp.async`` staging ring of that depth), over 16-bit rows
        (:func:`_gl_gather_partition`) they gather the rows by ``cp.async``. The score warpgroup (the kernel's 4 warps,
        :func:`_gl_softmax_partition`) runs the score MMA, the softmax and the left half of
        the value MMA; the value warpgroup (:func:`_gl_value_partition`, ``VALUE_REGS``) the
        right half. Slots pass through mbarriers ``ready`` (producer -> both) and ``empty``
        (both -> producer), ``P`` and the rescale factor through ``p_ready`` / ``p_free``.
        The producer's form follows ``FP8`` (:func:`_gl_producer_partition`)."""
        hb, b, split, start, end, n_tiles = _gl_split_range(tokens_per_split, num_idx, BLOCK_N)

        sh: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        sh_v: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
        lat_s, pe_s, p_s, alpha_s, raw8, raw_sc, raw_pe, ready, empty, p_ready, p_free = _gl_ring_buffers(
            Q.dtype.element_ty, NUM_BUF, BLOCK_N, BLOCK_H, D_LAT, D_ROPE, TILE, FP8_STAGES)
        m_sh = gl.allocate_shared_memory(gl.float32, [BLOCK_H], sh_v)
        l_sh = gl.allocate_shared_memory(gl.float32, [BLOCK_H], sh_v)
        done = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(done, count=1)

        q_lat_s, q_pe_s = _gl_q_tile(Q + b.to(gl.int64) * stride_qb, stride_qh, num_heads, hb, sh, BLOCK_H, D_LAT,
                                     D_ROPE)
        idx_row = Idx + b.to(gl.int64) * stride_ib
        gl.warp_specialize([
            (_gl_softmax_partition, (q_lat_s, q_pe_s, lat_s, pe_s, p_s, alpha_s, m_sh, l_sh, ready, empty, p_ready,
                                     p_free, done, idx_row, start, end, num_slots, n_tiles, qk_scale_log2, Out,
                                     OutPartial, LsePartial, b, hb, split, num_heads, stride_ob, stride_oh,
                                     stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, D_LAT, BLOCK_H,
                                     BLOCK_N, SPLIT)),
            (_gl_value_partition, (lat_s, p_s, alpha_s, m_sh, l_sh, empty, p_ready, p_free, done, n_tiles, Out,
                                   OutPartial, LsePartial, b, hb, split, num_heads, stride_ob, stride_oh,
                                   stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, D_LAT, BLOCK_H, SPLIT)),
            (_gl_producer_partition, (KV, Scales, Rope, idx_row, start, end, num_slots, n_tiles, stride_kvn,
                                      stride_sn, stride_rn, lat_s, pe_s, ready, empty, D_LAT, D_ROPE, BLOCK_N,
                                      TILE, 0, 1, FP8, raw8, raw_sc, raw_pe, FP8_STAGES, GATHER_AHEAD)),
        ], [4, 4], [VALUE_REGS, PRODUCER_REGS])

    _HAS_WS = True
except Exception as _e:  # noqa: BLE001 - a Triton without this Gluon API: gluon_ok is False there too
    _HAS_WS = False
    _WS_ERROR = repr(_e)


def producer_operands(kv: torch.Tensor, Dl: int, producer_regs: int, *, fp8: bool) -> dict:
    """The producer partitions' row operands of a warp-specialised launch: over FP8 rows
    (``fp8``) their scale and rope views and strides, over 16-bit rows ``kv`` in their
    place (unread); ``PRODUCER_REGS`` = ``producer_regs``."""
    if fp8:
        scales, rope = fp8_row_views(kv, Dl)
        return dict(Scales=scales, Rope=rope, stride_sn=scales.stride(0), stride_rn=rope.stride(0),
                    PRODUCER_REGS=producer_regs)
    return dict(Scales=kv, Rope=kv, stride_sn=0, stride_rn=0, PRODUCER_REGS=producer_regs)


def launch_ws(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, out: torch.Tensor, sm_scale: float,
              grid: tuple[int, int, int], tokens_per_split: int, splits: int, cfg: MlaGluonConfig, Dl: int, *,
              fp8: bool) -> torch.Tensor:
    """Launch :func:`_mla_gluon_ws_kernel` over ``kv`` (FP8 rows where ``fp8``, else 16-bit
    rows) for ``q [B, H, Dl + Dr]``, ``indices [B, K]`` int32 into ``out [B, H, Dl]`` (the
    caller, ``sparse_mla_gluon``, has checked the inputs and ``cfg``)."""
    Dr = q.shape[2] - Dl
    extra = producer_operands(kv, Dl, _SCALE_REGS if fp8 else _GATHER_REGS, fp8=fp8)
    return launch_split(_mla_gluon_ws_kernel, grid, q, kv, indices, out, sm_scale, tokens_per_split, splits,
                        D_LAT=Dl, D_ROPE=Dr, BLOCK_H=64, BLOCK_N=cfg.block_n, NUM_BUF=cfg.num_buf, TILE=FP8_TILE,
                        VALUE_REGS=_VALUE_REGS, FP8=fp8, FP8_STAGES=cfg.fp8_stages if fp8 else 0,
                        GATHER_AHEAD=ws_gather_ahead(cfg, fp8, tokens_per_split),
                        maxnreg=_WS_MAXNREG, num_warps=4, **extra)
