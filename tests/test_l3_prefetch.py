"""L3 round trip and prefetch: cold prefix match -> prefetch -> host hit with the very KV
that was written; the three policies, the threshold, holes, termination and the leak
counter, and backend faults served as shorter prefixes."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from hicache.storage.keys import page_hash_chain, storage_key
from hicache.storage_controller import StoragePolicy
from l3_kit import (PS, build, empty_tiers, expected, no_leaks, prefetch, put, read_device, read_host, settle,
                    store, wait_until, written_store)
from memory_storage import MemoryStorage

TOKS = list(range(1000, 1064))  # 16 pages


def keys_of(tokens, rank=0):
    return [storage_key(h, rank) for h in page_hash_chain(tokens, PS)]


def host_free_matches_tree(tree, host):
    """Every host slot is either free or held by a tree node (nothing reserved left)."""
    assert host.available_size() + tree.all_host_indices().numel() == host.num_slots - PS  # page 0: padding


@pytest.fixture
def cold_store():
    """A store holding TOKS's 16 pages, written through by one tree."""
    return written_store(TOKS)


def test_round_trip_cold_match_prefetches_and_hits_with_equal_kv():
    s = MemoryStorage()
    tree, dev, host = build(s)
    store(tree, dev, TOKS)
    assert set(s.objects) == set(keys_of(TOKS))
    assert tree.stats()["l3_pages_written"] == 16
    empty_tiers(tree)
    assert tree.host_tokens() == 0 and tree.device_tokens() == 0
    writes = len(s.set_calls)

    n, m = prefetch(tree, "r0", TOKS)
    assert m.total_hit_length == 0 and n == 64
    settle(tree, "r0")
    m = tree.match_prefix(TOKS)
    assert m.host_hit_length == 64 and m.backed_length == 64
    assert torch.equal(read_host(host, m.host_indices), expected(TOKS))
    dev_slots, _ = tree.init_load_back(m.last_host_node)
    tree.ready_to_load_host_cache()
    tree.loading_check(block=True)
    assert torch.equal(read_device(dev, dev_slots), expected(TOKS))
    st = tree.stats()
    assert st["l3_hit_tokens"] == 64 and st["l3_pages_fetched"] == 16
    assert st["l3_bytes_fetched"] == 16 * PS * dev.spec.token_bytes
    tree.writing_check(block=True)
    tree.flush_storage()
    assert len(s.set_calls) == writes  # pages read from L3 are not written back
    no_leaks(tree)
    host_free_matches_tree(tree, host)
    tree.close()


def test_a_second_instance_over_the_same_store_hits(cold_store):
    other = MemoryStorage(objects=cold_store.objects)
    tree, dev, host = build(other)
    n, _ = prefetch(tree, "r", TOKS + [5, 6])  # a trailing partial page is not fetched
    assert n == 64
    settle(tree, "r")
    m = tree.match_prefix(TOKS)
    assert m.backed_length == 64 and torch.equal(read_host(host, m.backed_host_indices), expected(TOKS))
    no_leaks(tree)
    tree.close()


def test_prefetch_continues_a_partial_host_hit(cold_store):
    tree, dev, host = build(MemoryStorage(objects=cold_store.objects))
    store(tree, dev, TOKS[:16])
    n, m = prefetch(tree, "r", TOKS)
    assert m.backed_length == 16 and n == 48
    settle(tree, "r")
    m = tree.match_prefix(TOKS)
    assert m.total_hit_length == 64
    assert torch.equal(read_host(host, m.backed_host_indices), expected(TOKS))
    no_leaks(tree)
    tree.close()


