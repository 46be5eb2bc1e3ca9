"""Attaching a backend to a running cache and detaching it: drain waits for fetches and
writes and keeps what they brought; force abandons them and still releases every
reservation and lock (once the backend call returns); neither deletes stored data."""
from __future__ import annotations

import threading
import time

import pytest

from hicache.storage_controller import StoragePolicy
from l3_kit import build, empty_tiers, expected, no_leaks, prefetch, read_host, store, wait_until
from memory_storage import MemoryStorage

TOKS = list(range(300, 364))  # 16 pages


class NoClear(MemoryStorage):
    """Fails the test if anything deletes stored data."""

    def clear(self) -> None:  # pragma: no cover - the assertion is that this never runs
        raise AssertionError("detach must not clear the backend")


def _filled() -> dict:
    s = MemoryStorage()
    tree, dev, _ = build(s)
    store(tree, dev, TOKS)
    tree.close()
    return s.objects


def test_attach_to_a_running_cache_then_detach_keeps_data():
    tree, dev, host = build()  # running without L3
    store(tree, dev, TOKS[:16])
    s = NoClear()
    tree.attach_storage_backend(s, StoragePolicy(prefetch_threshold=8))
    with pytest.raises(ValueError, match="already attached"):
        tree.attach_storage_backend(MemoryStorage())
    store(tree, dev, TOKS)  # new pages go out from now on
    assert len(s.objects) == 12
    m = tree.match_prefix(TOKS)
    tree.write_backup_storage(m.last_backed_node)  # and older ones on request
    tree.flush_storage()
    assert len(s.objects) == 16
    assert tree.detach_storage_backend() is s
    assert tree.storage_backend is None and len(s.objects) == 16
    store(tree, dev, list(range(7000, 7016)))  # running on without L3
    assert len(s.objects) == 16
    tree.close()


def test_attach_needs_a_page_layout_and_a_backend():
    from hicache.controller import HiCacheController
    from hicache.device_pool import DeviceKVPool
    from hicache.host_pool import HostKVPool
    from hicache.kv_spec import KVCacheSpec
    from hicache.radix_tree import HiRadixTree
    import torch

    dev = DeviceKVPool(KVCacheSpec("mha", 1, 1, 2, torch.float32, 4), 64, "cpu")
    tree = HiRadixTree(HiCacheController(dev, HostKVPool(dev, layout="layer_first"), io_backend="direct"))
    with pytest.raises(ValueError, match="page layout.*not layer_first"):
        tree.attach_storage_backend(MemoryStorage())
    with pytest.raises(ValueError, match="HiCacheStorage"):
        tree.attach_storage_backend(object())
    tree.close()


def test_detach_drains_in_flight_fetches_and_writes():
    s = NoClear(objects=_filled())
    s.get_gate, s.block_after = threading.Event(), 2
    tree, dev, host = build(s, StoragePolicy(prefetch_policy="wait_complete", prefetch_threshold=8))
    n, _ = prefetch(tree, "r", TOKS)
    assert n == 64
    s.set_gate = threading.Event()
    res = store_nowait(tree, dev, list(range(8000, 8016)))
    assert res.last_node.storage_op is not None
    threading.Timer(0.1, s.get_gate.set).start()
    threading.Timer(0.1, s.set_gate.set).start()
    t0 = time.monotonic()
    assert tree.detach_storage_backend() is s
    assert time.monotonic() - t0 >= 0.09
    m = tree.match_prefix(TOKS)  # the drained fetch was settled in full
    assert m.backed_length == 64 and bool((read_host(host, m.backed_host_indices) == expected(TOKS)).all())
    assert res.last_node.in_storage and res.last_node.host_lock_ref == 0
    assert tree.check_prefetch_progress("r")
    no_leaks(tree)
    assert tree.stats()["ongoing_storage_backups"] == 0
    tree.close()


def store_nowait(tree, dev, tokens):
    from l3_kit import put

    res = put(tree, dev, tokens)
    tree.writing_check(block=True)
    return res


def test_detach_drain_times_out_without_changing_anything():
    s = MemoryStorage(objects=_filled())
    s.get_gate = threading.Event()
    tree, _, _ = build(s)
    prefetch(tree, "r", TOKS)
    with pytest.raises(TimeoutError, match="force=True"):
        tree.detach_storage_backend(timeout=0.05)
    assert tree.storage_backend is s and "r" in tree.ongoing_prefetch
    s.get_gate.set()
    assert tree.detach_storage_backend() is s
    no_leaks(tree)
    tree.close()


def test_force_detach_abandons_and_releases_after_the_call_returns():
    s = NoClear(objects=_filled())
    s.get_gate, s.block_after = threading.Event(), 2
    tree, dev, host = build(s, StoragePolicy(prefetch_policy="wait_complete", prefetch_threshold=8,
                                             io_batch_pages=2))
    free0 = host.available_size()
    prefetch(tree, "r", TOKS)
    s.set_gate = threading.Event()
    res = store_nowait(tree, dev, list(range(8000, 8016)))
    node = res.last_node
    wait_until(lambda: s.set_waiting == 1 and tree.ongoing_prefetch["r"].completed_pages == 2)
    t0 = time.monotonic()
    assert tree.detach_storage_backend(force=True, force_grace_s=0.05) is s
    assert time.monotonic() - t0 < 2
    assert tree.storage_backend is None and tree.check_prefetch_progress("r")
    assert tree.match_prefix(TOKS).backed_length == 0  # abandoned: nothing taken
    st = tree.stats()
    # both backend calls are still running: their pages stay owned until they return
    assert st["storage_orphans"] == 2 and st["prefetch_reserved_pages"] == 16 and tree.storage_leaks() == 0
    assert node.host_lock_ref == 1 and not node.in_storage and node.storage_op is None
    tree.check_invariants()
    s.get_gate.set()
    s.set_gate.set()
    wait_until(lambda: all(op.done for op, _, _ in tree._orphans))
    tree.check_hicache_events()
    no_leaks(tree)
    assert node.host_lock_ref == 0
    assert host.available_size() == free0 - 16  # only the stored sequence's 4 pages remain
    assert len(s.objects) >= 16  # nothing deleted
    # a new backend can be attached afterwards and serves the prefix
    empty_tiers(tree)
    tree.attach_storage_backend(MemoryStorage(objects=s.objects), StoragePolicy(prefetch_threshold=8))
    prefetch(tree, "r2", TOKS)
    assert tree.wait_prefetch("r2", 5) and tree.check_prefetch_progress("r2")
    assert tree.match_prefix(TOKS).backed_length == 64
    tree.close()
