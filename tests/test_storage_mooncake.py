"""The ``mooncake`` L3 backend against a real ``mooncake_master`` on 127.0.0.1: the checks
every backend passes (``storage_conformance``), round trips (single, batch, host-pool
pages), per-key existence with a hole, only-new writes, corrupt and wrong-length objects as
misses, a page read while another client writes it, the master killed mid-run (misses
within a bounded time, no exception) and restarted (the store works again), settings
validation."""
from __future__ import annotations

import dataclasses
import logging
import threading
import time

import numpy as np
import pytest
import torch

from hicache.device_pool import DeviceKVPool
from hicache.host_pool import HostKVPool
from hicache.kv_spec import KVCacheSpec
from hicache.storage.base import StorageConfig, StorageStats
from hicache.storage.integrity import HEADER_BYTES, PageDigest
from hicache.storage.keys import page_hash_chain
from hicache.storage.mooncake_config import MooncakeSettings, parse_size

import storage_conformance as sc
from mooncake_server import MooncakeMaster, missing_reason

_MISSING = missing_reason()
needs_mooncake = pytest.mark.skipif(_MISSING is not None, reason=_MISSING or "")


@pytest.fixture(scope="module")
def master():
    if _MISSING is not None:
        pytest.skip(_MISSING)
    with MooncakeMaster() as m:
        yield m


@pytest.fixture(scope="module")
def shared_store(master):
    """One store (with the cluster's memory segment) for the tests that need one client:
    set-up and close cost about a second each."""
    st = make_store(master, model="shared")
    yield st
    st.close()


@pytest.fixture
def store(shared_store):
    """The shared store, emptied, with fresh counters."""
    shared_store.clear()
    shared_store.stats = StorageStats()
    shared_store._logged.clear()  # "logged once" is asserted per test
    return shared_store


def make_store(master, model="m", tp_rank=0, is_mla=False, **overrides):
    from hicache.storage.mooncake_store import MooncakeStorage
    cfg = StorageConfig(tp_rank=tp_rank, tp_size=2, is_mla=is_mla, model_name=model,
                        extra=master.extra_config(**overrides))
    return MooncakeStorage(cfg)


def host_pool(layout="page_first", page_size=4, pages=8):
    spec = KVCacheSpec("mha", 3, 2, 8, torch.bfloat16, page_size)
    dev = DeviceKVPool(spec, page_size * pages // 2, "cpu")
    return HostKVPool(dev, hicache_ratio=2.0, layout=layout, pin_memory=False)


def fill_pages(pool, pages, seed):
    g = torch.Generator().manual_seed(seed)
    for p in pages:
        t = pool.page_tensor(p)
        t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))


def keys_for(n, salt=0):
    return page_hash_chain(list(range(salt, salt + 4 * n)), 4)


@needs_mooncake
def test_single_and_batch_round_trip(store):
    st = store
    keys = keys_for(3, salt=100)
    vals = [torch.randn(37 + 11 * i).to(torch.bfloat16) for i in range(3)]
    assert st.set(keys[0], vals[0])
    assert torch.equal(st.get(keys[0]).view(torch.bfloat16), vals[0])
    assert st.batch_set(keys, vals) == [True] * 3
    assert st.stats.skipped_existing == 1  # keys[0] was already held
    got = st.batch_get(keys)
    assert all(torch.equal(g.view(torch.bfloat16), v) for g, v in zip(got, vals))
    targets = [torch.empty_like(v) for v in vals]
    out = st.batch_get(keys, targets)
    assert all(o is t and torch.equal(t, v) for o, t, v in zip(out, targets, vals))
    assert st.get(keys_for(1, salt=999)[0]) is None
    assert st.stats.corrupt == 0 and st.stats.faults == 0
    assert st.stats.bytes_read == 2 * sum(v.numel() * 2 for v in vals) + vals[0].numel() * 2