def test_threshold_counts_only_tokens_beyond_the_tree(cold_store):
    objs = cold_store.objects
    tree, dev, _ = build(MemoryStorage(objects=objs), StoragePolicy(prefetch_threshold=48, io_batch_pages=2))
    put(tree, dev, TOKS[:32])  # the tree holds 32 tokens (device and, once acked, host)
    tree.writing_check(block=True)
    n, m = prefetch(tree, "r", TOKS)
    assert m.backed_length == 32 and n == 0  # 32 more in L3 < 48
    assert tree.stats()["prefetch_below_threshold"] == 1
    assert tree.check_prefetch_progress("r")  # nothing issued: nothing to wait for
    tree.close()
    tree, dev, _ = build(MemoryStorage(objects=objs), StoragePolicy(prefetch_threshold=32))
    put(tree, dev, TOKS[:32])
    tree.writing_check(block=True)
    n, _ = prefetch(tree, "r", TOKS)
    assert n == 32
    settle(tree, "r")
    assert tree.match_prefix(TOKS).total_hit_length == 64
    no_leaks(tree)
    tree.close()
    # default threshold: 256 tokens
    assert StoragePolicy().prefetch_threshold == 256


def test_a_hole_in_the_middle_ends_the_prefix(cold_store):
    s = MemoryStorage(objects=dict(cold_store.objects))
    del s.objects[keys_of(TOKS)[5]]
    tree, _, host = build(s)
    n, _ = prefetch(tree, "r", TOKS)
    assert n == 64  # reserved for every page; the prefetch thread asks L3
    settle(tree, "r")
    assert tree.ongoing_prefetch == {} and tree.stats()["prefetch_truncated"] == 0
    assert tree.stats()["prefetch_released_pages"] == 16 - 5  # pages 0..4; pages 6.. exist but cannot be used
    m = tree.match_prefix(TOKS)
    assert m.backed_length == 20 and torch.equal(read_host(host, m.backed_host_indices), expected(TOKS[:20]))
    no_leaks(tree)
    tree.close()


def _gated(objects, policy, block_after=4):
    s = MemoryStorage(objects=objects)
    s.get_gate, s.block_after = threading.Event(), block_after
    tree, _, host = build(s, policy)
    return s, tree, host


def test_best_effort_takes_what_arrived_and_releases_the_rest(cold_store):
    s, tree, host = _gated(cold_store.objects, StoragePolicy(prefetch_policy="best_effort", prefetch_threshold=8,
                                                             io_batch_pages=2))
    n, _ = prefetch(tree, "r", TOKS)
    assert n == 64
    op = tree.ongoing_prefetch["r"]
    wait_until(lambda: op.completed_pages == 4)
    assert tree.stats()["prefetch_reserved_pages"] == 16
    assert tree.check_prefetch_progress("r")  # at once
    m = tree.match_prefix(TOKS)
    assert m.backed_length == 16 and torch.equal(read_host(host, m.backed_host_indices), expected(TOKS[:16]))
    st = tree.stats()
    # the thread is still inside a read of page 4: those 12 pages wait for it to return
    assert st["storage_orphans"] == 1 and st["prefetch_reserved_pages"] == 12 and tree.storage_leaks() == 0
    s.get_gate.set()
    wait_until(lambda: op.done)
    tree.check_hicache_events()
    no_leaks(tree)
    host_free_matches_tree(tree, host)
    tree.close()


def test_wait_complete_waits_for_every_page(cold_store):
    s, tree, host = _gated(cold_store.objects, StoragePolicy(prefetch_policy="wait_complete", prefetch_threshold=8,
                                                             io_batch_pages=2))
    prefetch(tree, "r", TOKS)
    op = tree.ongoing_prefetch["r"]
    wait_until(lambda: op.completed_pages == 4)
    time.sleep(0.05)
    assert not tree.check_prefetch_progress("r") and not tree.check_prefetch_progress("r")
    s.get_gate.set()
    assert tree.wait_prefetch("r", 5)
    assert tree.check_prefetch_progress("r")
    m = tree.match_prefix(TOKS)
    assert m.backed_length == 64 and torch.equal(read_host(host, m.backed_host_indices), expected(TOKS))
    no_leaks(tree)
    tree.close()


