"""Sparse MLA decode attention over token indices (DeepSeek DSA style).

MLA with the absorbed query: every head attends to the same latent KV rows
``kv[slot] = [c_kv (kv_lora_rank) | k_rope (rope_dim)]`` (one "kv head"); the score is
``q · kv`` over all ``kv_lora_rank + rope_dim`` dims and the value is the latent part
``kv[:, :kv_lora_rank]``. Each row attends to the slots ``indices[b]`` (``-1`` padding,
anywhere in the row; out-of-pool slots are masked too, never read).

The fused kernel here (:class:`MlaLaunchConfig`): one program per (head block, request,
split); the head block is the fastest grid axis so the programs reading the same KV rows
run side by side and the repeat reads hit L2. Scores are two ``tl.dot`` (latent and rope
parts), the value product reuses the latent tile already loaded (``tl.trans``), so each KV
row is loaded once per head block. Split-K over the index list with a log-sum-exp merge
(``flash_decoding``).

``sparse_mla_decode_triton`` also runs the other two kernels by their config:
:class:`MlaGluonConfig` (``sparse_mla_gluon``, Hopper; the default for launches of at
least ``GLUON_MIN_HEAD_BLOCKS`` 64-head blocks there, over 16-bit rows of at least
``GLUON_MIN_INDICES`` indices (a dense decode's whole context) and over FP8 rows of at
least ``GLUON_FP8_MIN_HEADS`` heads at any batch; over 16-bit rows the
warp-specialised kernel above 64 heads (its gather producer two tiles ahead on long
splits); the token-rows kernel over FP8 rows up to 32 heads and over 16-bit rows up to 16
heads, at any batch (over 16-bit rows with two MMA warpgroups where a program walks 512
indices or more); over FP8
rows at 33-64 heads from 16 query rows a ``cp.async`` staging ring for the FP8 producer)
and :class:`MlaTwoPassConfig` (``sparse_mla_two_pass``, opt-in). Their measurements: docs/kernels.md.

FP8 latent rows (``kv_buffer`` uint8 in the DeepSeek-V3.2 / FlashMLA layout,
``mla_fp8_latents``): the Gluon kernels have FP8 forms (by default the warp-specialised
``_mla_gluon_ws_kernel``, whose producer warps load E4M3 bytes and scale them into a ring
of 16-bit shared tiles; ``_mla_gluon_fp8_kernel`` with ``producer_warps=0``) and are the
default on Hopper as for 16-bit rows; the fused kernel loads each tile's E4M3 bytes and float32 scales, scales
them in registers and runs the same dots in q's dtype. Neither keeps a dequantised copy in
global memory; the two-pass kernel has no FP8 form.

Entry points: ``sparse_mla_decode`` (dispatch), ``sparse_mla_decode_triton``,
``sparse_mla_decode_reference``.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import torch
import triton
import triton.language as tl

from hicache.triton_support import announce_path, cdiv, dispatch, interpreter_enabled, sm_count
from sparsehi.kernels.flash_decoding import INTERPRETER_SMS, dot_in_fp32, fail, split_tokens, store_split_result
from sparsehi.kernels.mla_fp8_latents import (FP8_TILE, dequantize_mla_latents, load_fp8_latent_cols,
                                              load_fp8_latent_rows)
from sparsehi.kernels.sparse_mla_common import (check_mla, fp8_row_views, index_tile, launch_split, load_rows,
                                                mla_num_splits)
from sparsehi.kernels.sparse_mla_gluon import (MlaGluonConfig, check_gluon_config, default_gluon_config, gluon_ok,
                                               token_rows_default)
from sparsehi.kernels.sparse_mla_gluon_launch import sparse_mla_gluon
from sparsehi.kernels.sparse_mla_two_pass import MlaTwoPassConfig, sparse_mla_two_pass

__all__ = ["GLUON_FP8_MIN_HEADS", "GLUON_MIN_HEAD_BLOCKS", "GLUON_MIN_INDICES", "MlaGluonConfig", "MlaLaunchConfig",
           "MlaTwoPassConfig", "default_mla_config", "default_mla_fp8_config", "mla_num_splits", "sparse_mla_decode",
           "sparse_mla_decode_reference", "sparse_mla_decode_triton"]


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


# Default dispatch on Hopper: the Gluon kernel once a launch has at least this many 64-head
# blocks (batch x ceil(heads / 64)); below it the fused Triton kernel's 16-head blocks keep
# more SMs busy (measured: docs/kernels.md).
GLUON_MIN_HEAD_BLOCKS = 4

# ... and below it too over 16-bit rows once each row attends this many indices (a dense
# decode over a long context): at 128 heads, batch 1, 32768 indices the fused kernel's 16-head
# blocks read every KV row 8 times and take 108.9 us against the warp-specialised Gluon
# kernel's 43.3; at 2176 indices the fused kernel is faster (15.0 against 16.4 us).
GLUON_MIN_INDICES = 8192

# Over FP8 rows from this many heads the Gluon kernel at every batch: at 128 heads and batch
# 1 the fused kernel (16-head blocks, E4M3 scaled in registers) took 31.3 us over 2176
# indices and 332.7 over 32768, against 16.5 and 44.9 for the warp-specialised Gluon kernel.
GLUON_FP8_MIN_HEADS = 128


def default_mla_config(device: torch.device, num_heads: int, batch: int = 1,
                       num_idx: Optional[int] = None) -> MlaLaunchConfig:
    """Block sizes of the fused kernel (chosen by H200 sweeps: docs/kernels.md).

    Many rows (``batch * heads / 64 >= 8``): 64-head blocks, 64-token tiles, 8 warps —
    the KV tile is read once per 64 heads and the dots are large; 3 pipeline stages when
    each program walks >= 8 tiles (``num_idx`` after the split heuristic; None = assume
    long), so the index tile is fetched asynchronously too, else 2 (a deeper prologue
    costs more than it hides on short loops). Few rows: 16-head blocks (4x the programs)
    with row-layout loads.
    """
    if device.type != "cuda":
        return MlaLaunchConfig(block_h=16, block_n=16, num_warps=4, num_stages=1)
    head_blocks = cdiv(num_heads, 64)
    if batch * head_blocks >= 8:
        stages = 3
        if num_idx is not None:
            splits = mla_num_splits(batch * head_blocks, num_idx, 64, sm_count(device))
            stages = 3 if cdiv(num_idx, splits) >= 8 * 64 else 2
        return MlaLaunchConfig(block_h=64, block_n=64, num_warps=8, num_stages=stages)
    return MlaLaunchConfig(block_h=16, block_n=64, num_warps=4, num_stages=2, row_load=True)


def default_mla_fp8_config(device: torch.device, num_heads: int, batch: int = 1) -> MlaLaunchConfig:
    """Block sizes of the fused kernel over FP8 rows: as :func:`default_mla_config` (64-head
    blocks for many rows, 16-head row-layout blocks for few) but 32-token tiles and 2 stages.
    The latent tile is scaled in fp32 registers before the dots; with 64-token tiles the
    sm_90 build spills (ptxas, Triton 3.9: 280 bytes at 64 heads / 8 warps, 828 at 16 heads
    / 4 warps), with 32 it does not (16 and 0 bytes). Chosen by that, not yet by timing."""
    if device.type != "cuda":
        return MlaLaunchConfig(block_h=16, block_n=16, num_warps=4, num_stages=1)
    if batch * cdiv(num_heads, 64) >= 8:
        return MlaLaunchConfig(block_h=64, block_n=32, num_warps=8, num_stages=2)
    return MlaLaunchConfig(block_h=16, block_n=32, num_warps=4, num_stages=2, row_load=True)


@triton.jit
def _load_cols(KV, idx, valid, stride_kvn, offs_d, d_mask, col0):
    """[D, N] = rows transposed at load time."""
    base = tl.where(valid, idx, 0).to(tl.int64) * stride_kvn + col0
    return tl.load(KV + base[None, :] + offs_d[:, None], mask=valid[None, :] & d_mask[:, None], other=0.0)


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
    Scales, Rope, stride_sn, stride_rn,
    D_LAT: tl.constexpr, D_ROPE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_DL: tl.constexpr, BLOCK_DR: tl.constexpr,
    SPLIT: tl.constexpr, DOT_F32: tl.constexpr, ROW_LOAD: tl.constexpr,
    KV_FP8: tl.constexpr, NUM_TILES: tl.constexpr, BLOCK_T: tl.constexpr, TILE: tl.constexpr,
):
    # KV_FP8: KV is the uint8 FP8 rows (mla_fp8_latents), Scales / Rope their float32 / bf16
    # views; the latent tile is scaled in registers and cast to q's dtype for the dots
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
        idx, valid = index_tile(Idx, b, stride_ib, n0, end, num_slots, BLOCK_N)
        if KV_FP8:
            if ROW_LOAD:
                kv_lat = load_fp8_latent_rows(KV, Scales, idx, valid, stride_kvn, stride_sn,
                                              NUM_TILES, BLOCK_T, TILE, BLOCK_N).to(Q.dtype.element_ty)
                k_lat = tl.trans(kv_lat)
                k_pe = tl.trans(load_rows(Rope, idx, valid, stride_rn, offs_dr, dr_mask, 0)).to(Q.dtype.element_ty)
            else:
                k_lat = load_fp8_latent_cols(KV, Scales, idx, valid, stride_kvn, stride_sn,
                                             NUM_TILES, BLOCK_T, TILE, BLOCK_N).to(Q.dtype.element_ty)
                kv_lat = tl.trans(k_lat)
                k_pe = _load_cols(Rope, idx, valid, stride_rn, offs_dr, dr_mask, 0).to(Q.dtype.element_ty)
        elif ROW_LOAD:
            # rows as loaded [N, D]; the score dot takes the transposed view
            kv_lat = load_rows(KV, idx, valid, stride_kvn, offs_dl, dl_mask, 0)
            k_lat = tl.trans(kv_lat)
            k_pe = tl.trans(load_rows(KV, idx, valid, stride_kvn, offs_dr, dr_mask, D_LAT))
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

    store_split_result(acc, l_i, m_i, Out, OutPartial, LsePartial, b, split, offs_h, offs_dl, h_mask, dl_mask, h_mask,
                       stride_ob, stride_oh, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, SPLIT)


def sparse_mla_decode_triton(q: torch.Tensor, kv_buffer: torch.Tensor, indices: torch.Tensor, *,
                             kv_lora_rank: int, sm_scale: float,
                             config: Optional[MlaLaunchConfig | MlaGluonConfig | MlaTwoPassConfig] = None) -> torch.Tensor:
    """Triton sparse MLA decode.

    q:          ``[B, H, kv_lora_rank + rope_dim]`` fp16/bf16 absorbed query.
    kv_buffer:  ``[num_slots, 1, kv_lora_rank + rope_dim]`` (or ``[num_slots, Dl+Dr]``) in q's
                dtype, or ``[num_slots, (1,) bytes_per_token]`` uint8 rows in the FP8 latent
                layout (``mla_fp8_latents``: 656 bytes for 512 + 64), read by the Gluon and the
                fused kernel (a two-pass config runs the fused one with that config's splits).
    indices:    ``[B, K]`` int32 slots, ``-1`` padding (masked wherever it is).
    config:     :class:`MlaLaunchConfig` (fused kernel), :class:`MlaGluonConfig` (Hopper
                Gluon kernel; Triton fallback elsewhere) or :class:`MlaTwoPassConfig`
                (score GEMM + value pass); None = the Gluon kernel on Hopper for launches of
                at least ``GLUON_MIN_HEAD_BLOCKS`` 64-head blocks, over 16-bit rows of at
                least ``GLUON_MIN_INDICES`` indices, over FP8 rows of at least
                ``GLUON_FP8_MIN_HEADS`` heads, and where the token-rows kernel is the
                default (``token_rows_default``; the config: ``default_gluon_config``), else
                :func:`default_mla_config` (:func:`default_mla_fp8_config` over FP8 rows).
    Returns ``[B, H, kv_lora_rank]`` in q's dtype; rows without a valid index are zeros.
    """
    kv = check_mla(q, kv_buffer, indices, kv_lora_rank)
    B, H, Dq = q.shape
    Dl, Dr = kv_lora_rank, Dq - kv_lora_rank
    K = indices.shape[1]
    out = torch.empty((B, H, Dl), dtype=q.dtype, device=q.device)
    if B == 0:
        return out
    if indices.stride(1) != 1:
        indices = indices.contiguous()
    fp8 = kv.dtype == torch.uint8
    use_gluon = gluon_ok(q, Dl, Dr, kv)
    # up to 32 heads the token-rows kernel over FP8 rows at every batch (at B=1 2.2-3.2x the fused
    # kernel, from B=4 faster than the warp-specialised one), up to 16 over 16-bit rows
    narrow = token_rows_default(H, fp8)
    few_rows_ok = (K >= GLUON_MIN_INDICES) if not fp8 else (H >= GLUON_FP8_MIN_HEADS)
    if config is None and use_gluon and (B * cdiv(H, 64) >= GLUON_MIN_HEAD_BLOCKS or narrow or few_rows_ok):
        config = default_gluon_config(H, fp8, B)
    if fp8:
        cfg = _fp8_config(config, q.device, H, B, use_gluon, (Dl, Dr))
    else:
        cfg = config or default_mla_config(q.device, H, B, K)
    if isinstance(cfg, MlaTwoPassConfig):
        return sparse_mla_two_pass(q, kv, indices, out, Dl, sm_scale, cfg)
    if isinstance(cfg, MlaGluonConfig):
        if use_gluon:
            announce_path("sparse_mla_decode", "gluon (fp8 latents)" if fp8 else "gluon")
            return sparse_mla_gluon(q, kv, indices, out, Dl, sm_scale, cfg)
        announce_path("sparse_mla_decode", "triton (gluon unavailable)")
        cfg = (MlaLaunchConfig(block_h=64, block_n=64, num_warps=8, num_stages=3, num_splits=cfg.num_splits)
               if q.is_cuda and not interpreter_enabled() else
               MlaLaunchConfig(block_h=16, block_n=16, num_warps=4, num_stages=1, num_splits=cfg.num_splits))
    if not isinstance(cfg, MlaLaunchConfig):
        fail("config", "an MlaLaunchConfig, an MlaGluonConfig, an MlaTwoPassConfig or None", type(cfg).__name__)
    block_h = max(16, min(cfg.block_h, triton.next_power_of_2(H)))
    head_blocks = cdiv(H, block_h)
    sms = sm_count(q.device, off_cuda=INTERPRETER_SMS)
    splits, tps = split_tokens(K, cfg.num_splits or mla_num_splits(B * head_blocks, K, cfg.block_n, sms), cfg.block_n)
    return launch_split(_mla_stage1, (head_blocks, B, splits), q, kv, indices, out, sm_scale, tps, splits,
                        D_LAT=Dl, D_ROPE=Dr, BLOCK_H=block_h, BLOCK_N=cfg.block_n,
                        BLOCK_DL=max(16, triton.next_power_of_2(Dl)), BLOCK_DR=max(16, triton.next_power_of_2(Dr)),
                        DOT_F32=dot_in_fp32(q), ROW_LOAD=cfg.row_load,
                        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **_kv_operands(kv, Dl))


def _fp8_config(config, device: torch.device, num_heads: int, batch: int, use_gluon: bool,
                dims: tuple[int, int]) -> MlaLaunchConfig | MlaGluonConfig:
    """The config for FP8 rows of latent / rope dims ``dims``: an :class:`MlaGluonConfig`
    (checked by :func:`check_gluon_config` wherever it runs) where the Gluon kernel runs
    here, an :class:`MlaLaunchConfig` as given; otherwise the fused kernel's
    :func:`default_mla_fp8_config` (with a Gluon or two-pass config's split count). Every
    fused-kernel path is announced."""
    if isinstance(config, MlaGluonConfig):
        check_gluon_config(config, *dims, fp8=True, num_heads=num_heads)
        if use_gluon:
            return config
    announce_path("sparse_mla_decode", "triton (fp8 latents)")
    if isinstance(config, MlaLaunchConfig):
        return config
    base = default_mla_fp8_config(device, num_heads, batch)
    if isinstance(config, MlaTwoPassConfig):
        announce_path("sparse_mla_decode", "triton (fp8 latents: MlaTwoPassConfig has no fp8 kernel)")
    elif isinstance(config, MlaGluonConfig):
        announce_path("sparse_mla_decode", "triton (fp8 latents: gluon unavailable for these rows)")
    return replace(base, num_splits=config.num_splits) if config is not None else base


def _kv_operands(kv: torch.Tensor, kv_lora_rank: int) -> dict:
    """The fused kernel's FP8 arguments: for uint8 rows their scale and rope views and tile
    counts; for 16-bit rows placeholders (the kernel reads ``KV`` only)."""
    if kv.dtype != torch.uint8:
        return dict(Scales=kv, Rope=kv, stride_sn=0, stride_rn=0, KV_FP8=False, NUM_TILES=1, BLOCK_T=1, TILE=FP8_TILE)
    scales, rope = fp8_row_views(kv, kv_lora_rank)
    tiles = kv_lora_rank // FP8_TILE
    return dict(Scales=scales, Rope=rope, stride_sn=scales.stride(0), stride_rn=rope.stride(0), KV_FP8=True,
                NUM_TILES=tiles, BLOCK_T=triton.next_power_of_2(tiles), TILE=FP8_TILE)


def sparse_mla_decode_reference(q: torch.Tensor, kv_buffer: torch.Tensor, indices: torch.Tensor, *,
                                kv_lora_rank: int, sm_scale: float,
                                config: Optional[MlaLaunchConfig | MlaGluonConfig | MlaTwoPassConfig] = None) -> torch.Tensor:
    """Torch reference of :func:`sparse_mla_decode_triton` (same arguments and result)."""
    kv = check_mla(q, kv_buffer, indices, kv_lora_rank)
    idx = indices.long()
    valid = (idx >= 0) & (idx < kv.shape[0])
    rows = kv[torch.where(valid, idx, torch.zeros_like(idx))]              # [B, K, Dl+Dr] (or FP8 bytes)
    if rows.dtype == torch.uint8:
        rows = dequantize_mla_latents(rows, kv_lora_rank)
    # padding reads slot 0, whatever it holds (NaN too): zero it so p = 0 keeps the sum clean
    rows = rows.float().masked_fill(~valid[..., None], 0.0)
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