@needs_mooncake
@pytest.mark.parametrize("layout", ["page_first", "page_head"])
def test_pages_round_trip_exists_hole_and_only_new_writes(store, layout):
    st = store
    pool = host_pool(layout)
    st.register_host_pool(pool)
    keys = keys_for(4, salt=7)
    fill_pages(pool, [0, 1, 2, 3], seed=1)
    before = [pool.page_tensor(p).clone() for p in range(4)]
    # write pages 0, 1 and 3: key 2 is a hole in the middle of the prefix
    assert st.set_pages([keys[0], keys[1], keys[3]], [0, 1, 3]) == [True] * 3
    assert st.batch_exists(keys) == [True, True, False, True]
    assert st.stats.sets == 3
    # only new pages are written: the three held ones are skipped, page 2 is written
    assert st.set_pages(keys, [0, 1, 2, 3]) == [True] * 4
    assert st.stats.sets == 4 and st.stats.skipped_existing == 3
    assert st.stats.bytes_written == 4 * pool.page_tensor(0).numel() * 2
    # read into other host pages, zeroed
    for p in range(4, 8):
        pool.page_tensor(p).zero_()
    assert st.get_pages(keys + [keys_for(1, salt=555)[0]], [4, 5, 6, 7, 0]) == [True] * 4 + [False]
    for i in range(4):
        assert torch.equal(pool.page_tensor(4 + i), before[i])
    assert torch.equal(pool.page_tensor(0), before[0])  # the miss left its page alone
    assert st.stats.hits == 4 and st.stats.misses == 1 and st.stats.faults == 0


@needs_mooncake
def test_large_reads_go_in_bounded_chunks(store, monkeypatch):
    from hicache.storage import mooncake_store
    pool = host_pool(pages=16)
    page_bytes = pool.page_tensor(0).numel() * 2
    monkeypatch.setattr(mooncake_store, "STAGE_BYTES", 2 * page_bytes)  # two pages per call
    store.register_host_pool(pool)
    keys = keys_for(5, salt=77)
    fill_pages(pool, range(5), seed=3)
    assert store.set_pages(keys[:2] + keys[3:], [0, 1, 3, 4]) == [True] * 4
    assert store.get_pages(keys, range(8, 13)) == [True, True, False, True, True]
    assert all(torch.equal(pool.page_tensor(8 + i), pool.page_tensor(i)) for i in (0, 1, 3, 4))
    assert store.stats.hits == 4 and store.stats.misses == 1 and store.stats.faults == 0


@needs_mooncake
def test_keys_are_namespaced_and_rank_suffixed(master, store):
    # these clients contribute no memory: the shared store's segment holds the objects
    a0 = store
    a1 = make_store(master, model="shared", tp_rank=1, global_segment_size=0)
    b0 = make_store(master, model="ns-b", tp_rank=0, global_segment_size=0)
    mla0, mla1 = (make_store(master, model="ns-mla.v1/x", tp_rank=r, is_mla=True, global_segment_size=0)
                  for r in (0, 1))
    try:
        for s in (a1, b0, mla0):
            s.clear()
        k = keys_for(1, salt=42)[0]
        v = torch.arange(64, dtype=torch.uint8)
        assert a0.set(k, v)
        assert a0.object_key(k).endswith("_0") and a1.object_key(k).endswith("_1")
        assert not a1.exists(k) and not b0.exists(k)  # other rank, other model
        # MLA: rank 0 writes the shared page, rank 1 writes nothing (and says it is not
        # held) but reads it, and then reports it held
        assert not mla1.set(k, v + 1) and not mla1.exists(k)
        assert mla0.set(k, v + 2) and torch.equal(mla1.get(k), v + 2)
        assert mla1.set(k, v + 1) and torch.equal(mla1.get(k), v + 2)
        mla1.register_host_pool(host_pool())
        assert mla1.set_pages([k, keys_for(1, salt=43)[0]], [0, 1]) == [True, False]
        # clear removes this namespace (and for MHA this rank) only
        assert a1.set(k, v)
        a0.clear()
        assert not a0.exists(k) and a1.exists(k)
        mla1.clear()  # a model name with regex characters is taken literally
        assert not mla0.exists(k) and a1.exists(k)
    finally:
        for s in (a1, b0, mla0, mla1):
            s.close()


# -- the checks every backend passes (tests/storage_conformance.py) ---------------------------
@pytest.fixture
def conformance_factory(master, shared_store):
    """``sc.StorageFactory`` over the module's master: clients that contribute no memory
    (the shared store's segment holds their objects, so a second client of the same config
    reads what the first wrote), closed after the test."""
    from hicache.storage.mooncake_store import MooncakeStorage
    made = []

    def factory(config):
        st = MooncakeStorage(dataclasses.replace(config, extra=master.extra_config(global_segment_size=0)))
        made.append(st)
        return st

    yield factory
    for st in made:
        st.close()


