"""Launch of the Hopper Gluon sparse MLA decode kernels (:func:`sparse_mla_gluon`): checks
an :class:`MlaGluonConfig` against the rows, picks the split count and runs the 8-warp
kernels of ``sparse_mla_gluon`` or the warp-specialised one of ``sparse_mla_gluon_ws``.
"""
from __future__ import annotations

import torch

from hicache.triton_support import cdiv, sm_count
from sparsehi.kernels.flash_decoding import INTERPRETER_SMS, fail, split_tokens
from sparsehi.kernels.mla_fp8_latents import FP8_TILE
from sparsehi.kernels.sparse_mla_common import fp8_row_views, launch_split, mla_max_splits, mla_num_splits
from sparsehi.kernels.sparse_mla_gluon import (NARROW_MAX_HEADS, MlaGluonConfig, _mla_gluon_fp8_kernel,
                                               _mla_gluon_kernel, check_gluon_config, gluon_ok, producer_warps)
from sparsehi.kernels.sparse_mla_gluon_narrow import launch_narrow
from sparsehi.kernels.sparse_mla_gluon_stream import launch_stream
from sparsehi.kernels.sparse_mla_gluon_ws import launch_ws


SPLIT_COST_TILES = {False: (0.34, 0.071, 2.2), True: (0.41, 0.024, 0.58)}
"""Over 16-bit (False) and FP8 rows (True): what a launch of the 64-head-block kernels costs
beyond its tiles, in units of one tile of its loop: ``(a wave, a split's partial output of a
program, splitting at all)``; fitted to one H200's times at 128 heads and K=2176, 8 to 128
rows, 1 to 8 splits (``benchmarks/results/mla_split_count.json``, 2026-11-28)."""
SPLIT_COST_MARGIN = 0.02
"""Fewer splits win unless more cost this much less (the model is coarse: at 30 rows of
32768 indices over 16-bit rows it put 11 splits 0.4 % under 2, which ran 4 % slower)."""


def gluon_num_splits(programs: int, tiles: int, sms: int, fp8: bool, max_splits: int) -> int:
    """Split-K count of the 64-head-block Gluon kernels (one program an SM: their shared
    memory): the fewest splits ``s`` in ``1..max_splits`` whose ``cost(s) = waves(s) x (tiles /
    s + a) + [s > 1] (b x programs x s + c)`` is within ``SPLIT_COST_MARGIN`` of the least, with
    ``(a, b, c) = SPLIT_COST_TILES[fp8]`` and ``waves(s) = ceil(programs x s / sms)``. Where
    splitting only while the grid is under one wave (``mla_num_splits``) takes one split, it
    splits a grid of half a wave to one (78 programs: 3 splits, 1.12x at 128 heads over FP8
    rows) and one of a little over a wave (192: 2)."""
    a, b, c = SPLIT_COST_TILES[fp8]

    def cost(s: int) -> float:
        return cdiv(programs * s, sms) * (cdiv(tiles, s) + a) + (b * programs * s + c if s > 1 else 0.0)

    counts = range(1, max(1, max_splits) + 1)
    least = min(cost(s) for s in counts)
    return next(s for s in counts if cost(s) <= least * (1 + SPLIT_COST_MARGIN))


STREAM_K_MAX_FILL = 0.9
"""The default runs stream-K where split-K's grid takes more than one wave and fills its
waves to less than this. At 128 heads and K=2176 on one H200 (``mla_stream_k.json``), 39
rows (3 splits: 234 programs, 0.89 of two waves) took 112.5 -> 105.8 us over FP8 rows and
92.6 -> 90.6 over bf16 rows. Where split-K runs one wave or full waves, stream-K was up to
3.8x slower (its partial outputs and their merge cost more than its balance saves), except
at two one-wave FP8 shapes (1.5 % and 4.6 % faster), which the rule leaves to split-K."""


def stream_k(cfg: MlaGluonConfig, split_programs: int, sms: int) -> bool:
    """Whether a warp-specialised launch of ``cfg`` runs stream-K (``sparse_mla_gluon_stream``)
    in place of split-K over ``split_programs`` programs: ``cfg.stream_k`` where set, else
    (no split count set in ``cfg``) where the split-K grid takes more than one wave of
    ``sms`` programs and fills them to less than ``STREAM_K_MAX_FILL``."""
    if cfg.stream_k is not None:
        return cfg.stream_k
    if cfg.num_splits:
        return False
    waves = cdiv(split_programs, sms)
    return waves > 1 and split_programs < STREAM_K_MAX_FILL * waves * sms


