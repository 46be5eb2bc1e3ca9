"""DSA lightning indexer scores (DeepSeek-V3.2): for each cached token ``t`` of a request,
``score_t = scale_t · Σ_h w_h · ReLU(q_h · k̂_t)`` with one index key per token (shared by
all index heads), index queries ``q [H, Di]`` and per-head weights ``w [H]``.

Index keys are stored FP8 e4m3 with a per-token scale (``k_t ≈ scale_t · k̂_t``), or bf16 /
fp32 with no scale. Because ``scale_t > 0``, ``ReLU(q · scale_t k̂_t) = scale_t ReLU(q · k̂_t)``,
so the scale is applied once per token after the head reduction. bf16 queries over FP8 keys
take the tensor-core dot in fp16 on a GPU (the queries scaled by a power of two into fp16's
range): the same products as in bf16, with a third of the key conversions.

Rows whose request slot is negative (padding) or past the pool score ``-inf``, and a row
scores its first ``min(num_tokens, indexed[slot])`` tokens when given the per-slot indexed
counts: the decode path scores a layer in one launch.

Entry points: ``dsa_indexer`` (dispatch), ``dsa_indexer_triton``, ``dsa_indexer_reference``;
``quantize_index_keys`` (FP8 + scale, the key format; ``dsa_index_store`` writes decoded
keys in it).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from hicache.triton_support import cdiv, dispatch, interpreter_enabled, sm_count

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


def _pow2_exponent_over_fp8_max(amax: torch.Tensor) -> torch.Tensor:
    """``[...] int32`` the smallest ``e`` with ``448 * 2^e >= amax`` (``amax`` float32 >= 0;
    0 where ``amax == 0``), clamped to [-126, 126]: from the float's bits, so no rounding of a
    log or a division can move it. 448 = 1.75 x 2^8, whose mantissa field is 0x600000."""
    bits = amax.contiguous().view(torch.int32)
    e = (bits >> 23) - 127 - 8 + ((bits & 0x7FFFFF) > 0x600000).to(torch.int32)
    return torch.where(amax > 0, e, torch.zeros_like(e)).clamp(-126, 126)


def quantize_index_queries(q: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The indexer's FP8 queries, as the kernel makes them with ``fp8_queries=True``.

    q: ``[B, H, Di]`` float; weights ``[B, H]`` float. Returns ``(q̂ [B, H, Di]
    float8_e4m3fn, w' [B, H] float32)``: per (row, head) ``s = 2^e``, the smallest power of two
    with ``448 s >= max|q_h|`` (1 for an all-zero head), ``q̂ = q / s`` rounded to nearest
    even, ``w' = w s``; so ``w' ReLU(q̂ · k) ≈ w ReLU(q · k)``.
    """
    f8 = fp8_dtype()
    if f8 is None:
        raise ValueError("fp8_queries=True needs a torch build with float8_e4m3fn")
    qf = q.float()
    e = _pow2_exponent_over_fp8_max(qf.abs().amax(dim=-1))
    scale = ((e + 127) << 23).view(torch.float32)
    inverse = ((127 - e) << 23).view(torch.float32)
    return (qf * inverse[..., None]).to(f8), weights.float() * scale


_INT_DTYPES = (torch.int32, torch.int64)