# check_concurrent_use runs with exact_sets=False: Mooncake answers a put of a key another
# put has just stored with success (0), not OBJECT_ALREADY_EXISTS, and keeps the first
# object, so a client cannot tell its write from a lost race and threads racing on one key
# may each count it in stats.sets. The rest of the check (exact reads, every key held, no
# fault) holds as for every backend.
MOONCAKE_CHECKS = tuple(
    (lambda f, _c=c: _c(f, exact_sets=False)) if c is sc.check_concurrent_use else c for c in sc.BASIC_CHECKS)


@needs_mooncake
@pytest.mark.parametrize("check", MOONCAKE_CHECKS, ids=[c.__name__ for c in sc.BASIC_CHECKS])
def test_conformance(conformance_factory, check):
    check(conformance_factory)


@needs_mooncake
@pytest.mark.parametrize("layout, attention", [("page_first_direct", "mha"), ("page_head", "mha"),
                                               ("page_first", "mla")])
def test_conformance_page_round_trip_other_layouts(conformance_factory, layout, attention):
    sc.check_page_round_trip(conformance_factory, layout, attention)


def _flip_a_payload_byte(backend, key) -> None:
    """Replace ``key``'s object with one whose page has one byte flipped (digest kept)."""
    store, name = backend._client.store, backend.object_key(key)
    obj = np.frombuffer(store.get(name), np.uint8).copy()
    obj[0] ^= 0x10
    assert store.remove(name, True) == 0 and store.put(name, obj.tobytes()) == 0


def _cut_short(backend, key) -> None:
    """Replace ``key``'s object with one 16 bytes shorter (its page's end missing)."""
    store, name = backend._client.store, backend.object_key(key)
    obj = np.frombuffer(store.get(name), np.uint8)
    assert store.remove(name, True) == 0 and store.put(name, obj[16:].tobytes()) == 0


@needs_mooncake
@pytest.mark.parametrize("damage", [_flip_a_payload_byte, _cut_short], ids=["flipped", "short"])
def test_conformance_corrupt_object_is_miss(conformance_factory, damage):
    sc.check_corrupt_object_is_miss(conformance_factory, damage)


@needs_mooncake
def test_conformance_fault_is_miss():
    """The check's broken backend: its master killed (a master of its own)."""
    from hicache.storage.mooncake_store import MooncakeStorage
    with MooncakeMaster() as m:
        made = []

        def factory(config):
            st = MooncakeStorage(dataclasses.replace(config, extra=m.extra_config(op_timeout_s=1.0)))
            made.append(st)
            return st

        try:
            sc.check_fault_is_miss(factory, lambda backend: m.kill())
        finally:
            for st in made:
                st.close()


@needs_mooncake
def test_page_being_written_by_another_client_is_a_miss_not_a_fault(master, store):
    """While a put is under way the store answers REPLICA_IS_NOT_READY for the object: a
    reader sees a plain miss (not a fault, no warning), then the page once it is stored."""
    from hicache.storage.mooncake_store import REPLICA_IS_NOT_READY
    writer = make_store(master, model="shared", global_segment_size=0)
    raw = store._client.store
    try:
        for trial in range(20):  # until a read lands inside the put (most trials do)
            store.clear()
            key = keys_for(1, salt=4000 + trial)[0]
            value = sc.random_page(trial, 16 << 20)
            codes = []
            t = threading.Thread(target=lambda: writer.set(key, value))
            t.start()
            while t.is_alive():
                codes.append(raw.get_size(store.object_key(key)))
                got = store.get(key)
                assert got is None or torch.equal(got, value)
            t.join()
            if REPLICA_IS_NOT_READY in codes:
                break
        else:
            pytest.skip("no read landed inside a put in 20 tries")
        assert store.stats.faults == 0 and store.stats.corrupt == 0, store.stats
        assert torch.equal(store.get(key), value)
    finally:
        writer.close()
        store.clear()


def _put_raw(st, key, payload: np.ndarray, digest: bytes) -> None:
    """Write an object as the backend lays it out (payload, then digest) straight to the store."""
    obj = np.concatenate([payload, np.frombuffer(digest, np.uint8)])
    assert st._client.store.put(st.object_key(key), obj.tobytes()) == 0