def gluon_splits(cfg: MlaGluonConfig, programs: int, num_idx: int, sms: int, fp8: bool) -> int:
    """The split count a Gluon launch of ``programs`` (rows x head blocks) over ``num_idx``
    indices asks ``split_tokens`` for: ``cfg.num_splits`` when set; the token-rows kernels
    ``mla_num_splits``; the 64-head-block ones ``gluon_num_splits``, up to ``mla_max_splits``."""
    if cfg.num_splits:
        return cfg.num_splits
    if cfg.token_rows:
        return mla_num_splits(programs, num_idx, cfg.block_n, sms)
    return gluon_num_splits(programs, cdiv(num_idx, cfg.block_n), sms, fp8, mla_max_splits(num_idx, cfg.block_n))


def sparse_mla_gluon(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, out: torch.Tensor,
                     Dl: int, sm_scale: float, cfg: MlaGluonConfig) -> torch.Tensor:
    """Launch a Gluon kernel over 16-bit ``kv [num_slots, Dl + Dr]`` or FP8 rows ``kv
    [num_slots, bytes]`` uint8 for ``q [B, H, Dl + Dr]`` and ``indices [B, K]`` int32 into ``out
    [B, H, Dl]`` (checked by ``check_mla``; where ``gluon_ok``): the warp-specialised kernel
    where ``producer_warps(cfg, fp8)`` is 4, else ``_mla_gluon_kernel`` /
    ``_mla_gluon_fp8_kernel``; with ``cfg.token_rows`` the narrow kernel of
    ``sparse_mla_gluon_narrow`` (16-head blocks up to 16 heads, else 32); the warp-specialised
    kernel in its stream-K form (``sparse_mla_gluon_stream``) where :func:`stream_k`."""
    B, H, Dq = q.shape
    K = indices.shape[1]
    if cfg.block_n not in (32, 64) or not (1 <= cfg.num_buf <= 4) or (cfg.late_issue and cfg.num_buf < 2):
        fail("config", "an MlaGluonConfig with block_n in (32, 64), num_buf in 1..4 (>= 2 with late_issue)", cfg)
    fp8 = kv.dtype == torch.uint8
    check_gluon_config(cfg, Dl, Dq - Dl, fp8, H)
    if fp8 and not gluon_ok(q, Dl, Dq - Dl, kv):
        fail("kv_buffer", "FP8 rows of DeepSeek's 512 + 64 layout on 16-byte boundaries, with bf16 q on a "
             "Hopper GPU, for the Gluon FP8 kernel", (tuple(kv.shape), kv.stride(), q.dtype))
    block_h = 64
    if cfg.token_rows:
        block_h = 16 if H <= 16 else NARROW_MAX_HEADS
    head_blocks = cdiv(H, block_h)
    sms = sm_count(q.device, off_cuda=INTERPRETER_SMS)
    splits, tps = split_tokens(K, gluon_splits(cfg, B * head_blocks, K, sms, fp8), cfg.block_n)
    if not cfg.token_rows and producer_warps(cfg, fp8) and stream_k(cfg, B * head_blocks * splits, sms):
        return launch_stream(q, kv, indices, out, sm_scale, sms, cfg, Dl, fp8=fp8)
    grid = (head_blocks, B, splits)
    if cfg.token_rows:
        return launch_narrow(q, kv, indices, out, sm_scale, grid, tps, splits, cfg, Dl, block_h, fp8=fp8)
    if producer_warps(cfg, fp8):
        return launch_ws(q, kv, indices, out, sm_scale, grid, tps, splits, cfg, Dl, fp8=fp8)
    if fp8:
        scales, rope = fp8_row_views(kv, Dl)
        return launch_split(_mla_gluon_fp8_kernel, grid, q, kv, indices, out, sm_scale, tps, splits,
                            Scales=scales, Rope=rope, stride_sn=scales.stride(0), stride_rn=rope.stride(0), D_LAT=Dl,
                            D_ROPE=Dq - Dl, BLOCK_H=64, BLOCK_N=cfg.block_n, NUM_BUF=cfg.num_buf, TILE=FP8_TILE,
                            num_warps=8)
    return launch_split(_mla_gluon_kernel, grid, q, kv, indices, out, sm_scale, tps, splits,
                        D_LAT=Dl, D_ROPE=Dq - Dl, BLOCK_H=64, BLOCK_N=cfg.block_n, NUM_BUF=cfg.num_buf,
                        LATE_ISSUE=cfg.late_issue, num_warps=8)
