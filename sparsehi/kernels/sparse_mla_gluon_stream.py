"""Stream-K sparse MLA decode on Hopper in Gluon (:func:`_mla_gluon_stream_kernel`;
``MlaGluonConfig.stream_k``): the warp-specialised kernel of ``sparse_mla_gluon_ws`` with at
most one program an SM, each walking an equal share of the tiles of all (request, head
block) pairs.

Split-K gives each program one pair's range of tiles, so a grid that is not a whole number
of waves leaves SMs idle in its last wave (39 requests x 2 head blocks x 3 splits: 234
programs, 1.77 waves of 132 SMs). Here program ``p`` of ``P`` takes tiles ``p * T // P ..
(p + 1) * T // P`` of the pairs' concatenation (``T`` tiles; pairs request-major, ``row_tiles``
tiles each), so every program has ``T // P`` or one more tile. Its producer warps walk
those tiles without regard to pair boundaries (``_gl_tile_rows`` with ``STREAM``); its score
and value warpgroups run one segment a pair it touches, loading that pair's queries and
writing an fp32 partial output and log-sum-exp into part ``p - owner(first tile of the
pair)``. The program holding a pair's first tile also marks the pair's unused parts (up to
``max_parts``) empty, and ``flash_decoding.merge_splits`` merges the parts.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from hicache.triton_support import cdiv
from sparsehi.kernels.flash_decoding import merge_splits
from sparsehi.kernels.mla_fp8_latents import FP8_TILE
from sparsehi.kernels.sparse_mla_gluon import MlaGluonConfig, ws_gather_ahead
from sparsehi.kernels.sparse_mla_gluon_ws import (_GATHER_REGS, _SCALE_REGS, _VALUE_REGS, _WS_MAXNREG,
                                                  producer_operands)


@dataclass(frozen=True)
class StreamKPlan:
    """A stream-K launch over ``pairs`` (request, head block) pairs of ``row_tiles`` tiles:
    ``programs`` programs (at most one an SM, at most one a tile) and ``max_parts``, the most
    programs any pair's tiles span (the partial outputs a pair can have)."""

    pairs: int
    row_tiles: int
    programs: int
    max_parts: int

    @property
    def total_tiles(self) -> int:
        return self.pairs * self.row_tiles

    def owner(self, tile: int) -> int:
        """The program whose share holds ``tile`` (shares ``p * T // P .. (p + 1) * T // P``)."""
        return ((tile + 1) * self.programs - 1) // self.total_tiles

    def segments(self, program: int) -> list[tuple[int, int, int, int]]:
        """``(pair, first tile, end tile, part)`` of each pair ``program`` touches, tiles
        counted within the pair: the Python form of the kernel's walk."""
        g0 = program * self.total_tiles // self.programs
        g1 = (program + 1) * self.total_tiles // self.programs
        out = []
        for pair in range(g0 // self.row_tiles, (g1 - 1) // self.row_tiles + 1):
            t0 = max(g0 - pair * self.row_tiles, 0)
            t1 = min(g1 - pair * self.row_tiles, self.row_tiles)
            out.append((pair, t0, t1, program - self.owner(pair * self.row_tiles)))
        return out


def stream_k_plan(pairs: int, row_tiles: int, sms: int) -> StreamKPlan:
    """The :class:`StreamKPlan` of ``pairs`` pairs of ``row_tiles`` tiles on ``sms`` SMs. Each
    program holds at least ``T // P`` tiles, so after a pair's first tile the rest (``row_tiles
    - 1``) span at most ``cdiv(row_tiles - 1, T // P)`` more programs."""
    if pairs < 1 or row_tiles < 1 or sms < 1:
        raise ValueError(f"pairs, row_tiles and sms must be >= 1; got {(pairs, row_tiles, sms)}")
    total = pairs * row_tiles
    programs = min(sms, total)
    return StreamKPlan(pairs, row_tiles, programs, min(programs, cdiv(row_tiles - 1, total // programs) + 1))


try:  # the Gluon API of sparse_mla_gluon_ws
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import async_copy, fence_async_shared, mbarrier

    from sparsehi.kernels.sparse_mla_gluon_ws import (_gl_producer_partition, _gl_ring_buffers,
                                                      _gl_softmax_partition, _gl_value_partition)

    @gluon.jit
    def _gl_owner(tile, num_programs, total_tiles):
        """:meth:`StreamKPlan.owner` in the kernel."""
        return ((tile + 1) * num_programs - 1) // total_tiles

    @gluon.jit
    def _gl_segment(pair, g0, g1, row_tiles, head_blocks, pid, num_programs, total_tiles):
        """One entry of :meth:`StreamKPlan.segments` for program ``pid`` (tiles ``g0 .. g1``):
        ``(request, head block, part, first tile, end tile)`` of ``pair``, tiles within the
        pair, and the program's ring position of the first (``t_base``)."""
        t0 = gl.maximum(g0 - pair * row_tiles, 0)
        t1 = gl.minimum(g1 - pair * row_tiles, row_tiles)
        b = pair // head_blocks
        part = pid - _gl_owner(pair * row_tiles, num_programs, total_tiles)
        return b, pair - b * head_blocks, part, t0, t1, pair * row_tiles + t0 - g0

    @gluon.jit
    def _gl_stream_softmax(Q, stride_qb, stride_qh, q_lat_s, q_pe_s, lat_s, pe_s, p_s, alpha_s, m_sh, l_sh, ready,
                           empty, p_ready, p_free, done, Idx, stride_ib, pid, g0, g1, row_tiles, head_blocks,
                           num_programs, total_tiles, max_parts, num_slots, num_idx, qk_scale_log2, Out, OutPartial,
                           LsePartial, num_heads, stride_ob, stride_oh, stride_pb, stride_ph, stride_ps, stride_lb,
                           stride_lh, D_LAT: gl.constexpr, D_ROPE: gl.constexpr, BLOCK_H: gl.constexpr,
                           BLOCK_N: gl.constexpr, PREFETCH_Q: gl.constexpr):
        """Score warpgroup of :func:`_mla_gluon_stream_kernel`: for each pair the program
        touches, that request's queries of that head block in ``q_lat_s`` / ``q_pe_s`` (loaded
        here; with ``PREFETCH_Q`` only the first, each later one brought by ``cp.async`` while
        the segment before finishes), then ``_gl_softmax_partition`` over the segment's tiles
        into the pair's part (statistics and ``done`` alternate between two sets, so the value
        warpgroup may still read one segment's while this one finishes the next); the program
        holding the pair's first tile marks its parts past the last one empty (log-sum-exp
        -inf)."""
        ld_lat: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [gl.num_warps(), 1], [1, 0])
        ld_pe: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [gl.num_warps(), 1], [1, 0])
        lse_l: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
        offs_h_lat = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, ld_lat))
        offs_d_lat = gl.arange(0, D_LAT, layout=gl.SliceLayout(0, ld_lat))
        offs_h_pe = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, ld_pe))
        offs_d_pe = gl.arange(0, D_ROPE, layout=gl.SliceLayout(0, ld_pe))
        offs_h_l = gl.arange(0, BLOCK_H, layout=lse_l)
        first = g0 // row_tiles
        last = (g1 - 1) // row_tiles
        for pair in range(first, last + 1):
            seg = pair - first
            b, hb, part, t0, t1, t_base = _gl_segment(pair, g0, g1, row_tiles, head_blocks, pid, num_programs,
                                                      total_tiles)
            if (seg == 0) | (not PREFETCH_Q):
                q_row = Q + b.to(gl.int64) * stride_qb
                h_lat = hb * BLOCK_H + offs_h_lat
                h_pe = hb * BLOCK_H + offs_h_pe
                q_lat_s.store(gl.load(q_row + h_lat[:, None] * stride_qh + offs_d_lat[None, :],
                                      mask=(h_lat < num_heads)[:, None], other=0.0))
                q_pe_s.store(gl.load(q_row + h_pe[:, None] * stride_qh + D_LAT + offs_d_pe[None, :],
                                     mask=(h_pe < num_heads)[:, None], other=0.0))
            else:
                async_copy.wait_group(0)                # brought during the segment before
            fence_async_shared()
            gl.thread_barrier()
            b_next = (pair + 1) // head_blocks
            _gl_softmax_partition(q_lat_s, q_pe_s, lat_s, pe_s, p_s, alpha_s, m_sh.index(seg % 2),
                                  l_sh.index(seg % 2), ready, empty, p_ready, p_free, done.index(seg % 2),
                                  Idx + b.to(gl.int64) * stride_ib, t0 * BLOCK_N, gl.minimum(t1 * BLOCK_N, num_idx),
                                  num_slots, t1 - t0, qk_scale_log2, Out, OutPartial, LsePartial, b, hb, part,
                                  num_heads, stride_ob, stride_oh, stride_pb, stride_ph, stride_ps, stride_lb,
                                  stride_lh, D_LAT, BLOCK_H, BLOCK_N, True, t_base,
                                  Q + b_next.to(gl.int64) * stride_qb, pair + 1 - b_next * head_blocks, stride_qh,
                                  pair < last, D_ROPE, PREFETCH_Q)
            if part == 0:
                parts = _gl_owner(pair * row_tiles + row_tiles - 1, num_programs, total_tiles) - pid + 1
                h = hb * BLOCK_H + offs_h_l
                lse_row = LsePartial + b.to(gl.int64) * stride_lb + h * stride_lh
                for k in range(parts, max_parts):
                    gl.store(lse_row + k, gl.full([BLOCK_H], float("-inf"), gl.float32, layout=lse_l),
                             mask=h < num_heads)

    @gluon.jit
    def _gl_stream_value(lat_s, p_s, alpha_s, m_sh, l_sh, empty, p_ready, p_free, done, g0, g1, row_tiles,
                         head_blocks, pid, num_programs, total_tiles, Out, OutPartial, LsePartial, num_heads,
                         stride_ob, stride_oh, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
                         D_LAT: gl.constexpr, BLOCK_H: gl.constexpr):
        """Value warpgroup of :func:`_mla_gluon_stream_kernel`: ``_gl_value_partition`` over
        each segment's tiles into the pair's part, with the statistics set and ``done``
        phase of the segment."""
        first = g0 // row_tiles
        for pair in range(first, (g1 - 1) // row_tiles + 1):
            seg = pair - first
            b, hb, part, t0, t1, t_base = _gl_segment(pair, g0, g1, row_tiles, head_blocks, pid, num_programs,
                                                      total_tiles)
            _gl_value_partition(lat_s, p_s, alpha_s, m_sh.index(seg % 2), l_sh.index(seg % 2), empty, p_ready, p_free,
                                done.index(seg % 2), t1 - t0, Out, OutPartial, LsePartial, b, hb, part, num_heads,
                                stride_ob, stride_oh, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, D_LAT,
                                BLOCK_H, True, t_base, (seg // 2) & 1)

    @gluon.jit
    def _mla_gluon_stream_kernel(
        Q, KV, Idx, OutPartial, LsePartial,
        qk_scale_log2,
        stride_qb, stride_qh, stride_kvn, stride_ib,
        stride_pb, stride_ph, stride_ps,
        stride_lb, stride_lh,
        num_heads, num_idx, num_slots,
        Scales, Rope, stride_sn, stride_rn,
        row_tiles, head_blocks, total_tiles, max_parts,
        D_LAT: gl.constexpr, D_ROPE: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr,
        NUM_BUF: gl.constexpr, TILE: gl.constexpr,
        VALUE_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, FP8: gl.constexpr, FP8_STAGES: gl.constexpr,
        GATHER_AHEAD: gl.constexpr,
    ):
        """Stream-K form of ``_mla_gluon_ws_kernel`` (module docstring): program ``pid`` of a
        1-D grid takes tiles ``pid * total_tiles // P .. (pid + 1) * total_tiles // P`` of the
        (request, head block) pairs' ``row_tiles`` tiles each, and writes partial outputs
        ``OutPartial [B, H, max_parts, D_LAT]`` and their log-sum-exp for the merge."""
        pid = gl.program_id(0)
        num_programs = gl.num_programs(0)
        g0 = pid * total_tiles // num_programs
        g1 = (pid + 1) * total_tiles // num_programs
        sh: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        sh_v: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
        dtype: gl.constexpr = Q.dtype.element_ty
        lat_s, pe_s, p_s, alpha_s, raw8, raw_sc, raw_pe, ready, empty, p_ready, p_free = _gl_ring_buffers(
            dtype, NUM_BUF, BLOCK_N, BLOCK_H, D_LAT, D_ROPE, TILE, FP8_STAGES)
        q_lat_s = gl.allocate_shared_memory(dtype, [BLOCK_H, D_LAT], sh)
        q_pe_s = gl.allocate_shared_memory(dtype, [BLOCK_H, D_ROPE], sh)
        m_sh = gl.allocate_shared_memory(gl.float32, [2, BLOCK_H], sh_v)
        l_sh = gl.allocate_shared_memory(gl.float32, [2, BLOCK_H], sh_v)
        done = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(2):
            mbarrier.init(done.index(i), count=1)
        gl.warp_specialize([
            (_gl_stream_softmax, (Q, stride_qb, stride_qh, q_lat_s, q_pe_s, lat_s, pe_s, p_s, alpha_s, m_sh, l_sh,
                                  ready, empty, p_ready, p_free, done, Idx, stride_ib, pid, g0, g1, row_tiles,
                                  head_blocks, num_programs, total_tiles, max_parts, num_slots, num_idx,
                                  qk_scale_log2, OutPartial, OutPartial, LsePartial, num_heads, 0, 0, stride_pb,
                                  stride_ph, stride_ps, stride_lb, stride_lh, D_LAT, D_ROPE, BLOCK_H, BLOCK_N,
                                  not FP8)),
            (_gl_stream_value, (lat_s, p_s, alpha_s, m_sh, l_sh, empty, p_ready, p_free, done, g0, g1, row_tiles,
                                head_blocks, pid, num_programs, total_tiles, OutPartial, OutPartial, LsePartial,
                                num_heads, 0, 0, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, D_LAT,
                                BLOCK_H)),
            (_gl_producer_partition, (KV, Scales, Rope, Idx, g0, g1, num_slots, g1 - g0, stride_kvn, stride_sn,
                                      stride_rn, lat_s, pe_s, ready, empty, D_LAT, D_ROPE, BLOCK_N, TILE, 0, 1, FP8,
                                      raw8, raw_sc, raw_pe, FP8_STAGES, GATHER_AHEAD, row_tiles, head_blocks,
                                      stride_ib, num_idx, True)),
        ], [4, 4], [VALUE_REGS, PRODUCER_REGS])

    _HAS_STREAM = True
except Exception as _e:  # noqa: BLE001 - a Triton without this Gluon API: gluon_ok is False there too
    _HAS_STREAM = False
    _STREAM_ERROR = repr(_e)


def launch_stream(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, out: torch.Tensor, sm_scale: float,
                  sms: int, cfg: MlaGluonConfig, Dl: int, *, fp8: bool) -> torch.Tensor:
    """Launch :func:`_mla_gluon_stream_kernel` over ``kv`` (FP8 rows where ``fp8``, else
    16-bit rows) for ``q [B, H, Dl + Dr]``, ``indices [B, K]`` int32 into ``out [B, H, Dl]``
    (64-head blocks; the caller, ``sparse_mla_gluon``, has checked the inputs and ``cfg``),
    then merge the partial outputs."""
    B, H, Dq = q.shape
    K = indices.shape[1]
    head_blocks = cdiv(H, 64)
    plan = stream_k_plan(B * head_blocks, cdiv(K, cfg.block_n), sms)
    part = torch.empty((B, H, plan.max_parts, Dl), dtype=torch.float32, device=out.device)
    lse = torch.empty((B, H, plan.max_parts), dtype=torch.float32, device=out.device)
    extra = producer_operands(kv, Dl, _SCALE_REGS if fp8 else _GATHER_REGS, fp8=fp8)
    _mla_gluon_stream_kernel[(plan.programs,)](
        q, kv, indices, part, lse,
        float(sm_scale) * 1.4426950408889634,
        q.stride(0), q.stride(1), kv.stride(0), indices.stride(0),
        part.stride(0), part.stride(1), part.stride(2), lse.stride(0), lse.stride(1),
        H, K, kv.shape[0],
        extra.pop("Scales"), extra.pop("Rope"), extra.pop("stride_sn"), extra.pop("stride_rn"),
        plan.row_tiles, head_blocks, plan.total_tiles, plan.max_parts,
        D_LAT=Dl, D_ROPE=Dq - Dl, BLOCK_H=64, BLOCK_N=cfg.block_n, NUM_BUF=cfg.num_buf, TILE=FP8_TILE,
        VALUE_REGS=_VALUE_REGS, FP8=fp8, FP8_STAGES=cfg.fp8_stages if fp8 else 0,
        GATHER_AHEAD=ws_gather_ahead(cfg, fp8, plan.total_tiles // plan.programs * cfg.block_n),
        maxnreg=_WS_MAXNREG, num_warps=4, **extra)
    merge_splits(part, lse, out, max(16, 1 << (Dl - 1).bit_length()))
    return out
