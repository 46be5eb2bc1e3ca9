"""SGLang's KV pools seen as the ``DeviceKVPool`` our coordinator and KV manager drive.

Our KV manager and transfer engine address every layer of a pool from one base tensor
(``DeviceKVPool.kv_data [buffers, layers, slots, heads, dim]``); SGLang keeps one tensor
per layer (``MHATokenToKVPool.k_buffer[l]`` / ``v_buffer[l]``, ``MLATokenToKVPool.kv_buffer[l]``).
:func:`adopt_kv_pool` takes over the GPU memory SGLang allotted to its KV pool without a
second copy: SGLang's tensors (empty at start-up) are released first, then one
``DeviceKVPool`` of at most the same bytes is allocated, and SGLang's per-layer lists
become views of its first rows. Those rows are the GPU pages SGLang's kernels address
(through the plugin's virtual->GPU page map, see ``host_backed_allocator``); the slots
after them hold the sparse requests' buffers, handed out by the pool's allocator.

Nothing here imports SGLang: the pool is duck-typed by the attributes read below
(``sglang_api`` owns the attributes that tell the pool's kind, and the writes into
SGLang's objects).
"""
from __future__ import annotations

import gc
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from hicache.device_pool import DeviceKVPool
from hicache.kv_spec import KVCacheSpec
from sparsehi.sglang_plugin import sglang_api


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
    if sglang_api.is_mla_pool(kv_pool):
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


def adopt_kv_pool(kv_pool: Any, *, sel_page_size: int, reserve_tokens: int,
                  extra_bytes: int = 0) -> tuple[DeviceKVPool, int]:
    """A ``DeviceKVPool`` in the GPU memory of SGLang's (empty) KV pool, and the rows of it
    SGLang's kernels now address.

    SGLang's tensors are released first; the new pool holds ``rows`` slots for SGLang
    (page 0 its padding page; a multiple of both page sizes) then ``reserve_tokens`` slots
    (rounded up to whole ``sel_page_size`` pages) for the coordinator's buffers, and all
    of it (plus ``extra_bytes`` the caller allocates beside it) takes at most the bytes
    SGLang's tensors had. SGLang's per-layer lists point at views of the first ``rows``
    slots and its ``size`` becomes ``rows - page_size``. The pool's allocator hands out
    only pages after them. Returns ``(pool, rows)``. Raises ValueError when the reserve
    leaves SGLang fewer than two pages.
    """

    if not isinstance(reserve_tokens, int) or reserve_tokens < 0:
        raise ValueError(f"reserve_tokens must be an int >= 0, got {reserve_tokens!r}")
    if not isinstance(sel_page_size, int) or sel_page_size < 1:
        raise ValueError(f"sel_page_size must be an int >= 1, got {sel_page_size!r}")
    lay = describe_kv_pool(kv_pool)
    spec = KVCacheSpec(lay.attention, lay.num_layers, lay.kv_heads, lay.head_dim, lay.dtype, sel_page_size,
                       kv_lora_rank=lay.kv_lora_rank)
    old_bytes = sum(t.numel() * t.element_size() for t in sglang_api.pool_buffers(kv_pool))
    unit = int(np.lcm(sel_page_size, lay.page_size))
    reserve = -(-reserve_tokens // sel_page_size) * sel_page_size
    rows = (int(max(0, old_bytes - extra_bytes) // spec.token_bytes) - reserve) // unit * unit
    if rows < 2 * lay.page_size or rows < unit:
        raise ValueError(f"the sparse buffers ({reserve} tokens) and tables ({extra_bytes / 2**30:.2f} GiB) leave "
                         f"SGLang's kernels {max(rows, 0)} GPU tokens of its {lay.rows}: lower "
                         f"--sparsehi-max-sparse-requests or --sparsehi-device-buffer-size, or raise "
                         f"--mem-fraction-static")
    device = kv_pool.device
    sglang_api.drop_pool_buffers(kv_pool)
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()  # SGLang's per-layer blocks go back before the one allocation
    pool = DeviceKVPool(spec, rows + reserve, device)
    taken = pool.allocator.alloc_pages(rows // sel_page_size - 1)  # page 0 is the allocator's own padding page
    if rows // sel_page_size > 1 and (taken is None or int(taken.max()) != rows // sel_page_size - 1):
        raise RuntimeError("could not mark SGLang's rows taken in the sparse pool's allocator")
    per_layer = [tuple(pool.kv_data[b, layer, :rows] for b in range(spec.num_buffers))
                 for layer in range(lay.num_layers)]
    sglang_api.swap_pool_buffers(kv_pool, per_layer, rows)
    return pool, rows


def req_to_token_rows(req_to_token_pool: Any) -> tuple[int, int]:
    """``(rows, max_context_len)`` of SGLang's ``ReqToTokenPool`` (row 0 included: SGLang
    keeps it as the padding row of CUDA-graph batches)."""
    t = req_to_token_pool.req_to_token
    if t.dim() != 2:
        raise ValueError(f"req_to_token must be [rows, max_context_len], got {tuple(t.shape)}")
    return int(t.shape[0]), int(t.shape[1])
