"""Backend calls that never return: every call of the L3 threads is bounded by
``backend_call_timeout_s``. A call past it is a counted miss, the whole reservation comes
back at the deadline (a hung read holds only the controller's staging buffer, never host
pages), the threads serve the next operations, and a late answer changes nothing the cache
holds."""
from __future__ import annotations

import json
import threading
import time
from typing import Optional, Sequence

import pytest
import torch

from hicache.config import HiCacheConfig
from hicache.storage.integrity import unseal
from hicache.storage.keys import page_hash_chain, storage_key
from hicache.storage_calls import MAX_ABANDONED_CALLS
from hicache.storage_controller import StoragePolicy
from l3_kit import PS, build, expected, no_leaks, prefetch, put, read_host, settle, wait_until, written_store
from memory_storage import MemoryStorage

TOKS = list(range(7000, 7064))  # 16 pages
OTHER = list(range(8000, 8064))
DEADLINE = 0.3


def keys_of(tokens):
    return [storage_key(h, 0) for h in page_hash_chain(tokens, PS)]


class HangingStorage(MemoryStorage):
    """Reads of ``hang_reads`` keys and existence checks while ``hang_exists`` is on block
    until ``release`` is set (a hung network file system for those calls). A read of a
    ``pause_reads`` key fills its targets, sets ``filled`` and returns once ``resume`` is set."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.release = threading.Event()
        self.hang_reads: set[str] = set()
        self.hang_exists = False
        self.late_reads = 0  # reads that returned after they hung
        self.pause_reads: set[str] = set()
        self.filled, self.resume = threading.Event(), threading.Event()

    def batch_get(self, keys: Sequence[str], targets: Optional[Sequence[torch.Tensor]] = None):
        hung = bool(self.hang_reads.intersection(keys))
        if hung:
            self.release.wait()
        out = super().batch_get(keys, targets)
        if self.pause_reads.intersection(keys):
            self.filled.set()
            self.resume.wait()
        self.late_reads += hung
        return out

    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        if self.hang_exists:
            self.release.wait()
        return super().batch_exists(keys)


@pytest.fixture
def objects():
    return written_store(TOKS, OTHER).objects


def _policy(**kw) -> StoragePolicy:
    return StoragePolicy(**{"prefetch_policy": "wait_complete", "prefetch_threshold": 8, "io_batch_pages": 2,
                            "backend_call_timeout_s": DEADLINE, **kw})


def _settle_timed(tree, rid, limit: float = 10.0) -> float:
    t0 = time.monotonic()
    while not tree.check_prefetch_progress(rid):
        assert time.monotonic() - t0 < limit, "the prefetch was never settled"
        tree.wait_prefetch(rid, 0.005)
    return time.monotonic() - t0


def _tree_kv_is_right(tree, host, *seqs) -> None:
    for toks in seqs:
        m = tree.match_prefix(toks)
        assert torch.equal(read_host(host, m.backed_host_indices), expected(toks[:m.backed_length]))


def test_a_hung_read_is_a_miss_at_the_deadline_and_holds_no_host_page(objects):
    s = HangingStorage(objects=dict(objects))
    s.hang_reads = {keys_of(TOKS)[2]}  # the second batch (pages 2, 3) never returns
    tree, _, host = build(s, _policy())
    alloc = host.allocator
    free0 = alloc.num_free_pages()

    prefetch(tree, "a", TOKS)
    reserved = [int(p) // PS for p in tree.ongoing_prefetch["a"].host_indices[::PS].tolist()]
    waited = _settle_timed(tree, "a")
    assert DEADLINE <= waited < DEADLINE + 3.0  # wait_complete, yet bounded by the deadline
    assert tree.match_prefix(TOKS).backed_length == 2 * PS  # the pages before the hung batch
    st = tree.stats()
    assert st["l3_call_timeouts"] == 1 and st["l3_fetch_faults"] == 1 and st["l3_calls_abandoned"] == 1
    # the read still hangs, holding one staging buffer; every host page it was meant for is back
    assert st["l3_stages_retired"] == 1 and s.late_reads == 0
    assert st["prefetch_reserved_pages"] == 0 and tree.storage_leaks() == 0 and not tree._orphans
    assert tree.host_tokens() == 2 * PS and alloc.num_free_pages() == free0 - 2
    assert alloc.is_free(torch.tensor(reserved[2:])).all()

    # the prefetch thread serves the next request, from a healthy key, with another buffer
    prefetch(tree, "b", OTHER)
    assert _settle_timed(tree, "b") < 2.0  # not queued behind the hung read
    assert tree.match_prefix(OTHER).backed_length == 64
    _tree_kv_is_right(tree, host, TOKS, OTHER)

    # every free host page (the hung read's among them, unless "b" took them) goes to
    # someone else and is filled with their data ...
    grabbed = alloc.alloc_pages(alloc.num_free_pages())
    other_pages = {int(p) // PS for p in tree.match_prefix(OTHER).backed_host_indices.tolist()}
    assert set(reserved[2:]) <= set(grabbed.tolist()) | other_pages
    for p in grabbed.tolist():
        host.page_tensor(p).fill_(-3.0)
    # ... then the hung read returns with its pages: they go nowhere
    s.release.set()
    wait_until(lambda: s.late_reads == 1 and tree.storage_ctl.calls.abandoned == 0)
    assert tree.stats()["l3_stages_retired"] == 0  # its buffer is free again
    assert all(bool((host.page_tensor(p) == -3.0).all()) for p in grabbed.tolist())
    _tree_kv_is_right(tree, host, TOKS, OTHER)
    alloc.free_pages(grabbed)
    tree.check_storage_events()
    assert tree.match_prefix(TOKS).backed_length == 2 * PS  # the late pages were not adopted
    no_leaks(tree)
    assert alloc.num_free_pages() == free0 - tree.host_tokens() // PS
    tree.close()


def test_the_staging_buffer_of_a_hung_read_is_not_reused_before_it_returns(objects):
    deadline = 1.5  # the paused read below must stay within it on a busy machine
    s = HangingStorage(objects=dict(objects))
    s.hang_reads = {keys_of(TOKS)[0]}
    s.pause_reads = {keys_of(OTHER)[0]}
    tree, _, host = build(s, _policy(backend_call_timeout_s=deadline))
    prefetch(tree, "hung", TOKS)
    _settle_timed(tree, "hung")
    assert tree.match_prefix(TOKS).backed_length == 0 and tree.stats()["l3_stages_retired"] == 1
    # the next read has filled its staging buffer with OTHER's first pages; the hung read
    # now returns and writes TOKS's first pages into its own buffer, not into that one
    prefetch(tree, "next", OTHER)
    assert s.filled.wait(5.0)
    s.release.set()
    wait_until(lambda: s.late_reads == 1)
    s.resume.set()
    settle(tree, "next")
    assert tree.stats()["l3_call_timeouts"] == 1  # the paused read was not abandoned
    assert tree.match_prefix(OTHER).backed_length == 64
    _tree_kv_is_right(tree, host, OTHER)
    assert tree.match_prefix(TOKS).backed_length == 0
    wait_until(lambda: tree.storage_ctl.calls.abandoned == 0)
    tree.check_storage_events()
    no_leaks(tree)
    tree.close()


def test_a_hung_write_releases_its_nodes_at_the_deadline_and_stores_the_right_bytes():
    s = MemoryStorage()
    s.set_gate = threading.Event()
    tree, dev, host = build(s, _policy())
    res = put(tree, dev, TOKS[:16])
    tree.writing_check(block=True)  # host copy done: the L3 write is submitted and hangs
    node = res.last_node
    pages = [int(p) // PS for p in node.host_indices[::PS].tolist()]
    before = [host.page_tensor(p).contiguous().view(torch.uint8).numpy().tobytes() for p in pages]
    assert node.host_lock_ref == 1
    t0 = time.monotonic()
    wait_until(lambda: tree.storage_ctl.in_flight() == 0)
    assert time.monotonic() - t0 < DEADLINE + 3.0
    tree.check_hicache_events()
    assert node.host_lock_ref == 0 and node.storage_op is None and not node.in_storage
    st = tree.stats()
    assert st["l3_call_timeouts"] == 1 and st["l3_write_faults"] == 1 and st["storage_backup_failed_ops"] == 1
    assert st["l3_stages_retired"] == 1  # the hung write holds its staging copy
    # the node's pages are evictable, and go to other data
    tree.evict(10 ** 6)
    assert tree.evict_host(10 ** 6) == 16
    for p in pages:
        host.page_tensor(p).fill_(-5.0)
    s.set_gate.set()  # the late write goes through: with the bytes the pages had when it began
    keys = keys_of(TOKS[:16])
    wait_until(lambda: tree.storage_ctl.calls.abandoned == 0)
    assert tree.stats()["l3_stages_retired"] == 0
    assert [bytes(unseal(s.objects[k])) for k in keys[:2]] == before[:2]  # the first batch of io_batch_pages
    assert not any(k in s.objects for k in keys[2:])  # later batches were never sent
    tree.check_storage_events()
    no_leaks(tree)
    tree.close()


def test_calls_are_skipped_while_abandoned_calls_are_outstanding(objects):
    deadline = 0.5
    s = HangingStorage(objects=dict(objects))
    s.hang_exists = True
    tree, _, host = build(s, _policy(backend_call_timeout_s=deadline))
    for i in range(MAX_ABANDONED_CALLS):  # each existence check hangs and is abandoned
        prefetch(tree, f"hung{i}", TOKS)
        assert deadline <= _settle_timed(tree, f"hung{i}") < deadline + 3.0
    assert tree.stats()["l3_calls_abandoned"] == MAX_ABANDONED_CALLS
    prefetch(tree, "skipped", TOKS)
    assert _settle_timed(tree, "skipped") < deadline  # not called: a miss at once
    st = tree.stats()
    assert st["l3_calls_skipped"] == 1 and st["l3_call_timeouts"] == MAX_ABANDONED_CALLS
    assert st["l3_exists_faults"] == MAX_ABANDONED_CALLS + 1 and tree.match_prefix(TOKS).total_hit_length == 0
    s.hang_exists = False
    s.release.set()
    wait_until(lambda: tree.storage_ctl.calls.abandoned == 0)
    prefetch(tree, "after", TOKS)  # calls resume once the abandoned ones returned
    settle(tree, "after")
    assert tree.match_prefix(TOKS).backed_length == 64
    _tree_kv_is_right(tree, host, TOKS)
    tree.check_storage_events()
    no_leaks(tree)
    tree.close()


def test_backend_call_timeout_is_read_from_the_extra_config_and_checked():
    assert StoragePolicy().backend_call_timeout_s == 10.0
    c = HiCacheConfig(hicache_storage_backend="file",
                      hicache_storage_backend_extra_config='{"backend_call_timeout_s": 2.5}')
    assert StoragePolicy.from_config(c).backend_call_timeout_s == 2.5
    for bad in (0, -1, "5", True, 1e400):
        with pytest.raises(ValueError, match="backend_call_timeout_s"):
            StoragePolicy(backend_call_timeout_s=bad)
    c = HiCacheConfig(hicache_storage_backend="file",
                      hicache_storage_backend_extra_config=json.dumps({"backend_call_timeout_s": 0}))
    with pytest.raises(ValueError, match="extra-config.*backend_call_timeout_s"):
        StoragePolicy.from_config(c)
