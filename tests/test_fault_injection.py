"""FaultInjectingStorage: each fault kind at rate 1 does what it says and is counted; a
damaged page is never delivered as a hit; clean reads pass through unchanged; the wrapper is
built through the registry around any backend; and in a tree, every injected read fault is
one cache miss the storage controller counts, with no wrong KV adopted."""
from __future__ import annotations

import time

import pytest
import torch

from hicache.storage.base import StorageConfig
from hicache.storage.fault_injection import (FaultInjectingStorage, FaultPlan, InjectedFault,
                                             register_fault_injection)
from hicache.storage.file_store import FileStorage
from hicache.storage.keys import page_hash_chain, storage_key
from hicache.storage.registry import create_storage_backend, unregister_storage_backend
from l3_kit import PS, build, empty_tiers, expected, prefetch, read_host, settle, store
from memory_storage import MemoryStorage


def _wrapped(plan: FaultPlan, inner=None):
    """A wrapper over ``inner`` (in-memory by default) registered on a small host pool whose
    pages 1..4 hold distinct bytes; returns (wrapper, pool, keys)."""
    _, _, host = build()
    w = FaultInjectingStorage(inner or MemoryStorage(), plan)
    w.register_host_pool(host)
    for p in range(1, 5):
        host.page_tensor(p).view(torch.uint8).view(-1).copy_(
            torch.arange(host.page_tensor(p).view(torch.uint8).numel(), dtype=torch.int64).mul(p).remainder(251).to(torch.uint8))
    keys = [storage_key(h) for h in page_hash_chain(list(range(4 * PS)), PS)]
    return w, host, keys


def _page(host, p):
    return host.page_tensor(p).view(torch.uint8).view(-1).clone()


def test_plan_is_validated_with_clear_errors():
    with pytest.raises(ValueError, match="raise_rate must be a probability"):
        FaultPlan(raise_rate=1.5)
    with pytest.raises(ValueError, match="delay_s must be"):
        FaultPlan(delay_s=-1)
    with pytest.raises(ValueError, match=r"unknown keys \['rate'\]: allowed"):
        FaultPlan.from_dict({"rate": 0.1})
    with pytest.raises(ValueError, match="inner must be a HiCacheStorage"):
        FaultInjectingStorage(object(), FaultPlan())


def test_clean_plan_passes_pages_through():
    w, host, keys = _wrapped(FaultPlan())
    assert w.set_pages(keys, [1, 2, 3, 4]) == [True] * 4
    assert w.get_pages(keys, [5, 6, 7, 8]) == [True] * 4
    for src, dst in zip((1, 2, 3, 4), (5, 6, 7, 8)):
        assert torch.equal(_page(host, dst), _page(host, src))
    got = w.batch_get(keys[:2])
    assert torch.equal(got[1], _page(host, 2))
    assert w.counts.total == 0 and w.stats.faults == 0 and w.stats.hits == 6


@pytest.mark.parametrize("kind", ["truncate", "corrupt"])
def test_damaged_pages_are_misses_never_hits(kind):
    w, host, keys = _wrapped(FaultPlan(seed=3, **{f"{kind}_rate": 1.0}))
    assert w.set_pages(keys, [1, 2, 3, 4]) == [True] * 4
    ok = w.get_pages(keys, [5, 6, 7, 8])
    assert ok == [False, True, True, True]  # at most one fault per call: the first page drew it
    assert getattr(w.counts, kind) == 1 and w.counts.reads_failed == 1
    assert w.stats.faults == 1 and w.stats.corrupt == 1
    assert torch.equal(_page(host, 6), _page(host, 2))
    assert w.batch_get(keys[1:2]) == [None] and w.counts.reads_failed == 2


def test_raise_delay_and_dropped_writes():
    w, host, keys = _wrapped(FaultPlan(raise_rate=1.0))
    with pytest.raises(InjectedFault):
        w.set_pages(keys, [1, 2, 3, 4])
    with pytest.raises(InjectedFault):
        w.get_pages(keys, [5, 6, 7, 8])
    with pytest.raises(InjectedFault):
        w.batch_exists(keys)
    assert (w.counts.raise_write, w.counts.raise_read, w.counts.raise_exists) == (1, 1, 1)

    w, host, keys = _wrapped(FaultPlan(drop_write_rate=1.0))
    assert w.set_pages(keys, [1, 2, 3, 4]) == [True] * 4  # the loss is silent ...
    assert w.batch_exists(keys) == [False, True, True, True]  # ... and shows as a missing page
    assert w.counts.drop_write == 1

    w, host, keys = _wrapped(FaultPlan(delay_rate=1.0, delay_s=0.2))
    assert w.set_pages(keys[:1], [1]) == [True]
    t = time.monotonic()
    assert w.get_pages(keys[:1], [5]) == [True]  # late, but right
    assert time.monotonic() - t >= 0.2 and w.counts.delay == 1
    assert torch.equal(_page(host, 5), _page(host, 1))