def _check(q: torch.Tensor, weights: torch.Tensor, index_keys: torch.Tensor, key_scales: Optional[torch.Tensor],
           req_pool_indices: torch.Tensor, num_tokens: torch.Tensor, indexed: Optional[torch.Tensor] = None,
           fp8_queries: bool = False) -> None:
    if not isinstance(fp8_queries, bool):
        raise ValueError(f"fp8_queries={fp8_queries!r} is invalid: True or False")
    if fp8_queries and (fp8_dtype() is None or index_keys.dtype != fp8_dtype()):
        raise ValueError(f"fp8_queries=True needs FP8 e4m3 index keys (float8_e4m3fn), got {index_keys.dtype}")
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
    if req_pool_indices.dtype not in _INT_DTYPES or num_tokens.dtype not in _INT_DTYPES:
        raise ValueError(f"req_pool_indices and num_tokens must be int32/int64, got {req_pool_indices.dtype}, {num_tokens.dtype}")
    if indexed is not None and (indexed.dim() != 1 or indexed.shape[0] < index_keys.shape[0]
                                or indexed.dtype not in _INT_DTYPES):
        raise ValueError(f"indexed must be an int32/int64 [>= R={index_keys.shape[0]}] tensor, got "
                         f"{tuple(indexed.shape)} {indexed.dtype}")


def dsa_indexer_reference(
    q: torch.Tensor,
    weights: torch.Tensor,
    index_keys: torch.Tensor,
    key_scales: Optional[torch.Tensor],
    req_pool_indices: torch.Tensor,
    num_tokens: torch.Tensor,
    indexed: Optional[torch.Tensor] = None,
    fp8_queries: bool = False,
) -> torch.Tensor:
    """Torch reference.

    q:                ``[B, H, Di]`` float index queries.
    weights:          ``[B, H]`` float per-head weights.
    index_keys:       ``[R, T, Di]`` fp8 e4m3 / bf16 / fp32 index keys per (request slot, position).
    key_scales:       ``[R, T] float32`` per-token scale (FP8) or None.
    req_pool_indices: ``[B]`` int32/int64 row of index_keys per batch row (negative or
                      ``>= R``: none, the row scores ``-inf``).
    num_tokens:       ``[B]`` int32/int64 tokens to score; positions ``>= num_tokens`` score
                      ``-inf``.
    indexed:          ``[>= R]`` int32/int64 tokens indexed per request slot, or None; when
                      given, a row scores only ``min(num_tokens, indexed[slot])`` tokens.
    fp8_queries:      score with ``quantize_index_queries(q, weights)`` (FP8 keys only).
    Returns ``[B, T] float32``.
    """
    _check(q, weights, index_keys, key_scales, req_pool_indices, num_tokens, indexed, fp8_queries)
    if fp8_queries:
        q, weights = quantize_index_queries(q, weights)
    r, t = index_keys.shape[:2]
    req = req_pool_indices.to(q.device).long()
    live_row = (req >= 0) & (req < r)
    req = torch.where(live_row, req, torch.zeros_like(req))
    k = index_keys[req].float()  # [B, T, Di]
    logits = torch.einsum("bhd,btd->bht", q.float(), k)
    s = (torch.relu(logits) * weights.float()[:, :, None]).sum(dim=1)
    if key_scales is not None:
        s = s * key_scales[req].float()
    pos = torch.arange(t, device=q.device)[None, :]
    n = num_tokens.to(q.device).long()
    if indexed is not None:
        n = torch.minimum(n, indexed.to(q.device).long()[req])
    live = (pos < n[:, None]) & live_row[:, None]
    return torch.where(live, s, torch.full_like(s, float("-inf")))


@triton.jit
def _round_to_e4m3(x):
    """``x`` (float32, ``|x| <= 448``) rounded to the nearest e4m3 value, ties to even, as
    float32: adding ``c = 1.5 x 2^(23 + m)``, whose ulp is e4m3's step ``2^m`` at ``x``'s
    exponent, rounds to that step in float32's own round-to-nearest-even. The Triton CPU
    interpreter's float32 -> float8e4nv cast rounds wrongly (31.625 -> 16, 50 -> 52), so
    interpreted kernels round with this instead."""
    bits = x.to(tl.int32, bitcast=True)
    step = tl.maximum(((bits >> 23) & 0xFF) - 127, -6) - 3  # e4m3: 3 mantissa bits, subnormal below 2^-6
    c = (((step + 150) << 23) | 0x400000).to(tl.float32, bitcast=True)
    return (x + c) - c


