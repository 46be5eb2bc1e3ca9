"""Store one decoded DSA index key per row and count it, in one launch: the key is
quantised to FP8 e4m3 with its per-token scale (``dsa_indexer.quantize_index_keys``, the
same bytes on both paths) or cast to the pool's dtype, written at its request slot and
position, and the slot's indexed-token count raised to ``position + 1``. Padding rows and
positions outside the pool change nothing.

Entry points: ``dsa_store_index_keys`` (dispatch), ``dsa_store_index_keys_triton``,
``dsa_store_index_keys_reference``.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from hicache.kernels.fp8_page_quantize import e4m3_bits
from hicache.triton_support import dispatch
from sparsehi.kernels.dsa_indexer import FP8_E4M3_MAX, fp8_dtype, quantize_index_keys
from sparsehi.kernels.store_rounding import as_stored

_INT_DTYPES = (torch.int32, torch.int64)


def _check_store(keys_flat: torch.Tensor, scales_flat: Optional[torch.Tensor], indexed: torch.Tensor,
                 req_pool_indices: torch.Tensor, positions: torch.Tensor, index_keys: torch.Tensor,
                 max_num_reqs: int, max_context_len: int) -> None:
    n = max_num_reqs * max_context_len + 1
    if keys_flat.dim() != 2 or keys_flat.shape[0] != n:
        raise ValueError(f"keys_flat must be [max_num_reqs * max_context_len + 1 = {n}, Di], got {tuple(keys_flat.shape)}")
    is_fp8 = keys_flat.dtype == fp8_dtype()
    if is_fp8 != (scales_flat is not None):
        raise ValueError("scales_flat is needed exactly when keys_flat is float8_e4m3fn")
    if scales_flat is not None and (scales_flat.shape != (n,) or scales_flat.dtype != torch.float32):
        raise ValueError(f"scales_flat must be [{n}] float32, got {tuple(scales_flat.shape)} {scales_flat.dtype}")
    if indexed.dim() != 1 or indexed.shape[0] < max_num_reqs or indexed.dtype not in _INT_DTYPES:
        raise ValueError(f"indexed must be an int32/int64 [>= max_num_reqs={max_num_reqs}] tensor, got "
                         f"{tuple(indexed.shape)} {indexed.dtype}")
    b = req_pool_indices.shape[0]
    if req_pool_indices.dim() != 1 or positions.shape != (b,):
        raise ValueError(f"req_pool_indices and positions must be [B], got {tuple(req_pool_indices.shape)}, {tuple(positions.shape)}")
    if req_pool_indices.dtype not in _INT_DTYPES or positions.dtype not in _INT_DTYPES:
        raise ValueError(f"req_pool_indices and positions must be int32/int64, got {req_pool_indices.dtype}, {positions.dtype}")
    if index_keys.shape != (b, keys_flat.shape[1]) or not index_keys.is_floating_point():
        raise ValueError(f"index_keys must be a floating [B={b}, Di={keys_flat.shape[1]}], got "
                         f"{tuple(index_keys.shape)} {index_keys.dtype}")


def dsa_store_index_keys_reference(
    keys_flat: torch.Tensor,
    scales_flat: Optional[torch.Tensor],
    indexed: torch.Tensor,
    req_pool_indices: torch.Tensor,
    positions: torch.Tensor,
    index_keys: torch.Tensor,
    *,
    max_num_reqs: int,
    max_context_len: int,
) -> None:
    """Torch reference, in place: store one decoded index key per row and count it.

    keys_flat:        ``[max_num_reqs * max_context_len + 1, Di]`` fp8 e4m3 / bf16 / fp32,
                      key of position ``t`` of slot ``r`` at entry ``r * max_context_len + t``;
                      the last entry is scratch (this reference dumps padding rows' writes
                      there, the kernel writes nothing for them).
    scales_flat:      ``[same] float32`` per-entry FP8 scale (FP8 keys), else None.
    indexed:          ``[>= max_num_reqs]`` int tokens indexed per slot; becomes
                      ``max(indexed[r], position + 1)``.
    req_pool_indices: ``[B]`` int32/int64 (negative or ``>= max_num_reqs``: padding, nothing
                      changes); positions ``[B]`` int32/int64 (outside
                      ``[0, max_context_len)``: nothing changes).
    index_keys:       ``[B, Di]`` float, quantised as :func:`quantize_index_keys` (FP8) or
                      cast to the pool's dtype.
    """
    _check_store(keys_flat, scales_flat, indexed, req_pool_indices, positions, index_keys, max_num_reqs, max_context_len)
    dev = keys_flat.device
    req = req_pool_indices.to(dev).long()
    pos = positions.to(dev).long()
    ok = (req >= 0) & (req < max_num_reqs) & (pos >= 0) & (pos < max_context_len)
    flat = torch.where(ok, req * max_context_len + pos, torch.full_like(req, keys_flat.shape[0] - 1))
    if scales_flat is not None:
        qk, sc = quantize_index_keys(index_keys.to(dev))
        keys_flat[flat] = qk
        scales_flat[flat] = sc
    else:
        keys_flat[flat] = index_keys.to(dev, keys_flat.dtype)
    # padding rows add a 0 to slot 0's count: no change (counts are >= 0)
    indexed.scatter_reduce_(0, torch.where(ok, req, 0), torch.where(ok, pos + 1, 0).to(indexed.dtype), reduce="amax")


FP8_MAX = tl.constexpr(FP8_E4M3_MAX)


@triton.jit
def _dsa_store_kernel(
    keys_ptr, scales_ptr, indexed_ptr, req_ptr, pos_ptr, k_ptr,
    R, T, D, stride_e, stride_kb,
    IS_FP8: tl.constexpr, BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0)
    req = tl.load(req_ptr + b).to(tl.int64)
    pos = tl.load(pos_ptr + b).to(tl.int64)
    ok = (req >= 0) & (req < R) & (pos >= 0) & (pos < T)
    offs = tl.arange(0, BLOCK_D)
    m = offs < tl.where(ok, D, 0)  # padding / out-of-range rows: nothing
    k = tl.load(k_ptr + b * stride_kb + offs, mask=m, other=0.0).to(tl.float32)
    entry = tl.where(ok, req * T + pos, 0)
    if IS_FP8:
        # as quantize_index_keys: IEEE-rounded divisions, so both paths store the same bytes;
        # keys_ptr is the pool's bytes (uint8), written by e4m3_bits, which rounds as torch
        # does on the GPU and under the interpreter (whose own cast does not)
        amax = tl.max(tl.abs(k), 0)
        scale = tl.where(amax > 0, tl.math.div_rn(amax, FP8_MAX), 1.0)
        qk = tl.minimum(tl.maximum(tl.math.div_rn(k, scale), -FP8_MAX), FP8_MAX)
        tl.store(keys_ptr + entry * stride_e + offs, e4m3_bits(qk), mask=m)
        tl.store(scales_ptr + entry, scale, mask=ok)
    else:
        tl.store(keys_ptr + entry * stride_e + offs, as_stored(k, keys_ptr.dtype.element_ty).to(keys_ptr.dtype.element_ty),
                 mask=m)
    tl.atomic_max(indexed_ptr + tl.where(ok, req, 0), (pos + 1).to(indexed_ptr.dtype.element_ty), mask=ok)


def dsa_store_index_keys_triton(
    keys_flat: torch.Tensor,
    scales_flat: Optional[torch.Tensor],
    indexed: torch.Tensor,
    req_pool_indices: torch.Tensor,
    positions: torch.Tensor,
    index_keys: torch.Tensor,
    *,
    max_num_reqs: int,
    max_context_len: int,
) -> None:
    """Triton launcher (one launch, one program per row: quantise, store, count); same
    arguments and effect on the real entries as :func:`dsa_store_index_keys_reference`."""
    _check_store(keys_flat, scales_flat, indexed, req_pool_indices, positions, index_keys, max_num_reqs, max_context_len)
    b, d = index_keys.shape
    if keys_flat.stride(1) != 1:
        raise ValueError("keys_flat must have a contiguous last dim")
    if b == 0:
        return
    dev = keys_flat.device
    k = index_keys.to(dev)
    if k.stride(1) != 1:
        k = k.contiguous()
    _dsa_store_kernel[(b,)](
        keys_flat.view(torch.uint8) if scales_flat is not None else keys_flat,
        scales_flat if scales_flat is not None else keys_flat, indexed,
        req_pool_indices.to(dev), positions.to(dev), k,
        max_num_reqs, max_context_len, d, keys_flat.stride(0), k.stride(0),
        IS_FP8=scales_flat is not None, BLOCK_D=triton.next_power_of_2(d),
    )


def dsa_store_index_keys(
    keys_flat: torch.Tensor,
    scales_flat: Optional[torch.Tensor],
    indexed: torch.Tensor,
    req_pool_indices: torch.Tensor,
    positions: torch.Tensor,
    index_keys: torch.Tensor,
    *,
    max_num_reqs: int,
    max_context_len: int,
) -> None:
    """Store and count one decoded index key per row, in place (Triton on CUDA, reference
    on CPU); arguments as :func:`dsa_store_index_keys_reference`."""
    impl = dispatch("dsa_store_index_keys", keys_flat, dsa_store_index_keys_triton, dsa_store_index_keys_reference)
    return impl(keys_flat, scales_flat, indexed, req_pool_indices, positions, index_keys,
                max_num_reqs=max_num_reqs, max_context_len=max_context_len)
