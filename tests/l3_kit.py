"""Shared setup of the L3 tests: a CPU tree over a page-layout host pool, token sequences
whose KV is a function of the whole prefix, and waits with deadlines."""
from __future__ import annotations

import time
from typing import Callable, Optional

import torch

from hicache.controller import HiCacheController
from hicache.device_pool import DeviceKVPool
from hicache.host_pool import HostKVPool
from hicache.kv_spec import KVCacheSpec
from hicache.radix_tree import HiRadixTree
from hicache.storage_controller import StoragePolicy
from memory_storage import MemoryStorage

LAYERS, HEADS, DIM, PS = 2, 2, 4, 4


def build(storage=None, policy: Optional[StoragePolicy] = None, write_policy: str = "write_through",
          dev_pages: int = 32, ratio: float = 2.0, tp_group=None):
    spec = KVCacheSpec("mha", LAYERS, HEADS, DIM, torch.float32, PS)
    dev = DeviceKVPool(spec, dev_pages * PS, "cpu")
    host = HostKVPool(dev, hicache_ratio=ratio, layout="page_first_direct")
    ctl = HiCacheController(dev, host, write_policy=write_policy, io_backend="direct", tp_group=tp_group)
    tree = HiRadixTree(ctl)
    if storage is not None:
        tree.attach_storage_backend(storage, policy or StoragePolicy(prefetch_threshold=8, io_batch_pages=2))
    return tree, dev, host


def expected(tokens) -> torch.Tensor:
    """KV of each token as a function of its whole prefix: [L, B, n, H, D] float32 (exact ints)."""
    codes, h = [], 7
    for t in tokens:
        h = (h * 1_000_003 + int(t) + 1) % 1_048_573
        codes.append(h)
    c = torch.tensor(codes, dtype=torch.int64)
    l = torch.arange(LAYERS).view(LAYERS, 1, 1, 1, 1)
    b = torch.arange(2).view(1, 2, 1, 1, 1)
    hd = torch.arange(HEADS * DIM).view(1, 1, 1, HEADS, DIM)
    return ((c.view(1, 1, -1, 1, 1) * 7 + l * 131 + b * 17 + hd) % (1 << 23)).float()


def read_host(host: HostKVPool, slots) -> torch.Tensor:
    return torch.stack([torch.stack(host.read_tokens(l, slots)) for l in range(LAYERS)])


def read_device(dev: DeviceKVPool, slots) -> torch.Tensor:
    return torch.stack([torch.stack([b[slots] for b in dev.layer_buffers(l)]) for l in range(LAYERS)])


def put(tree: HiRadixTree, dev: DeviceKVPool, tokens):
    """Prefill ``tokens`` on the device and insert them (the scheduler's cache_finished_req)."""
    slots = dev.allocator.alloc(len(tokens))
    if slots is None:
        tree.evict(len(tokens))
        slots = dev.allocator.alloc(len(tokens))
    kv = expected(tokens)
    for layer in range(LAYERS):
        dev.set_kv(layer, slots, kv[layer, 0], kv[layer, 1])
    res = tree.insert(tokens, device_indices=slots)
    dev.allocator.free(res.device_unused)
    return res


def store(tree: HiRadixTree, dev: DeviceKVPool, tokens):
    """Insert, back up to host, and write through to L3 (flushed)."""
    res = put(tree, dev, tokens)
    tree.writing_check(block=True)
    tree.flush_storage()
    return res


def written_store(*prompts) -> MemoryStorage:
    """A memory store holding ``prompts``' pages, written through by one tree (then closed)."""
    s = MemoryStorage()
    tree, dev, _ = build(s)
    for tokens in prompts:
        store(tree, dev, tokens)
    tree.close()
    return s


def empty_tiers(tree: HiRadixTree) -> None:
    """Drop everything from device and host (a cold cache)."""
    tree.evict(10 ** 9)
    tree.evict_host(10 ** 9)


def wait_until(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError("condition not reached in time")
        time.sleep(0.002)


def prefetch(tree: HiRadixTree, rid, tokens) -> tuple[int, object]:
    """match_prefix, then prefetch what follows the backed-up part; returns (tokens
    fetched, the match)."""
    m = tree.match_prefix(tokens)
    return tree.prefetch_from_storage(rid, m.last_backed_node, tokens[m.backed_length:]), m


def settle(tree: HiRadixTree, rid, timeout: float = 5.0) -> None:
    """Let the fetch finish, then settle it (any policy takes everything then)."""
    assert tree.wait_prefetch(rid, timeout)
    assert tree.check_prefetch_progress(rid)


def no_leaks(tree: HiRadixTree) -> None:
    s = tree.stats()
    assert tree.storage_leaks() == 0
    assert s["prefetch_reserved_pages"] == 0, s
    assert s["prefetch_issued_pages"] == s["prefetch_adopted_pages"] + s["prefetch_released_pages"]
    assert not tree.ongoing_prefetch and not tree._orphans
    tree.check_invariants()