@triton.jit
def _dsa_indexer_kernel(
    q_ptr, w_ptr, k_ptr, scale_ptr, req_ptr, ntok_ptr, indexed_ptr, out_ptr,
    R, T, H, D,
    stride_qb, stride_qh, stride_wb, stride_wh,
    stride_kr, stride_kt, stride_sr,
    stride_ob,
    HAS_SCALE: tl.constexpr, HAS_INDEXED: tl.constexpr, DOT_IN_Q_DTYPE: tl.constexpr, FP16_DOT: tl.constexpr,
    FP8_QUERIES: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, TILES: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    # one program scores TILES consecutive tiles of BLOCK_T tokens of one row: the row's
    # queries and weights are read once per program, and the key loads of later tiles are
    # pipelined behind the dot of earlier ones
    b = tl.program_id(0)
    first = tl.program_id(1) * TILES
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    req = tl.load(req_ptr + b).to(tl.int64)
    live_row = (req >= 0) & (req < R)
    req = tl.where(live_row, req, 0)
    n = tl.load(ntok_ptr + b).to(tl.int64)
    if HAS_INDEXED:
        n = tl.minimum(n, tl.load(indexed_ptr + req).to(tl.int64))
    n = tl.where(live_row, n, 0)  # padding / out-of-range rows: nothing
    h_mask = offs_h < H
    d_mask = offs_d < D
    q = tl.load(q_ptr + b * stride_qb + offs_h[:, None] * stride_qh + offs_d[None, :],
                mask=h_mask[:, None] & d_mask[None, :], other=0.0)
    w = tl.load(w_ptr + b * stride_wb + offs_h * stride_wh, mask=h_mask, other=0.0).to(tl.float32)
    if FP8_QUERIES:
        # quantize_index_queries: per head 2^e from the bits of max|q_h| (exact, as in torch)
        qf = q.to(tl.float32)
        amax = tl.max(tl.abs(qf), axis=1)
        bits = amax.to(tl.int32, bitcast=True)
        e = (bits >> 23) - 135 + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)
        e = tl.minimum(tl.maximum(tl.where(amax > 0, e, 0), -126), 126)
        w = w * ((e + 127) << 23).to(tl.float32, bitcast=True)
        qs = qf * ((127 - e) << 23).to(tl.float32, bitcast=True)[:, None]
        if DOT_IN_Q_DTYPE:  # FP8 x FP8 on the tensor cores, the keys as stored
            q_t = tl.trans(qs.to(tl.float8e4nv))
        else:  # the interpreter: e4m3 values in float32, multiplied in float32
            q_t = tl.trans(_round_to_e4m3(qs))
    elif FP16_DOT:
        # bf16 queries over FP8 keys: the dot runs in fp16, whose widening of an E4M3 pair is one
        # instruction (to bf16 it takes one more a value: about a third of the loop's work). The
        # row's queries are scaled by 2^-e, a power of two that keeps the largest inside fp16's
        # range (e = 0 unless some |q| >= 2^15), so q's bf16 values are exact in fp16 down to
        # 2^-14; the products are exact and the scores are multiplied back by 2^e.
        q_max = tl.max(tl.max(tl.abs(q), axis=1), axis=0).to(tl.float32)
        e = tl.maximum(tl.ceil(tl.log2(q_max)) - 15.0, 0.0)
        q_t = tl.trans((q * tl.exp2(-e).to(q.dtype)).to(tl.float16))
        back = tl.exp2(e)
    elif DOT_IN_Q_DTYPE:
        q_t = tl.trans(q)
    else:
        q_t = tl.trans(q.to(tl.float32))
    for i in tl.range(0, TILES, num_stages=NUM_STAGES):
        offs_t = (first + i) * BLOCK_T + tl.arange(0, BLOCK_T)
        live_t = offs_t < n
        # Tokens past the row's end are masked out of the key load: a fixed [B, T] grid
        # reads only the live index keys.
        k = tl.load(k_ptr + req * stride_kr + offs_t[:, None].to(tl.int64) * stride_kt + offs_d[None, :],
                    mask=live_t[:, None] & d_mask[None, :], other=0.0)
        # padded heads have q = 0 and w = 0, so they add ReLU(0) * 0 = 0
        if FP8_QUERIES and DOT_IN_Q_DTYPE:
            logits = tl.dot(k, q_t)  # [BLOCK_T, BLOCK_H] float32
        elif FP16_DOT:
            logits = tl.dot(k.to(tl.float16), q_t)  # [BLOCK_T, BLOCK_H] float32, scaled by 2^-e
        elif DOT_IN_Q_DTYPE:
            # FP8 (or same-dtype) keys widen exactly to q's 16-bit dtype: exact products,
            # float32 accumulation, on tensor cores
            logits = tl.dot(k.to(q.dtype), q_t)  # [BLOCK_T, BLOCK_H] float32
        else:
            # float32 operands: three TF32 products, about float32 accuracy, on tensor cores
            logits = tl.dot(k.to(tl.float32), q_t, input_precision="tf32x3")
        s = tl.sum(tl.maximum(logits, 0.0) * w[None, :], axis=1)
        if FP16_DOT:
            s = s * back
        if HAS_SCALE:
            sc = tl.load(scale_ptr + req * stride_sr + offs_t, mask=live_t, other=1.0)
            s = s * sc
        s = tl.where(live_t, s, float("-inf"))
        tl.store(out_ptr + b * stride_ob + offs_t, s, mask=offs_t < T)


