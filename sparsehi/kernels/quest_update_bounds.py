"""Keep Quest's per-page key bounds current: fold one decoded key per row into its page's
element-wise min / max, in place, in one launch (one program per row). A page's first
token resets its bounds (the request slot may hold an old request's); keys are rounded to
the pools' dtype before they are compared, as torch does. Padding rows and positions
outside the pool change nothing.

Entry points: ``quest_update_bounds`` (dispatch), ``quest_update_bounds_triton``,
``quest_update_bounds_reference``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from hicache.triton_support import dispatch
from sparsehi.kernels.store_rounding import as_stored

_INT_DTYPES = (torch.int32, torch.int64)


def _check_update(kmin_flat: torch.Tensor, kmax_flat: torch.Tensor, req_pool_indices: torch.Tensor,
                  positions: torch.Tensor, new_keys: torch.Tensor, max_num_reqs: int, max_pages: int,
                  page_size: int) -> None:
    if kmin_flat.dim() != 3 or kmin_flat.shape != kmax_flat.shape or kmin_flat.dtype != kmax_flat.dtype:
        raise ValueError(f"kmin_flat/kmax_flat must both be [R * P + 1, Hkv, D] of one dtype, got "
                         f"{tuple(kmin_flat.shape)} {kmin_flat.dtype} and {tuple(kmax_flat.shape)} {kmax_flat.dtype}")
    if kmin_flat.shape[0] != max_num_reqs * max_pages + 1:
        raise ValueError(f"kmin_flat has {kmin_flat.shape[0]} entries, expected max_num_reqs * max_pages + 1 = "
                         f"{max_num_reqs * max_pages + 1}")
    b = req_pool_indices.shape[0]
    if new_keys.shape != (b,) + tuple(kmin_flat.shape[1:]) or not new_keys.is_floating_point():
        raise ValueError(f"new_keys must be a floating [B={b}, Hkv, D]={(b,) + tuple(kmin_flat.shape[1:])}, "
                         f"got {tuple(new_keys.shape)} {new_keys.dtype}")
    if positions.shape != (b,) or req_pool_indices.dim() != 1:
        raise ValueError(f"req_pool_indices and positions must be [B], got {tuple(req_pool_indices.shape)}, "
                         f"{tuple(positions.shape)}")
    if req_pool_indices.dtype not in _INT_DTYPES or positions.dtype not in _INT_DTYPES:
        raise ValueError(f"req_pool_indices and positions must be int32/int64, got {req_pool_indices.dtype}, {positions.dtype}")
    if not isinstance(page_size, int) or page_size < 1:
        raise ValueError(f"page_size={page_size!r} is invalid: an integer >= 1")


def quest_update_bounds_reference(
    kmin_flat: torch.Tensor,
    kmax_flat: torch.Tensor,
    req_pool_indices: torch.Tensor,
    positions: torch.Tensor,
    new_keys: torch.Tensor,
    *,
    max_num_reqs: int,
    max_pages: int,
    page_size: int,
) -> None:
    """Torch reference, in place.

    kmin_flat, kmax_flat: ``[max_num_reqs * max_pages + 1, Hkv, D]`` running key min / max
                          of page ``p`` of request slot ``r`` at entry ``r * max_pages + p``;
                          the last entry is scratch (this reference dumps the writes of
                          padding rows there, the kernel writes nothing for them).
    req_pool_indices:     ``[B]`` int32/int64 request slot per row (negative or
                          ``>= max_num_reqs``: padding, nothing changes).
    positions:            ``[B]`` int32/int64 token position of the new key (outside
                          ``[0, max_pages * page_size)``: nothing changes).
    new_keys:             ``[B, Hkv, D]`` float, folded into the page's min / max in the
                          pools' dtype; a page's first token (``position % page_size == 0``)
                          resets them (the slot may hold an old request's bounds).
    """
    _check_update(kmin_flat, kmax_flat, req_pool_indices, positions, new_keys, max_num_reqs, max_pages, page_size)
    dev = kmin_flat.device
    pos = positions.to(dev).long()
    req = req_pool_indices.to(dev).long()
    ok = (req >= 0) & (req < max_num_reqs) & (pos >= 0) & (pos < max_pages * page_size)
    flat = torch.where(ok, req * max_pages + pos // page_size, kmin_flat.shape[0] - 1)
    first = (pos % page_size == 0)[:, None, None]
    k = new_keys.to(dev, kmin_flat.dtype)
    old_min, old_max = kmin_flat.index_select(0, flat), kmax_flat.index_select(0, flat)
    kmin_flat.index_copy_(0, flat, torch.where(first, k, torch.minimum(old_min, k)))
    kmax_flat.index_copy_(0, flat, torch.where(first, k, torch.maximum(old_max, k)))


@triton.jit
def _quest_update_kernel(
    kmin_ptr, kmax_ptr, req_ptr, pos_ptr, k_ptr,
    R, P, PAGE_SIZE, HD, D,
    stride_e, stride_kb, stride_kh,
    BLOCK: tl.constexpr,
):
    b = tl.program_id(0)
    req = tl.load(req_ptr + b).to(tl.int64)
    pos = tl.load(pos_ptr + b).to(tl.int64)
    ok = (req >= 0) & (req < R) & (pos >= 0) & (pos < P * PAGE_SIZE)
    entry = req * P + pos // PAGE_SIZE
    first = (pos % PAGE_SIZE) == 0
    offs = tl.arange(0, BLOCK)
    m = offs < tl.where(ok, HD, 0)  # padding / out-of-range rows: nothing
    k = tl.load(k_ptr + b * stride_kb + (offs // D) * stride_kh + offs % D, mask=m, other=0.0)
    k = as_stored(k.to(tl.float32), kmin_ptr.dtype.element_ty)  # rounded to the pools' dtype first, as torch does
    at = entry * stride_e + offs
    # a page's first token does not read the old bounds
    fold = offs < tl.where(ok & ((pos % PAGE_SIZE) != 0), HD, 0)
    old_min = tl.load(kmin_ptr + at, mask=fold, other=0.0).to(tl.float32)
    old_max = tl.load(kmax_ptr + at, mask=fold, other=0.0).to(tl.float32)
    new_min = tl.where(first, k, tl.minimum(old_min, k, propagate_nan=tl.PropagateNan.ALL))
    new_max = tl.where(first, k, tl.maximum(old_max, k, propagate_nan=tl.PropagateNan.ALL))
    tl.store(kmin_ptr + at, new_min.to(kmin_ptr.dtype.element_ty), mask=m)
    tl.store(kmax_ptr + at, new_max.to(kmax_ptr.dtype.element_ty), mask=m)


def quest_update_bounds_triton(
    kmin_flat: torch.Tensor,
    kmax_flat: torch.Tensor,
    req_pool_indices: torch.Tensor,
    positions: torch.Tensor,
    new_keys: torch.Tensor,
    *,
    max_num_reqs: int,
    max_pages: int,
    page_size: int,
) -> None:
    """Triton launcher (one launch, one program per row); same arguments and effect on
    the real entries as :func:`quest_update_bounds_reference`."""
    _check_update(kmin_flat, kmax_flat, req_pool_indices, positions, new_keys, max_num_reqs, max_pages, page_size)
    b = req_pool_indices.shape[0]
    hkv, d = kmin_flat.shape[1:]
    if kmin_flat.stride()[1:] != (d, 1) or kmax_flat.stride() != kmin_flat.stride():
        raise ValueError("kmin_flat/kmax_flat must share a layout with contiguous [Hkv, D] entries")
    if b == 0:
        return
    dev = kmin_flat.device
    k = new_keys.to(dev)
    if k.stride(2) != 1:
        k = k.contiguous()
    _quest_update_kernel[(b,)](
        kmin_flat, kmax_flat, req_pool_indices.to(dev), positions.to(dev), k,
        max_num_reqs, max_pages, page_size, hkv * d, d,
        kmin_flat.stride(0), k.stride(0), k.stride(1),
        BLOCK=triton.next_power_of_2(hkv * d),
    )


def quest_update_bounds(
    kmin_flat: torch.Tensor,
    kmax_flat: torch.Tensor,
    req_pool_indices: torch.Tensor,
    positions: torch.Tensor,
    new_keys: torch.Tensor,
    *,
    max_num_reqs: int,
    max_pages: int,
    page_size: int,
) -> None:
    """Fold one decoded key per row into its page's min / max, in place (Triton on CUDA,
    reference on CPU); arguments as :func:`quest_update_bounds_reference`."""
    impl = dispatch("quest_update_bounds", kmin_flat, quest_update_bounds_triton, quest_update_bounds_reference)
    return impl(kmin_flat, kmax_flat, req_pool_indices, positions, new_keys, max_num_reqs=max_num_reqs,
                max_pages=max_pages, page_size=page_size)
