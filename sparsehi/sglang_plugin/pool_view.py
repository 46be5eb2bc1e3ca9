"""SGLang's KV pools seen as the ``DeviceKVPool`` our coordinator and KV manager drive.

Our KV manager and transfer engine address every layer of a pool from one base tensor
(``DeviceKVPool.kv_data [buffers, layers, slots, heads, dim]``); SGLang keeps one tensor
per layer (``MHATokenToKVPool.k_buffer[l]`` / ``v_buffer[l]``, ``MLATokenToKVPool.kv_buffer[l]``,
each ``[size + page_size, heads, dim]``). :func:`adopt_kv_pool` builds a ``DeviceKVPool``
whose ``kv_data`` holds SGLang's rows followed by a reserved region, copies what SGLang's
buffers hold, and points SGLang's per-layer lists at views of it. Both then read and write
the same memory: SGLang's attention backends, radix cache and allocator keep working on
slots ``[0, size + page_size)``; the coordinator allocates its sparse buffers (sink pages,
recent ring, LRU region) only from the reserved slots after them.

Nothing here imports SGLang: the pool is duck-typed by the attributes read below.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from hicache.device_pool import DeviceKVPool
from hicache.kv_spec import KVCacheSpec


@dataclass(frozen=True)
class PoolLayout:
    """What :func:`describe_kv_pool` reads off an SGLang KV pool.

    attention: ``"mha"`` | ``"mla"``; rows: slots SGLang addresses (``size + page_size``,
    page 0 its padding page); kv_lora_rank: MLA latent width (None for MHA).
    """

    attention: str
    num_layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    page_size: int
    rows: int
    kv_lora_rank: int | None = None

    def spec(self) -> KVCacheSpec:
        return KVCacheSpec(self.attention, self.num_layers, self.kv_heads, self.head_dim, self.dtype,
                           self.page_size, kv_lora_rank=self.kv_lora_rank)


def _is_mla(kv_pool: Any) -> bool:
    return hasattr(kv_pool, "kv_buffer") and hasattr(kv_pool, "kv_lora_rank")


def describe_kv_pool(kv_pool: Any) -> PoolLayout:
    """The layout of SGLang's ``MHATokenToKVPool`` or ``MLATokenToKVPool``.

    Raises ValueError naming what is unsupported: quantised or fp8 caches (the store
    dtype differs from the compute dtype), K and V of different widths, the HND /
    vectorised layouts, or pipeline-parallel layer slices.
    """
    name = type(kv_pool).__name__
    if getattr(kv_pool, "store_dtype", kv_pool.dtype) != kv_pool.dtype:
        raise ValueError(f"{name}: sparsehi needs an unquantised KV cache (--kv-cache-dtype auto); "
                         f"store dtype {kv_pool.store_dtype} differs from {kv_pool.dtype}")
    if getattr(kv_pool, "start_layer", 0) not in (0, None):
        raise ValueError(f"{name}: pipeline-parallel layer slices are not supported (start_layer="
                         f"{kv_pool.start_layer}, allowed 0)")
    ps = int(kv_pool.page_size)
    rows = -(-(int(kv_pool.size) + ps) // ps) * ps
    if _is_mla(kv_pool):
        buf = kv_pool.kv_buffer[0]
        if buf.dim() != 3 or buf.shape[1] != 1:
            raise ValueError(f"{name}: kv_buffer[0] must be [slots, 1, dim], got {tuple(buf.shape)}")
        return PoolLayout("mla", len(kv_pool.kv_buffer), 1, int(buf.shape[2]), kv_pool.dtype, ps, rows,
                          kv_lora_rank=int(kv_pool.kv_lora_rank))
    if not hasattr(kv_pool, "k_buffer") or not hasattr(kv_pool, "v_buffer"):
        raise ValueError(f"{name} is not an MHA or MLA token-to-KV pool (no k_buffer/v_buffer or kv_buffer)")
    layout = getattr(kv_pool, "kv_cache_layout", None)
    if layout not in (None, "nhd"):
        raise ValueError(f"{name}: kv_cache_layout={layout!r} is not supported (allowed: 'nhd')")
    k, v = kv_pool.k_buffer[0], kv_pool.v_buffer[0]
    if k.dim() != 3 or tuple(k.shape) != tuple(v.shape):
        raise ValueError(f"{name}: K and V must both be [slots, heads, dim] of one shape (same head dim), got "
                         f"{tuple(k.shape)} and {tuple(v.shape)}")
    return PoolLayout("mha", len(kv_pool.k_buffer), int(k.shape[1]), int(k.shape[2]), kv_pool.dtype, ps, rows)


def adopt_kv_pool(kv_pool: Any, reserve_tokens: int) -> DeviceKVPool:
    """A ``DeviceKVPool`` sharing SGLang's KV memory, plus ``reserve_tokens`` slots for
    the coordinator's buffers.

    SGLang's per-layer tensors are replaced by views of the new pool's ``kv_data`` (their
    contents copied) and its data-pointer tables rebuilt, so SGLang's kernels and ours
    address the same memory. The returned pool's allocator hands out only pages of the
    reserved region: SGLang's own pages are marked taken once, here, and its own
    allocator keeps managing them. Runs once, at memory-pool initialisation; the old
    tensors are released after the copy (peak memory is twice SGLang's KV for that moment).
    """
    if not isinstance(reserve_tokens, int) or reserve_tokens < 0:
        raise ValueError(f"reserve_tokens must be an int >= 0, got {reserve_tokens!r}")
    lay = describe_kv_pool(kv_pool)
    ps = lay.page_size
    reserve = -(-reserve_tokens // ps) * ps
    pool = DeviceKVPool(lay.spec(), lay.rows + reserve, kv_pool.device)
    sgl_pages = lay.rows // ps
    if sgl_pages > 1:  # page 0 is the allocator's own padding page already
        taken = pool.allocator.alloc_pages(sgl_pages - 1)
        if taken is None or int(taken.min()) != 1 or int(taken.max()) != sgl_pages - 1:
            raise RuntimeError("could not mark SGLang's pages taken in the sparse pool's allocator")
    with torch.no_grad():
        if lay.attention == "mla":
            old = kv_pool.kv_buffer
            n = old[0].shape[0]
            for layer, t in enumerate(old):
                pool.kv_data[0, layer, :n].copy_(t)
            kv_pool.kv_buffer = [pool.kv_data[0, layer, :n] for layer in range(lay.num_layers)]
            kv_pool.data_ptrs = torch.tensor([x.data_ptr() for x in kv_pool.kv_buffer], dtype=torch.uint64,
                                             device=kv_pool.device)
        else:
            n = kv_pool.k_buffer[0].shape[0]
            for layer in range(lay.num_layers):
                pool.kv_data[0, layer, :n].copy_(kv_pool.k_buffer[layer])
                pool.kv_data[1, layer, :n].copy_(kv_pool.v_buffer[layer])
            kv_pool.k_buffer = [pool.kv_data[0, layer, :n] for layer in range(lay.num_layers)]
            kv_pool.v_buffer = [pool.kv_data[1, layer, :n] for layer in range(lay.num_layers)]
            refresh = getattr(kv_pool, "_init_data_ptrs_and_strides", None)
            if refresh is not None:
                refresh()
    return pool


def req_to_token_rows(req_to_token_pool: Any) -> tuple[int, int]:
    """``(rows, max_context_len)`` of SGLang's ``ReqToTokenPool`` (row 0 included: SGLang
    keeps it as the padding row of CUDA-graph batches)."""
    t = req_to_token_pool.req_to_token
    if t.dim() != 2:
        raise ValueError(f"req_to_token must be [rows, max_context_len], got {tuple(t.shape)}")
    return int(t.shape[0]), int(t.shape[1])
