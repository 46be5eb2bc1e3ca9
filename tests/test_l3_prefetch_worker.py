"""The prefetch thread owns the L3 existence check (the scheduler only enqueues and polls),
and prefetches in flight reserve at most ``prefetch_capacity_limit`` host tokens."""
from __future__ import annotations

import json
import threading
import time
from typing import Optional, Sequence

import pytest

from hicache.config import HiCacheConfig
from hicache.storage.keys import page_hash_chain, storage_key
from hicache.storage_controller import StoragePolicy
from l3_kit import PS, build, expected, no_leaks, prefetch, read_host, settle, wait_until, written_store
from memory_storage import MemoryStorage

TOKS = list(range(3000, 3064))  # 16 pages
OTHER = list(range(5000, 5064))


class SlowExists(MemoryStorage):
    """A backend whose existence query hangs until ``exists_gate`` is set (a slow
    metadata service); page reads are unaffected."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.exists_gate: Optional[threading.Event] = None
        self.exists_calls = 0
        self.exists_threads: list[str] = []

    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        self.exists_calls += 1
        self.exists_threads.append(threading.current_thread().name)
        gate = self.exists_gate
        if gate is not None:
            gate.wait(10)
        return super().batch_exists(keys)


@pytest.fixture
def objects():
    return written_store(TOKS, OTHER).objects


def _slow(objects, policy: StoragePolicy):
    s = SlowExists(objects=dict(objects))
    s.exists_gate = threading.Event()
    tree, _, host = build(s, policy)
    return s, tree, host


def test_prefetch_returns_without_waiting_for_the_existence_check(objects):
    s, tree, host = _slow(objects, StoragePolicy(prefetch_policy="wait_complete", prefetch_threshold=8,
                                                 io_batch_pages=2))
    t0 = time.monotonic()
    n, _ = prefetch(tree, "r", TOKS)
    elapsed = time.monotonic() - t0
    assert n == 64 and elapsed < 0.05, elapsed
    op = tree.ongoing_prefetch["r"]
    wait_until(lambda: s.exists_calls == 1)  # the prefetch thread is inside batch_exists
    assert op.planned_pages is None and not tree.check_prefetch_progress("r")  # wait_complete waits
    s.exists_gate.set()
    settle(tree, "r")
    m = tree.match_prefix(TOKS)
    assert m.backed_length == 64 and read_host(host, m.backed_host_indices).equal(expected(TOKS))
    assert tree.stats()["prefetch_tokens_occupied"] == 0
    # never the caller's thread: the prefetch thread's bounded call runs it
    assert s.exists_threads == ["hicache-l3-call"]
    no_leaks(tree)
    tree.close()


def test_best_effort_settles_during_the_existence_check_and_releases_later(objects):
    s, tree, _ = _slow(objects, StoragePolicy(prefetch_policy="best_effort", prefetch_threshold=8))
    n, _ = prefetch(tree, "r", TOKS)
    assert n == 64
    op = tree.ongoing_prefetch["r"]
    wait_until(lambda: s.exists_calls == 1)
    assert tree.check_prefetch_progress("r")  # nothing arrived yet: the request computes its prefix
    assert tree.match_prefix(TOKS).total_hit_length == 0
    assert tree.stats()["storage_orphans"] == 1  # the thread may still write into the reservation
    assert tree.stats()["prefetch_tokens_occupied"] == 0
    s.exists_gate.set()
    wait_until(lambda: op.done)
    tree.check_storage_events()
    assert s.pages_read == 0  # cancelled before any page was read
    no_leaks(tree)
    tree.close()


def test_timeout_policy_bounds_a_hanging_existence_check(objects):
    s, tree, _ = _slow(objects, StoragePolicy(prefetch_policy="timeout", prefetch_threshold=8,
                                              prefetch_timeout_base=0.05, prefetch_timeout_per_ki_token=0.0))
    prefetch(tree, "r", TOKS)
    assert not tree.check_prefetch_progress("r")
    deadline = time.monotonic() + 5
    while not tree.check_prefetch_progress("r"):
        assert time.monotonic() < deadline
        time.sleep(0.005)
    s.exists_gate.set()
    wait_until(lambda: tree.storage_ctl.in_flight() == 0)
    tree.check_storage_events()
    no_leaks(tree)
    tree.close()


def test_below_threshold_is_decided_by_the_prefetch_thread(objects):
    s = MemoryStorage(objects=dict(objects))
    tree, _, _ = build(s, StoragePolicy(prefetch_threshold=32, io_batch_pages=2))
    # keep only 4 leading pages of TOKS in L3: 16 tokens < threshold 32
    keys = [storage_key(h, 0) for h in page_hash_chain(TOKS, PS)]
    for k in keys[4:]:
        del s.objects[k]
    n, _ = prefetch(tree, "r", TOKS)
    assert n == 64  # reserved: the scheduler does not know yet
    settle(tree, "r")
    st = tree.stats()
    assert st["prefetch_below_threshold"] == 1 and st["l3_pages_fetched"] == 0
    assert tree.match_prefix(TOKS).total_hit_length == 0
    no_leaks(tree)
    tree.close()


def test_capacity_limit_rate_limits_counts_and_releases(objects):
    s = SlowExists(objects=dict(objects))
    s.exists_gate = threading.Event()
    tree, _, host = build(s, StoragePolicy(prefetch_policy="wait_complete", prefetch_threshold=8,
                                           prefetch_capacity_limit=64))
    assert tree.stats()["prefetch_capacity_limit"] == 64
    assert prefetch(tree, "a", TOKS)[0] == 64
    assert tree.prefetch_tokens_occupied == 64
    free_before = host.available_size()
    n, m = prefetch(tree, "b", OTHER)  # 64 in flight + 64 more > 64: not started
    assert n == 0 and "b" not in tree.ongoing_prefetch and host.available_size() == free_before
    assert tree.stats()["prefetch_rate_limited"] == 1
    assert tree.check_prefetch_progress("b")  # nothing to wait for: "b" computes its prefix
    s.exists_gate.set()
    settle(tree, "a")
    assert tree.prefetch_tokens_occupied == 0  # released when the prefetch ended
    assert prefetch(tree, "b", OTHER)[0] == 64  # capacity is free again
    settle(tree, "b")
    assert tree.match_prefix(OTHER).backed_length == 64
    assert tree.prefetch_tokens_occupied == 0 and tree.stats()["prefetch_rate_limited"] == 1
    no_leaks(tree)
    tree.close()


def test_capacity_is_released_by_every_settling_path(objects):
    s = SlowExists(objects=dict(objects))
    tree, _, _ = build(s, StoragePolicy(prefetch_threshold=8, prefetch_capacity_limit=128))
    prefetch(tree, "a", TOKS)
    prefetch(tree, "b", OTHER)
    assert tree.prefetch_tokens_occupied == 128
    tree.terminate_prefetch("a")  # aborted request
    assert tree.prefetch_tokens_occupied == 64
    tree.detach_storage_backend(force=True)  # detach settles "b"
    assert tree.prefetch_tokens_occupied == 0
    tree.check_storage_events()
    no_leaks(tree)
    tree.close()


def test_default_capacity_is_half_the_host_pool():
    tree, _, host = build(MemoryStorage())
    assert tree.prefetch_capacity_limit == host.num_slots // 2
    assert StoragePolicy(prefetch_capacity_fraction=0.25).capacity_tokens(1000) == 250
    assert StoragePolicy(prefetch_capacity_limit=0).capacity_tokens(1000) == 0
    tree.close()


@pytest.mark.parametrize("key,value", [("prefetch_capacity_limit", -1), ("prefetch_capacity_limit", 1.5),
                                       ("prefetch_capacity_limit", True), ("prefetch_capacity_fraction", 0),
                                       ("prefetch_capacity_fraction", 1.5), ("prefetch_capacity_fraction", "x")])
def test_capacity_options_are_validated_by_name(key, value):
    with pytest.raises(ValueError, match=key):
        StoragePolicy(**{key: value})
    c = HiCacheConfig(hicache_storage_backend="file", hicache_storage_backend_extra_config=json.dumps({key: value}))
    with pytest.raises(ValueError, match=f"extra-config.*{key}"):
        StoragePolicy.from_config(c)


def test_capacity_options_from_the_extra_config():
    c = HiCacheConfig(hicache_storage_backend="file",
                      hicache_storage_backend_extra_config='{"prefetch_capacity_limit": 4096}')
    assert StoragePolicy.from_config(c).prefetch_capacity_limit == 4096
    c = HiCacheConfig(hicache_storage_backend="file",
                      hicache_storage_backend_extra_config='{"prefetch_capacity_fraction": 0.25}')
    p = StoragePolicy.from_config(c)
    assert p.prefetch_capacity_limit is None and p.capacity_tokens(1000) == 250
