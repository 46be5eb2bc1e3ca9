"""Store of per-token KV rows, taken from the caller's own tensors, into one layer of a pool.

``kv_copy`` moves rows between two pools. A row that is in no pool the transfer engine
addresses (a decode step's new key and value, held wherever the model put them) would
first have to be staged in one, a launch per buffer; this writes it from its own tensors:

    dst[slots[i] // page_size, slots[i] % page_size, layer, buf] = sources[buf][i]

for every buffer (k and v, or MLA's one latent kv) in one launch. ``dst`` is the 6-D view
``[pages, page_size, layers, buffers, heads, dim]`` (``HostKVPool.paged_view``,
``DeviceKVPool.paged_view``); each source is ``[N, heads, dim]`` in ``dst``'s dtype with a
contiguous last dim (any row and head strides). Slots that are ``-1`` or out of range are
skipped. Values move as bits (same dtype on both sides), so the result is what the same
rows give after ``index_copy_`` into a pool and a ``kv_copy`` from it. On CUDA the kernel
writes pinned host memory directly (zero-copy), as ``kv_copy`` does.

Entry points: ``token_store`` (dispatch), ``token_store_triton``, ``token_store_reference``.
"""
from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl

from hicache.triton_support import dispatch

_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _check(dst: torch.Tensor, layer: int, slots: torch.Tensor, sources: Sequence[torch.Tensor]) -> None:
    if not isinstance(dst, torch.Tensor) or dst.dim() != 6 or dst.stride(-1) != 1:
        raise ValueError("dst must be a 6-D view [pages, page_size, layers, buffers, heads, dim] with a contiguous "
                         "last dim")
    if not isinstance(layer, int) or isinstance(layer, bool) or not 0 <= layer < dst.shape[2]:
        raise ValueError(f"layer must be an int in [0, {dst.shape[2]}), got {layer!r}")
    if len(sources) != dst.shape[3]:
        raise ValueError(f"sources must be one tensor per buffer of dst ({dst.shape[3]}), got {len(sources)}")
    if not isinstance(slots, torch.Tensor) or slots.dim() != 1 or slots.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"slots must be a 1-D int64 or int32 tensor, got "
                         f"{tuple(slots.shape) if isinstance(slots, torch.Tensor) else type(slots).__name__}")
    want = (slots.shape[0], *dst.shape[4:])
    for i, s in enumerate(sources):
        if not isinstance(s, torch.Tensor) or tuple(s.shape) != want:
            raise ValueError(f"sources[{i}] must be [N, heads, dim]={want}, got "
                             f"{tuple(s.shape) if isinstance(s, torch.Tensor) else type(s).__name__}")
        if s.dtype != dst.dtype:
            raise ValueError(f"sources[{i}] must have dst's dtype {dst.dtype}, got {s.dtype}")
        if s.stride(-1) != 1:
            raise ValueError(f"sources[{i}] must have a contiguous last dim, got strides {s.stride()}")


def token_store_reference(dst: torch.Tensor, layer: int, slots: torch.Tensor, sources: Sequence[torch.Tensor]) -> None:
    """Plain-torch ``token_store`` (same arguments and result); sources may live on another
    device than ``dst`` (one copy each, and a host read of ``slots``)."""
    _check(dst, layer, slots, sources)
    ps = dst.shape[1]
    s = slots.to(device=dst.device, dtype=torch.int64)
    keep = (s >= 0) & (s < dst.shape[0] * ps)
    s = s[keep]
    for b, src in enumerate(sources):
        dst[s // ps, s % ps, layer, b] = src.to(dst.device)[keep]


@triton.jit
def _token_store_kernel(src0, src1, dst_ptr, slot_ptr, n_slots, layer_off, page_size,
                        s0_t, s0_h, s1_t, s1_h, d_sp, d_st, d_sl, d_sb, d_sh,
                        H: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                        TWO: tl.constexpr):
    # one program per token: every buffer of its row
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    sb = tl.zeros([BLOCK_H, BLOCK_D], tl.int64) + slot  # the scalar as a tile (masks must be tiles)
    m = (h < H)[:, None] & (d < D)[None, :] & (sb >= 0) & (sb < n_slots)
    safe = tl.maximum(slot, 0)
    base = (safe // page_size) * d_sp + (safe % page_size) * d_st + layer_off
    off = h[:, None].to(tl.int64) * d_sh + d[None, :]
    x = tl.load(src0 + t * s0_t + h[:, None].to(tl.int64) * s0_h + d[None, :], mask=m)
    tl.store(dst_ptr + base + off, x, mask=m)
    if TWO:
        y = tl.load(src1 + t * s1_t + h[:, None].to(tl.int64) * s1_h + d[None, :], mask=m)
        tl.store(dst_ptr + base + d_sb + off, y, mask=m)


def token_store_triton(dst: torch.Tensor, layer: int, slots: torch.Tensor, sources: Sequence[torch.Tensor]) -> None:
    """One launch (see the module docstring). ``slots`` and ``sources`` on the launch device
    (the GPU, or the CPU under the interpreter); ``dst`` there or in pinned host memory."""
    _check(dst, layer, slots, sources)
    if len(sources) not in (1, 2):
        raise ValueError(f"token_store_triton handles one or two buffers per row, got {len(sources)}")
    n = slots.shape[0]
    if n == 0:
        return
    word = _INT_OF_WIDTH[dst.element_size()]  # bits move as they are
    w = dst.view(word)
    srcs = [s.view(word) for s in sources]
    two = len(srcs) == 2
    s0, s1 = srcs[0], srcs[1] if two else srcs[0]
    heads, dim = dst.shape[4], dst.shape[5]
    _token_store_kernel[(n,)](
        s0, s1, w, slots, dst.shape[0] * dst.shape[1], layer * w.stride(2), dst.shape[1],
        s0.stride(0), s0.stride(1), s1.stride(0), s1.stride(1),
        w.stride(0), w.stride(1), w.stride(2), w.stride(3), w.stride(4),
        H=heads, D=dim, BLOCK_H=triton.next_power_of_2(heads), BLOCK_D=triton.next_power_of_2(dim), TWO=two,
        num_warps=4,
    )


def token_store(dst: torch.Tensor, layer: int, slots: torch.Tensor, sources: Sequence[torch.Tensor]) -> None:
    """Store the rows (see the module docstring): Triton for one or two sources on CUDA, the
    torch reference otherwise."""
    impl = dispatch("token_store", sources[0] if sources else slots, token_store_triton, token_store_reference,
                    triton_ok=len(sources) in (1, 2))
    impl(dst, layer, slots, sources)