def test_seeded_draws_repeat():
    plan = FaultPlan(seed=7, raise_rate=0.3, corrupt_rate=0.3)

    def trace():
        w, host, keys = _wrapped(plan)
        w.set_pages(keys, [1, 2, 3, 4]) if w.counts.total == 0 else None
        out = []
        for _ in range(20):
            try:
                out.append(tuple(w.get_pages(keys, [5, 6, 7, 8])))
            except InjectedFault:
                out.append("raise")
        return out

    try:
        a = trace()
    except InjectedFault:  # the set itself may draw a raise: then both traces do
        a = "raise"
    try:
        b = trace()
    except InjectedFault:
        b = "raise"
    assert a == b


def test_registry_wraps_any_backend(tmp_path):
    name = register_fault_injection("fault-injection-test")
    try:
        cfg = StorageConfig(model_name="m", extra={"file_path": str(tmp_path),
                                                   "fault_injection": {"backend": "file", "seed": 1,
                                                                       "corrupt_rate": 0.5}})
        w = create_storage_backend(name, cfg)
        assert isinstance(w, FaultInjectingStorage) and isinstance(w.inner, FileStorage)
        assert w.inner.config.extra == {"file_path": str(tmp_path)} and w.plan.corrupt_rate == 0.5
        for bad, needle in [({}, "must be a dict with 'backend'"),
                            ({"fault_injection": {"backend": "file", "bogus": 1}}, "unknown keys"),
                            ({"fault_injection": {"backend": "nope"}}, "is invalid: one of")]:
            with pytest.raises(ValueError, match=needle):
                create_storage_backend(name, StorageConfig(extra=bad))
    finally:
        unregister_storage_backend(name)


@pytest.mark.parametrize("kind", ["raise", "truncate", "corrupt"])
def test_tree_serves_every_read_fault_as_one_counted_miss(kind):
    """Pages written through the wrapper, host tier emptied, then fetched with every read
    faulty: the fetch stops at the fault, the tree adopts only verified pages (their KV is
    the right one), the controller counts exactly the injected read faults."""
    plan = FaultPlan(seed=0, **{f"{kind}_rate": 1.0})
    w = FaultInjectingStorage(MemoryStorage(), FaultPlan())
    tree, dev, host = build(w)
    tokens = list(range(100, 100 + 6 * PS))
    store(tree, dev, tokens)
    empty_tiers(tree)
    w.plan = plan
    w._rng.seed(plan.seed)
    n, _ = prefetch(tree, "r", tokens)
    if kind == "raise":  # the prefetch thread's existence check raises first: nothing fetched
        assert n == 6 * PS  # reserved before L3 is asked
        settle(tree, "r")
        assert tree.stats()["l3_exists_faults"] == 1 == w.counts.raise_exists
        assert tree.match_prefix(tokens).total_hit_length == 0 and tree.storage_leaks() == 0
        assert tree.stats()["prefetch_reserved_pages"] == 0
        w.counts.raise_exists = 0
        w.batch_exists = w.inner.batch_exists  # existence checks bypass the faults now
        n, _ = prefetch(tree, "r", tokens)  # the check passes; the reads will raise
    assert n == 6 * PS
    settle(tree, "r")
    st = tree.stats()
    assert w.counts.reads_failed >= 1
    assert st["l3_fetch_faults"] + st["l3_fetch_miss_pages"] == w.counts.reads_failed
    m = tree.match_prefix(tokens)
    assert m.backed_length < len(tokens)  # the fault is a (partial) miss ...
    if m.backed_length:  # ... and what was adopted is exactly the stored KV
        assert torch.equal(read_host(host, m.backed_host_indices), expected(tokens)[:, :, :m.backed_length])
    assert st["prefetch_reserved_pages"] == 0 and tree.storage_leaks() == 0
    tree.check_invariants()
    tree.close()