def test_timeout_policy_gives_up_after_its_budget(cold_store):
    policy = StoragePolicy(prefetch_policy="timeout", prefetch_threshold=8, io_batch_pages=2,
                           prefetch_timeout_base=0.15, prefetch_timeout_per_ki_token=0.0)
    s, tree, host = _gated(cold_store.objects, policy)
    t0 = time.monotonic()
    prefetch(tree, "r", TOKS)
    op = tree.ongoing_prefetch["r"]
    wait_until(lambda: op.completed_pages == 4)
    assert not tree.check_prefetch_progress("r")
    wait_until(lambda: tree.check_prefetch_progress("r"))
    assert time.monotonic() - t0 >= 0.15
    assert tree.match_prefix(TOKS).backed_length == 16
    assert tree.stats()["prefetch_truncated"] == 1
    s.get_gate.set()
    wait_until(lambda: op.done)
    tree.check_storage_events()
    no_leaks(tree)
    tree.close()


def test_timeout_policy_returns_as_soon_as_complete(cold_store):
    policy = StoragePolicy(prefetch_policy="timeout", prefetch_threshold=8, prefetch_timeout_base=30.0)
    tree, _, _ = build(MemoryStorage(objects=cold_store.objects), policy)
    prefetch(tree, "r", TOKS)
    t0 = time.monotonic()
    wait_until(lambda: tree.check_prefetch_progress("r"))
    assert time.monotonic() - t0 < 5 and tree.match_prefix(TOKS).backed_length == 64
    tree.close()


def test_timeout_formula_and_policy_validation():
    p = StoragePolicy()
    assert (p.prefetch_timeout_base, p.prefetch_timeout_per_ki_token) == (1.0, 0.25)
    assert p.timeout_for(2048) == pytest.approx(1.5)
    with pytest.raises(ValueError, match="prefetch_policy"):
        StoragePolicy(prefetch_policy="eager")
    with pytest.raises(ValueError, match="prefetch_threshold"):
        StoragePolicy(prefetch_threshold=-1)
    with pytest.raises(ValueError, match="prefetch_timeout_base"):
        StoragePolicy(prefetch_timeout_base=-0.5)


def test_policy_from_config_reads_flag_and_extra_config():
    from hicache.config import HiCacheConfig

    cfg = HiCacheConfig(hicache_storage_backend="file", hicache_storage_prefetch_policy="timeout",
                        hicache_storage_backend_extra_config='{"prefetch_threshold": 64, "prefetch_timeout_base": 2}')
    p = StoragePolicy.from_config(cfg)
    assert (p.prefetch_policy, p.prefetch_threshold, p.prefetch_timeout_base) == ("timeout", 64, 2)
    bad = HiCacheConfig(hicache_storage_backend="file", hicache_storage_backend_extra_config='{"prefetch_threshold": "x"}')
    with pytest.raises(ValueError, match="extra-config.*prefetch_threshold"):
        StoragePolicy.from_config(bad)


def test_terminate_releases_pages_and_the_counter_shows_leaks(cold_store):
    s, tree, host = _gated(cold_store.objects, StoragePolicy(prefetch_policy="wait_complete", prefetch_threshold=8,
                                                             io_batch_pages=2), block_after=0)
    free0 = host.available_size()
    prefetch(tree, "a", TOKS)
    assert host.available_size() == free0 - 64
    assert tree.terminate_prefetch("a") == 0  # aborted request: nothing arrived
    assert tree.check_prefetch_progress("a") and tree.terminate_prefetch("a") == 0
    s.get_gate.set()
    wait_until(lambda: tree.storage_ctl.in_flight() == 0)
    tree.check_storage_events()
    no_leaks(tree)
    assert host.available_size() == free0
    # a second prefetch of the same request id is refused while one is in flight
    s.get_gate.clear()
    prefetch(tree, "b", TOKS)
    with pytest.raises(ValueError, match="already has a prefetch"):
        prefetch(tree, "b", TOKS)
    # a skipped release path shows up in storage_leaks()
    op = tree.ongoing_prefetch.pop("b")
    assert tree.storage_leaks() == op.num_pages
    tree.ongoing_prefetch["b"] = op
    s.get_gate.set()
    settle(tree, "b")
    tree.check_storage_events()
    no_leaks(tree)
    tree.close()