@needs_mooncake
def test_corrupt_and_wrong_length_objects_are_misses(store, caplog):
    st = store
    pool = host_pool()
    st.register_host_pool(pool)
    keys = keys_for(3, salt=300)
    nbytes = pool.page_tensor(0).numel() * 2
    good = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    bad = good.copy()
    bad[nbytes // 2] ^= 0x40
    _put_raw(st, keys[0], bad, PageDigest.of(good).to_bytes())  # payload flipped
    _put_raw(st, keys[1], good[:-16], PageDigest.of(good[:-16]).to_bytes())  # short
    _put_raw(st, keys[2], good, PageDigest.of(good).to_bytes())  # intact
    pool.page_tensor(1).fill_(3)
    marker = pool.page_tensor(1).clone()
    with caplog.at_level(logging.WARNING, logger="hicache.storage.mooncake_store"):
        assert st.get_pages(keys, [1, 2, 3]) == [False, False, True]
        assert st.get_pages(keys[:1], [1]) == [False]  # removed: now a plain miss
    assert torch.equal(pool.page_tensor(1), marker)  # a corrupt page never lands in the pool
    assert np.array_equal(pool.page_tensor(3).view(torch.uint8).view(-1).numpy(), good)
    assert st.stats.corrupt == 2 and st.stats.faults == 2
    assert sum("corrupt page object" in r.getMessage() for r in caplog.records) == 1  # logged once
    # the bad objects were removed, so the pages can be written again
    assert st.batch_exists(keys) == [False, False, True]
    fill_pages(pool, [1, 2], seed=5)
    assert st.set_pages(keys[:2], [1, 2]) == [True, True]
    assert st.get_pages(keys[:2], [4, 5]) == [True, True]
    assert torch.equal(pool.page_tensor(4), pool.page_tensor(1))
    # a digest that is not one at all
    _put_raw(st, "junk", good[:100], b"\0" * HEADER_BYTES)
    assert st.get("junk", torch.empty(100, dtype=torch.uint8)) is None and st.stats.corrupt == 3


@needs_mooncake
def test_master_hung_then_killed_mid_run_then_restarted():
    if _MISSING is not None:
        pytest.skip(_MISSING)
    timeout = 1.5
    with MooncakeMaster() as m:
        st = make_store(m, model="fault", op_timeout_s=timeout, retry_interval_s=0.5)
        pool = host_pool()
        try:
            st.register_host_pool(pool)
            keys = keys_for(4, salt=900)
            fill_pages(pool, range(4), seed=9)
            assert st.set_pages(keys[:2], [0, 1]) == [True, True]
            # a hung master: the read is abandoned at the deadline, the host pages stay as they were
            for p in (4, 5):
                pool.page_tensor(p).zero_()
            m.pause()
            t = time.monotonic()
            assert st.get_pages(keys[:2], [4, 5]) == [False, False]
            assert time.monotonic() - t < timeout + 0.5
            assert not st.available  # the abandoned call still runs: calls are misses at once
            t = time.monotonic()
            assert st.batch_exists(keys) == [False] * 4 and time.monotonic() - t < 0.1
            m.resume()
            time.sleep(0.3)  # the late read lands in its own staging buffer
            assert all(pool.page_tensor(p).abs().sum() == 0 for p in (4, 5))
            deadline = time.monotonic() + 10
            while st.get_pages(keys[:2], [4, 5]) != [True, True]:
                assert time.monotonic() < deadline, f"store did not recover after the master resumed: {st.stats}"
                time.sleep(0.1)
            assert torch.equal(pool.page_tensor(4), pool.page_tensor(0))
            hits = st.stats.hits
            m.kill()
            t0 = time.monotonic()
            worst = 0.0
            for _ in range(5):  # every form: misses, no exception, each bounded by the deadline
                for op in (lambda: st.batch_exists(keys), lambda: st.get_pages(keys[:2], [4, 5]),
                           lambda: st.set_pages(keys[2:], [2, 3]), lambda: st.batch_get(keys[:1]),
                           st.clear):
                    t = time.monotonic()
                    r = op()
                    worst = max(worst, time.monotonic() - t)
                    assert r is None or not any(x for x in r)
            assert worst < timeout + 0.5
            assert time.monotonic() - t0 < 3 * timeout + 1  # a dead master costs a deadline, not one per call
            assert st.stats.faults > 0 and st.stats.hits == hits
            m.start()
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline:  # the client reconnects by itself
                if st.set_pages(keys[2:], [2, 3]) == [True, True]:
                    break
                time.sleep(0.2)
            else:
                pytest.fail(f"store did not recover after the master restarted: {st.stats}")
            # the restarted master has no objects; what is written now reads back
            assert st.batch_exists(keys) == [False, False, True, True]
            assert st.get_pages(keys[2:], [6, 7]) == [True, True]
            assert torch.equal(pool.page_tensor(6), pool.page_tensor(2))
        finally:
            st.close()


@needs_mooncake
def test_connect_fails_clearly_without_master(master):
    from hicache.storage.mooncake_store import MooncakeStorage
    from mooncake_server import free_port
    extra = {"master_server_address": f"127.0.0.1:{free_port()}",
             "metadata_server": f"http://127.0.0.1:{free_port()}/metadata",
             "global_segment_size": 0, "connect_timeout_s": 0.5, "local_hostname": "127.0.0.1"}
    t = time.monotonic()
    with pytest.raises(ConnectionError, match="cannot reach the master"):
        MooncakeStorage(StorageConfig(extra=extra))
    assert time.monotonic() - t < 2.0
    # a master without the metadata server it was told about
    extra = master.extra_config(metadata_server=f"http://127.0.0.1:{free_port()}/metadata")
    with pytest.raises(ConnectionError, match="cannot reach the metadata server"):
        MooncakeStorage(StorageConfig(extra=extra))


def test_settings_validation_and_env_fallback():
    env = {"MOONCAKE_MASTER": "10.0.0.1:50051", "MOONCAKE_GLOBAL_SEGMENT_SIZE": "2gb",
           "MOONCAKE_PROTOCOL": "tcp"}
    s = MooncakeSettings.from_extra({}, env=env)
    assert s.master_server_address == "10.0.0.1:50051"
    assert s.metadata_server == "http://10.0.0.1:8080/metadata"
    assert s.global_segment_size == 2 << 30 and s.local_buffer_size == 16 << 20
    s = MooncakeSettings.from_extra({"master_server_address": "h:1", "global_segment_size": 1024,
                                     "op_timeout_s": 0.25}, env=env)
    assert s.master_server_address == "h:1" and s.global_segment_size == 1024 and s.op_timeout_s == 0.25
    assert parse_size("512 MiB", "x") == 512 << 20 and parse_size("1.5kb", "x") == 1536
    with pytest.raises(ValueError, match="master_server_address"):
        MooncakeSettings.from_extra({}, env={})
    with pytest.raises(ValueError, match="protocol must be one of"):
        MooncakeSettings.from_extra({"master_server_address": "h:1", "protocol": "udp"}, env={})
    with pytest.raises(ValueError, match="device_name"):
        MooncakeSettings.from_extra({"master_server_address": "h:1", "protocol": "rdma"}, env={})
    with pytest.raises(ValueError, match="global_segment_size"):
        MooncakeSettings.from_extra({"master_server_address": "h:1", "global_segment_size": "4 parsecs"}, env={})
    with pytest.raises(ValueError, match="op_timeout_s"):
        MooncakeSettings.from_extra({"master_server_address": "h:1", "op_timeout_s": 0}, env={})


@needs_mooncake
def test_bad_input_is_a_clear_error(store):
    st = store
    st.host_pool = None
    with pytest.raises(RuntimeError, match="register_host_pool"):
        st.get_pages(["a"], [0])
    with pytest.raises(ValueError, match="layer_first"):
        st.register_host_pool(host_pool("layer_first"))
    st.register_host_pool(host_pool())
    with pytest.raises(ValueError, match="host_pages entries"):
        st.set_pages(["a"], [99])
    with pytest.raises(ValueError, match="keys must be non-empty strings"):
        st.batch_exists(["a", 3])
    with pytest.raises(ValueError, match="contiguous CPU tensors"):
        st.set("a", torch.zeros(4, 4).t())
    assert st.batch_exists([]) == [] and st.batch_get([]) == [] and st.batch_set([], []) == []


def test_hicache_imports_without_mooncake():
    """hicache and its storage interface import without the Mooncake client."""
    import subprocess
    import sys
    code = ("import sys, hicache, hicache.storage.base, hicache.storage.mooncake_config; "
            "import hicache.storage.mooncake_store; assert 'mooncake' not in sys.modules, sorted(sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True)