PROGRAMS_PER_SM = 4
"""The launcher gives each program more tiles only while the grid keeps at least this many
programs per SM (``indexer_tiles``)."""
MAX_TILES = 8
PIPELINE_STAGES = 3
"""Key loads in flight in a program of several tiles (``dsa_indexer_tiles.json``: 3 stages
beat 2 at every batch of 8 rows and more)."""


def indexer_tiles(batch: int, token_blocks: int, sms: int) -> int:
    """Tiles of ``block_t`` tokens one program scores: the largest power of two up to
    ``MAX_TILES`` that leaves at least ``PROGRAMS_PER_SM x sms`` programs over ``batch`` rows
    of ``token_blocks`` tiles (1 when even one tile a program leaves fewer)."""
    tiles = 1
    while tiles < MAX_TILES and batch * cdiv(token_blocks, 2 * tiles) >= PROGRAMS_PER_SM * sms:
        tiles *= 2
    return tiles


def dsa_indexer_triton(
    q: torch.Tensor,
    weights: torch.Tensor,
    index_keys: torch.Tensor,
    key_scales: Optional[torch.Tensor],
    req_pool_indices: torch.Tensor,
    num_tokens: torch.Tensor,
    indexed: Optional[torch.Tensor] = None,
    block_t: int = 64,
    tiles: Optional[int] = None,
    num_stages: Optional[int] = None,
    num_warps: int = 4,
    max_registers: Optional[int] = None,
    fp16_dot: Optional[bool] = None,
    fp8_queries: bool = False,
) -> torch.Tensor:
    """Triton launcher (one launch); same arguments and result as
    :func:`dsa_indexer_reference`. Queries and weights are read through their strides in
    their dtype, index tensors in theirs: no conversion launches. ``tiles``: tiles of
    ``block_t`` tokens per program (None: ``indexer_tiles``); ``num_stages``: key loads in
    flight in a program's loop (None: 1 for one tile, else ``PIPELINE_STAGES``);
    ``max_registers``: a thread's register cap (None: the compiler's choice), which sets how
    many programs an SM holds; ``fp16_dot``: bf16 queries over FP8 keys dot in fp16 (the
    kernel's comment says why it is exact; None: yes on a GPU, False: in bf16);
    ``fp8_queries``: quantise the queries to FP8 in the kernel (``quantize_index_queries``)
    and take FP8 x FP8 products (FP8 keys only)."""
    _check(q, weights, index_keys, key_scales, req_pool_indices, num_tokens, indexed, fp8_queries)
    for name, value in (("block_t", block_t), ("num_warps", num_warps)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} is invalid: an int >= 1")
    for name, value in (("tiles", tiles), ("num_stages", num_stages), ("max_registers", max_registers)):
        if value is not None and (not isinstance(value, int) or value < 1):
            raise ValueError(f"{name}={value!r} is invalid: None (the launcher's choice) or an int >= 1")
    b, h, d = q.shape
    r, t, _ = index_keys.shape
    if index_keys.stride(2) != 1:
        raise ValueError("index_keys must have a contiguous last dim")
    if key_scales is not None and (key_scales.dtype != torch.float32 or key_scales.stride(1) != 1):
        key_scales = key_scales.float().contiguous()
    if q.stride(2) != 1:
        q = q.contiguous()
    dev = q.device
    req, ntok = req_pool_indices.to(dev), num_tokens.to(dev)
    out = torch.empty(b, t, dtype=torch.float32, device=dev)
    if b == 0 or t == 0:
        return out
    scales = key_scales if key_scales is not None else out  # dummy pointer when unused
    counts = indexed.to(dev) if indexed is not None else req  # dummy pointer when unused
    w = weights.to(dev)
    blocks = cdiv(t, block_t)
    if tiles is None:
        tiles = indexer_tiles(b, blocks, sm_count(dev, off_cuda=132))
    if num_stages is None:
        num_stages = 1 if tiles == 1 else PIPELINE_STAGES
    grid = (b, cdiv(blocks, tiles))
    dot_16bit = (q.dtype in (torch.bfloat16, torch.float16) and index_keys.dtype in (q.dtype, fp8_dtype())
                 and not interpreter_enabled())
    _dsa_indexer_kernel[grid](
        q, w, index_keys, scales, req, ntok, counts, out,
        r, t, h, d,
        q.stride(0), q.stride(1), w.stride(0), w.stride(1),
        index_keys.stride(0), index_keys.stride(1), scales.stride(0),
        out.stride(0),
        HAS_SCALE=key_scales is not None, HAS_INDEXED=indexed is not None,
        # (the CPU interpreter multiplies 16-bit floats wrongly: it takes the float32 path)
        DOT_IN_Q_DTYPE=dot_16bit or (fp8_queries and not interpreter_enabled()),
        FP16_DOT=(dot_16bit and q.dtype == torch.bfloat16 and index_keys.dtype == fp8_dtype()
                  and fp16_dot is not False and not fp8_queries),
        FP8_QUERIES=fp8_queries,
        # (an FP8 dot takes K >= 32)
        BLOCK_T=block_t, BLOCK_H=max(16, triton.next_power_of_2(h)),
        BLOCK_D=max(32 if fp8_queries else 16, triton.next_power_of_2(d)),
        TILES=tiles, NUM_STAGES=num_stages, num_warps=num_warps,
        **({} if max_registers is None or interpreter_enabled() else {"maxnreg": max_registers}),
    )
    return out


def dsa_indexer(
    q: torch.Tensor,
    weights: torch.Tensor,
    index_keys: torch.Tensor,
    key_scales: Optional[torch.Tensor],
    req_pool_indices: torch.Tensor,
    num_tokens: torch.Tensor,
    indexed: Optional[torch.Tensor] = None,
    fp8_queries: bool = False,
) -> torch.Tensor:
    """Indexer scores ``[B, T] float32`` (Triton on CUDA, reference on CPU); arguments as
    :func:`dsa_indexer_reference`."""
    impl = dispatch("dsa_indexer", q, dsa_indexer_triton, dsa_indexer_reference)
    return impl(q, weights, index_keys, key_scales, req_pool_indices, num_tokens, indexed, fp8_queries=fp8_queries)
