"""The format of the plugin's host KV (``--sparsehi-host-kv-dtype``): the model's dtype, or
FP8 pages with per-page, per-head scales (``hicache.kv_page_format``), and how a forward's
new tokens reach it.

The host pool is addressed by SGLang's virtual KV slots (host slot = virtual slot). An FP8
record covers a whole page, so with ``fp8_e4m3`` SGLang's ``--page-size`` must equal the
plugin's ``--sparsehi-page-size``: a sparse page is then one aligned virtual page, its
tokens on one host page in order. A page is quantised once, in the write-through after the
forward that writes its last token (``KVTransferEngine.store_pages``, on the compute
stream, so every later forward and swap-in reads the record), and its GPU page is rounded
in place to the stored values, so SGLang's kernels, the sparse buffers and any load back
see the same numbers. A page still being filled stays on the GPU in the model's dtype: the
rows that write it pin it (the prefill's pins, a registered row's newest page, every page
of a row SGLang decodes), and SGLang's radix tree holds whole pages only at
``--page-size > 1``.
"""
from __future__ import annotations

from typing import Optional

import torch

from hicache.device_pool import DeviceKVPool
from hicache.host_pool import HostKVPool
from hicache.kv_page_format import KVPageFormat
from hicache.transfer import KVTransferEngine, TransferHandle
from sparsehi.config import SparseConfig

FP8 = "fp8_e4m3"


def check_fp8_page_size(config: SparseConfig, sglang_page_size: Optional[int]) -> None:
    """FP8 host KV needs SGLang's ``--page-size`` equal to ``--sparsehi-page-size``
    (ValueError naming both flags; a page size not known yet, None, passes)."""
    if config.host_kv_dtype != FP8 or sglang_page_size is None or int(sglang_page_size) == config.page_size:
        return
    raise ValueError(f"--sparsehi-host-kv-dtype {FP8} stores whole pages with one scale per page and head, so "
                     f"SGLang's --page-size must equal --sparsehi-page-size: SGLang's page size (--page-size, or its own "
                     f"choice when that is not given) is {sglang_page_size} and --sparsehi-page-size is "
                     f"{config.page_size}; allowed: --page-size {config.page_size} (or "
                     f"--sparsehi-page-size {sglang_page_size} if that is a power of two <= 256), or "
                     f"--sparsehi-host-kv-dtype auto")


def host_token_bytes(config: SparseConfig, device_pool: DeviceKVPool) -> float:
    """Host bytes of one token, every layer: the model's dtype, or an FP8 page's values and
    scales over its ``page_size`` tokens."""
    fmt = KVPageFormat(device_pool.spec, config.host_kv_dtype)
    return fmt.page_bytes / device_pool.spec.page_size


def make_host_pool(config: SparseConfig, device_pool: DeviceKVPool, ratio: float) -> HostKVPool:
    """The pinned host pool of ``ratio`` times the device pool's slots: ``layer_first`` in
    the model's dtype, ``page_first`` FP8 records with ``fp8_e4m3``."""
    if config.host_kv_dtype == FP8:
        return HostKVPool(device_pool, hicache_ratio=ratio, layout="page_first", host_kv_dtype=FP8)
    return HostKVPool(device_pool, hicache_ratio=ratio)


def write_through(transfer: KVTransferEngine, gpu_slots: torch.Tensor,
                  virtual_slots: torch.Tensor) -> Optional[TransferHandle]:
    """A forward's new tokens to host: ``gpu_slots [N]`` (SGLang's ``out_cache_loc``, GPU
    slots) written at host slots ``virtual_slots [N]``. Model's dtype: a token-wise backup
    on the engine's stream (its handle returned). FP8: the pages whose last token is among
    them are quantised into their host pages and rounded in place, on the current stream
    (None returned); the virtual padding page 0 is never stored. No host sync."""
    if not transfer.fp8:
        return transfer.backup(gpu_slots, virtual_slots, allow_padding=True)
    host_pages, gpu_pages = transfer.completed_pages(gpu_slots, virtual_slots)
    transfer.store_pages(gpu_pages, torch.where(host_pages > 0, host_pages, -1))
    return None