def test_start_node_stays_host_locked_while_fetching(cold_store):
    s, tree, host = _gated(cold_store.objects, StoragePolicy(prefetch_policy="wait_complete", prefetch_threshold=8),
                           block_after=0)
    store(tree, tree.controller.device_pool, TOKS[:16])
    tree.evict(10 ** 6)
    _, m = prefetch(tree, "r", TOKS)
    start = m.last_backed_node
    assert start.host_lock_ref == 1
    assert tree.evict_host(10 ** 6) == 0  # the prefix the fetch continues cannot go
    s.get_gate.set()
    settle(tree, "r")
    assert start.host_lock_ref == 0 and tree.match_prefix(TOKS).total_hit_length == 64
    no_leaks(tree)
    tree.close()


@pytest.mark.parametrize("fault", ["raise_inside", "raise_out", "vanished", "corrupt", "exists_down"])
def test_backend_faults_are_shorter_prefixes_never_wrong_kv(cold_store, fault, caplog):
    s = MemoryStorage(objects=dict(cold_store.objects))
    keys = keys_of(TOKS)
    if fault == "corrupt":
        s.corrupt(keys[6])
    if fault == "exists_down":
        s.fail_exists = True
    s.get_gate, s.block_after = threading.Event(), 3
    tree, _, host = build(s)
    n, _ = prefetch(tree, "r", TOKS)
    if fault == "exists_down":
        assert n == 64
        settle(tree, "r")
        assert tree.match_prefix(TOKS).total_hit_length == 0 and s.pages_read == 0
        no_leaks(tree)
        tree.close()
        return
    assert n == 64
    op = tree.ongoing_prefetch["r"]
    wait_until(lambda: op.completed_pages == 2 and s.pages_read == 3)  # page 2 read, page 3 waits at the gate
    if fault == "raise_inside":
        s.fail_get = True
    elif fault == "raise_out":
        s.raise_in_reads = True
    elif fault == "vanished":
        del s.objects[keys[4]]  # gone between the existence check and the read
    s.get_gate.set()
    settle(tree, "r")
    got = {"raise_inside": 3, "raise_out": 4, "vanished": 4, "corrupt": 6}[fault]  # whole batches of 2 before a raise
    m = tree.match_prefix(TOKS)
    assert m.backed_length == got * PS
    assert torch.equal(read_host(host, m.backed_host_indices), expected(TOKS[:got * PS]))
    st = tree.stats()
    if fault == "raise_out":
        assert st["l3_fetch_faults"] == 1
    else:
        assert st["l3_fetch_miss_pages"] == 1 and s.stats.misses >= 1
    if fault == "corrupt":
        assert s.stats.corrupt == 1
    no_leaks(tree)
    tree.close()


class ReturnsOwnTensors(MemoryStorage):
    """Breaks the contract of ``batch_get``: hits come back as tensors of its own, the targets
    left as they were."""

    def batch_get(self, keys, targets=None):
        return super().batch_get(keys, None)


def test_a_read_that_does_not_fill_its_targets_is_a_miss(cold_store):
    s = ReturnsOwnTensors(objects=dict(cold_store.objects))
    tree, _, host = build(s)
    n, _ = prefetch(tree, "r", TOKS)
    assert n == 64
    settle(tree, "r")
    # the staging buffer holds no page of this read: nothing is adopted from it
    assert tree.match_prefix(TOKS).total_hit_length == 0 and s.stats.hits == 2
    assert tree.stats()["l3_fetch_miss_pages"] == 1
    no_leaks(tree)
    tree.close()


def test_prefetch_needs_a_backed_start_node(cold_store):
    tree, dev, _ = build(MemoryStorage(objects=cold_store.objects), write_policy="write_back")
    res = put(tree, dev, TOKS[:16])  # write_back: device only
    with pytest.raises(ValueError, match="last_backed_node"):
        tree.prefetch_from_storage("r", res.last_node, TOKS[16:])
    tree.close()


def test_without_storage_prefetch_is_a_no_op():
    tree, dev, _ = build()
    assert tree.prefetch_from_storage("r", tree.root, TOKS) == 0
    assert tree.check_prefetch_progress("r") and tree.detach_storage_backend() is None
    tree.close()
