"""The ``lmcache`` L3 backend against a real LMCache engine: its local CPU tier, its local
disk tier, and its remote tier on LMCache's own server (``python -m lmcache.v1.server``)
on 127.0.0.1, alone and all three together. Every check of ``storage_conformance`` runs
on each (``clear`` only where no remote tier keeps copies); then corrupt and short objects
in memory, on disk and on the server; the server killed, restarted and hung; the disk
directory gone; settings; and two ``sparsehi run`` processes, the second prefetching through
the StorageController what the first wrote to the server.

Where LMCache does not import, every test that needs it is skipped with the import error
as the reason; the settings, key and registry tests that need no LMCache run everywhere.
"""
from __future__ import annotations

import dataclasses
import os
import shutil
import sys
import time

os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")  # read when LMCache is imported

import pytest
import torch

from hicache.storage.base import StorageConfig
from hicache.storage.keys import page_hash_chain, storage_key
from hicache.storage.lmcache_config import LMCacheSettings

import storage_conformance as sc
from lmcache_server import LMCacheServer, RawClient, lmcache_server, missing_reason  # noqa: F401 (fixture)

_MISSING = missing_reason()
needs_lmcache = pytest.mark.skipif(_MISSING is not None, reason=_MISSING or "")
SMALL_CPU = {"max_local_cpu_size": 0.05}  # GB: LMCache's default is 5


@pytest.fixture(scope="module")
def server(lmcache_server):
    return lmcache_server


def tier_extra(tiers: str, tmp_path, server=None, **more) -> dict:
    """Extra config for LMCache tiers ``tiers``: "cpu", "disk", "remote" or "all"."""
    extra = dict(SMALL_CPU, local_cpu=tiers in ("cpu", "all"))
    if tiers in ("disk", "all"):
        extra.update(local_disk=str(tmp_path / "lmcache-disk") + "/", max_local_disk_size=0.05)
    if tiers in ("remote", "all"):
        extra.update(remote_url=server.url)
    extra.update(more)
    return extra


class Factory:
    """``sc.StorageFactory`` over one LMCache configuration; closes what it built."""

    def __init__(self, extra: dict) -> None:
        self.extra = extra
        self.made = []

    def __call__(self, config: StorageConfig):
        from hicache.storage.lmcache_store import LMCacheStorage

        st = LMCacheStorage(dataclasses.replace(config, extra=self.extra))
        self.made.append(st)
        return st

    def close(self) -> None:
        for st in self.made:
            st.close()


TIERS = ["cpu", "disk", "remote", "all"]


@pytest.fixture(params=TIERS)
def factory(request, tmp_path):
    if _MISSING is not None:
        pytest.skip(_MISSING)
    srv = request.getfixturevalue("server") if request.param in ("remote", "all") else None
    f = Factory(tier_extra(request.param, tmp_path, srv))
    f.tiers = request.param
    yield f
    f.close()


# -- the checks every backend passes ---------------------------------------------------------
@needs_lmcache
@pytest.mark.parametrize("check", sc.BASIC_CHECKS, ids=[c.__name__ for c in sc.BASIC_CHECKS])
def test_conformance(factory, check):
    if check is sc.check_clear and factory.tiers in ("remote", "all"):
        pytest.skip("LMCache's server has no delete command: clear keeps remote copies "
                    "(test_clear_keeps_remote_copies)")
    check(factory)


@needs_lmcache
@pytest.mark.parametrize("layout, attention", [("page_first_direct", "mha"), ("page_head", "mha"),
                                               ("page_first", "mla")])
def test_conformance_page_round_trip_other_layouts(factory, layout, attention):
    sc.check_page_round_trip(factory, layout, attention)


@needs_lmcache
def test_clear_keeps_remote_copies(server, tmp_path):
    f = Factory(tier_extra("all", tmp_path, server))
    try:
        s = f(sc.fresh_config())
        keys = sc.page_keys(2, seed=21)
        assert s.batch_set(keys, [sc.random_page(1), sc.random_page(2)]) == [True, True]
        s.clear()
        manager = s.engine.manager
        cks = [s.chunk_key(k) for k in keys]
        for tier in ("LocalCPUBackend", "LocalDiskBackend"):
            assert [manager.contains(k, search_range=[tier]) for k in cks] == [None, None]
        assert s.batch_exists(keys) == [True, True]  # the server's copies
        assert torch.equal(s.get(keys[1]), sc.random_page(2))
    finally:
        f.close()


# -- corrupt and short objects ------------------------------------------------------------------
def _flip(data: bytes) -> bytes:
    out = bytearray(data)
    out[-7] ^= 0x10  # a page byte; the digest and tag are in front
    return bytes(out)


def _cut(data: bytes) -> bytes:
    return data[:-16]


def _zero_tail(data: bytes) -> bytes:
    """What a torn write leaves: the end of the object zeroed."""
    return data[:-16] + bytes(16)


def _damage_in_memory(edit):
    """Replace the chunk in LMCache's local CPU tier with ``edit(its bytes)``."""
    def damage(backend, key):
        from lmcache.v1.memory_management import MemoryFormat

        manager, ck = backend.engine.manager, backend.chunk_key(key)
        obj = manager.get(ck, location="LocalCPUBackend")
        data = edit(obj.tensor.reshape(-1).numpy().tobytes())
        obj.ref_count_down()
        manager.remove(ck, locations=["LocalCPUBackend"])
        new = manager.allocate(torch.Size([1, 1, 1, len(data)]), torch.uint8, fmt=MemoryFormat.KV_2LTD)
        new.tensor.view(-1).copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        manager.batched_put([ck], [new], location="LocalCPUBackend")
    return damage


def _damage_on_disk(edit):
    """Rewrite the chunk's file in LMCache's disk directory with ``edit(its bytes)``."""
    def damage(backend, key):
        path = backend.engine.manager.storage_backends["LocalDiskBackend"].dict[backend.chunk_key(key)].path
        with open(path, "rb") as f:
            data = f.read()
        with open(path, "wb") as f:
            f.write(edit(data))
    return damage


def _damage_on_server(server, edit):
    """Replace the object LMCache's server holds with ``edit(its bytes)``."""
    def damage(backend, key):
        client = RawClient(server.port)
        try:
            ck = backend.chunk_key(key)
            data, meta = client.get(ck)
            client.put(ck, edit(data), meta)
            assert client.get(ck)[0] == edit(data)
        finally:
            client.close()
    return damage


# A file cut short is not among the disk tier's damages: LMCache reads a disk file into a
# buffer of the size it recorded without checking how much it read, so the buffer's old
# contents stand in for the missing end (test_truncated_disk_file_never_gives_wrong_bytes).
DAMAGES = [("memory", _flip), ("memory", _cut), ("disk", _flip), ("disk", _zero_tail), ("server", _flip),
           ("server", _cut)]


@needs_lmcache
@pytest.mark.parametrize("where, edit", DAMAGES, ids=[f"{w}-{e.__name__.strip('_')}" for w, e in DAMAGES])
def test_conformance_corrupt_object_is_miss(request, tmp_path, where, edit):
    if where == "memory":
        f, damage = Factory(tier_extra("cpu", tmp_path)), _damage_in_memory(edit)
    elif where == "disk":
        f, damage = Factory(tier_extra("disk", tmp_path)), _damage_on_disk(edit)
    else:
        server = request.getfixturevalue("server")
        f, damage = Factory(tier_extra("remote", tmp_path, server)), _damage_on_server(server, edit)
    try:
        sc.check_corrupt_object_is_miss(f, damage)
    finally:
        f.close()


@needs_lmcache
def test_disk_file_cut_short_or_removed_never_gives_wrong_bytes(tmp_path):
    """LMCache reads a disk file cut short into a buffer of the recorded size, without a
    length check: what was in the buffer before stands in for the end. Each such read is a
    miss (corrupt) or the exact page, never other bytes; a removed file is a fault."""
    f = Factory(tier_extra("disk", tmp_path))
    try:
        s = f(sc.fresh_config())
        keys = sc.page_keys(6, seed=81)
        pages = [sc.random_page(81 + i) for i in range(6)]
        assert s.batch_set(keys, pages) == [True] * 6
        disk = s.engine.manager.storage_backends["LocalDiskBackend"]
        for k, cut in zip(keys[:3], (lambda d: b"", lambda d: d[:len(d) // 3], _cut)):
            _damage_on_disk(cut)(s, k)
        for k in keys[3:]:
            os.remove(disk.dict[s.chunk_key(k)].path)
        got = s.batch_get(keys)
        assert all(g is None or torch.equal(g, p) for g, p in zip(got, pages))
        assert got[3:] == [None] * 3 and s.stats.faults == 3 + s.stats.corrupt
        assert s.stats.corrupt == sum(g is None for g in got[:3]) and s.stats.hits == 3 - s.stats.corrupt
    finally:
        f.close()


@needs_lmcache
def test_a_corrupt_remote_copy_is_written_again(server, tmp_path):
    f = Factory(tier_extra("remote", tmp_path, server))
    try:
        s = f(sc.fresh_config())
        key = sc.page_keys(1, seed=31)[0]
        assert s.set(key, sc.random_page(31))
        _damage_on_server(server, _flip)(s, key)
        assert s.get(key) is None and s.stats.corrupt == 1
        assert s.exists(key)  # the server still holds its bad copy: LMCache cannot delete it
        assert s.set(key, sc.random_page(31)) and s.stats.sets == 2  # written again, not skipped
        assert torch.equal(s.get(key), sc.random_page(31))
    finally:
        f.close()


@needs_lmcache
def test_another_keys_object_is_a_miss(tmp_path):
    """An intact object under the wrong key (what a reused read buffer can hold) is corrupt."""
    f = Factory(tier_extra("cpu", tmp_path))
    try:
        s = f(sc.fresh_config())
        a, b = sc.page_keys(2, seed=41)
        assert s.batch_set([a, b], [sc.random_page(41), sc.random_page(42)]) == [True, True]
        obj = s.engine.manager.get(s.chunk_key(a), location="LocalCPUBackend")
        a_object = obj.tensor.reshape(-1).numpy().tobytes()
        obj.ref_count_down()
        _damage_in_memory(lambda _: a_object)(s, b)  # a's intact object under b's key
        assert s.get(b) is None and s.stats.corrupt == 1
        assert torch.equal(s.get(a), sc.random_page(41))
    finally:
        f.close()


# -- faults -----------------------------------------------------------------------------------
@needs_lmcache
def test_conformance_fault_is_miss_server_killed(tmp_path):
    with LMCacheServer() as srv:
        f = Factory(tier_extra("remote", tmp_path, srv, op_timeout_s=2.0, retry_interval_s=0.2))
        try:
            sc.check_fault_is_miss(f, lambda backend: srv.kill())
        finally:
            f.close()


def _file_where_the_disk_directory_was(path):
    def brk(backend):
        shutil.rmtree(path)
        path.write_bytes(b"")  # opening a page file in it now fails (NotADirectoryError)
    return brk


@needs_lmcache
def test_conformance_fault_is_miss_disk_unusable(tmp_path):
    f = Factory(tier_extra("disk", tmp_path, op_timeout_s=1.0))
    try:
        sc.check_fault_is_miss(f, _file_where_the_disk_directory_was(tmp_path / "lmcache-disk"))
    finally:
        f.close()


@needs_lmcache
def test_a_failed_disk_write_costs_one_deadline(tmp_path):
    """LMCache keeps a disk write that failed in flight for good: the first write of that key
    waits half a deadline and is a fault, later ones are faults at once."""
    f = Factory(tier_extra("disk", tmp_path, op_timeout_s=1.0))
    try:
        s = f(sc.fresh_config())
        key = sc.page_keys(1, seed=91)[0]
        _file_where_the_disk_directory_was(tmp_path / "lmcache-disk")(s)
        t = time.monotonic()
        assert s.set(key, sc.random_page(91)) is False
        assert 0.5 <= time.monotonic() - t < 1.0 and s.stats.faults == 1
        t = time.monotonic()
        assert s.set(key, sc.random_page(91)) is False
        assert time.monotonic() - t < 0.5 and s.stats.faults == 2
        assert s.get(key) is None and not s.exists(key)
    finally:
        f.close()


@needs_lmcache
def test_server_killed_then_restarted(tmp_path):
    with LMCacheServer() as srv:
        f = Factory(tier_extra("remote", tmp_path, srv, op_timeout_s=2.0, retry_interval_s=0.2))
        try:
            s = f(sc.fresh_config())
            keys = sc.page_keys(3, seed=51)
            pages = [sc.random_page(51 + i) for i in range(3)]
            assert s.batch_set(keys[:1], pages[:1]) == [True]
            srv.kill()
            t = time.monotonic()
            for _ in range(3):
                assert s.batch_exists(keys) == [False] * 3
                assert s.batch_set(keys[1:2], pages[1:2]) == [False]
                assert s.batch_get(keys) == [None] * 3
            assert time.monotonic() - t < 2.0 and s.stats.faults >= 1  # bypassed: misses at once
            srv.start()
            deadline = time.monotonic() + 10
            while s.batch_set(keys[1:2], pages[1:2]) != [True]:
                assert time.monotonic() < deadline, f"no reconnect: {s.stats}"
                time.sleep(0.1)
            # the restarted server lost what it held; what is written now reads back
            assert s.batch_exists(keys) == [False, True, False]
            assert torch.equal(s.get(keys[1]), pages[1])
        finally:
            f.close()


@needs_lmcache
def test_hung_server_costs_one_deadline_then_recovers(tmp_path):
    timeout = 1.0
    with LMCacheServer() as srv:
        f = Factory(tier_extra("remote", tmp_path, srv, op_timeout_s=timeout, retry_interval_s=0.3))
        try:
            s = f(sc.fresh_config())
            keys = sc.page_keys(2, seed=61)
            assert s.set(keys[0], sc.random_page(61))
            srv.pause()
            t = time.monotonic()
            assert s.batch_exists(keys) == [False, False]
            assert time.monotonic() - t < timeout + 0.5
            t = time.monotonic()
            assert s.get(keys[0]) is None and s.batch_exists(keys) == [False, False]
            assert time.monotonic() - t < 0.5  # the remote tier is bypassed meanwhile
            assert s.stats.faults >= 1
            srv.resume()
            deadline = time.monotonic() + 10
            while s.get(keys[0]) is None:
                assert time.monotonic() < deadline, f"no recovery after the server resumed: {s.stats}"
                time.sleep(0.1)
            assert torch.equal(s.get(keys[0]), sc.random_page(61))
        finally:
            f.close()


# -- keys, engine sharing, settings -----------------------------------------------------------
@needs_lmcache
def test_keys_map_onto_lmcache_chunk_keys(tmp_path):
    from lmcache.v1.protocol import MAX_KEY_LENGTH

    f = Factory(tier_extra("cpu", tmp_path))
    try:
        h = page_hash_chain(list(range(8)), 4)[1]
        mha = f(StorageConfig(tp_rank=3, tp_size=4, model_name="llama-3-8b"))
        k = mha.chunk_key(storage_key(h, 3))
        assert (k.model_name, k.world_size, k.worker_id, k.chunk_hash, k.dtype) == (
            "sparsehi/llama-3-8b", 4, 3, int(h, 16), torch.uint8)
        assert k.chunk_hash_hex == h.lstrip("0")
        mla = f(StorageConfig(tp_rank=1, tp_size=4, is_mla=True, model_name="dsv3"))
        assert mla.chunk_key(storage_key(h, 1, is_mla=True)).worker_id == 0
        long_name = f(StorageConfig(tp_rank=123456, tp_size=999999, model_name="m@" + "x" * 300))
        k = long_name.chunk_key(storage_key(h, 123456))
        assert k.model_name.startswith("sparsehi/h-") and len(k.to_string()) <= MAX_KEY_LENGTH
        for bad in ("", "G" * 64, "ab/../cd", h + "_x", "a" * 65, 5):
            with pytest.raises(ValueError, match="keys must be page keys"):
                mha.batch_exists([bad])
    finally:
        f.close()


@needs_lmcache
def test_one_engine_per_configuration_closed_with_its_last_user(tmp_path):
    f = Factory(tier_extra("cpu", tmp_path))
    a = f(sc.fresh_config(model_name="shared"))
    b = f(sc.fresh_config(model_name="shared"))
    other = Factory(tier_extra("cpu", tmp_path, max_local_cpu_size=0.04))(sc.fresh_config(model_name="shared"))
    try:
        assert a.engine is b.engine and other.engine is not a.engine
        key = sc.page_keys(1, seed=71)[0]
        assert a.set(key, sc.random_page(71)) and torch.equal(b.get(key), sc.random_page(71))
        assert not other.exists(key)  # another LMCache configuration is another engine
        a.close()
        assert torch.equal(b.get(key), sc.random_page(71))  # still in use by b
        b.close()
        assert a.get(key) is None and a.stats.faults == 1  # a closed backend only misses
        again = f(sc.fresh_config(model_name="shared"))
        assert again.engine is not a.engine and not again.exists(key)  # LMCache's CPU tier went with it
    finally:
        other.close()
        f.close()


def test_settings_parse_without_building():
    s = LMCacheSettings.from_extra({"local_cpu": True, "max_local_cpu_size": 2, "op_timeout_s": 0.5,
                                    "prefetch_threshold": 64}, env={})
    assert s.overrides == {"local_cpu": True, "max_local_cpu_size": 2} and s.op_timeout_s == 0.5
    assert s.config_file is None and s.retry_interval_s == 2.0
    with pytest.raises(ValueError, match="op_timeout_s must be a number of seconds > 0"):
        LMCacheSettings.from_extra({"op_timeout_s": 0}, env={})
    with pytest.raises(ValueError, match="retry_interval_s"):
        LMCacheSettings.from_extra({"retry_interval_s": "soon"}, env={})
    with pytest.raises(ValueError, match="lmcache_config_file='/no/such.yaml' is not a readable file"):
        LMCacheSettings.from_extra({}, env={"LMCACHE_CONFIG_FILE": "/no/such.yaml"})
    with pytest.raises(ValueError, match="enable_pd=True is not supported by the lmcache L3 backend"):
        LMCacheSettings.from_extra({"enable_pd": True}, env={})


@needs_lmcache
def test_settings_reach_lmcache_through_its_loader(tmp_path, monkeypatch):
    yaml_file = tmp_path / "lmcache.yaml"
    yaml_file.write_text("chunk_size: 64\nmax_local_cpu_size: 0.03\nlocal_cpu: false\n")
    monkeypatch.setenv("LMCACHE_CHUNK_SIZE", "32")  # LMCache's environment overrides its file
    config = LMCacheSettings.from_extra({"lmcache_config_file": str(yaml_file), "local_cpu": True},
                                        env={}).engine_config()
    assert (config.chunk_size, config.max_local_cpu_size, config.local_cpu) == (32, 0.03, True)
    with pytest.raises(ValueError, match=r"\['local_cpus'\] are not LMCache engine settings"):
        LMCacheSettings.from_extra({"local_cpus": True}).engine_config()
    with pytest.raises(ValueError, match="max_local_cpu_size='lots' cannot be converted"):
        LMCacheSettings.from_extra({"max_local_cpu_size": "lots"}).engine_config()
    with pytest.raises(ValueError, match="max_local_cpu_size must be > 0"):
        LMCacheSettings.from_extra({"max_local_cpu_size": 0}).engine_config()
    with pytest.raises(ValueError, match="local_disk='/tmp/x/' needs max_local_disk_size > 0"):
        LMCacheSettings.from_extra({"local_disk": "/tmp/x/"}).engine_config()
    monkeypatch.setenv("LMCACHE_USE_LAYERWISE", "true")
    with pytest.raises(ValueError, match=r"use_layerwise=True \(from LMCACHE_USE_LAYERWISE\) is not supported"):
        LMCacheSettings.from_extra({}).engine_config()


@needs_lmcache
def test_bad_input_is_a_clear_error(tmp_path):
    f = Factory(tier_extra("cpu", tmp_path))
    try:
        s = f(sc.fresh_config())
        with pytest.raises(RuntimeError, match="register_host_pool"):
            s.get_pages(sc.page_keys(1), [0])
        with pytest.raises(ValueError, match="layer_first"):
            s.register_host_pool(sc.make_host_pool("layer_first"))
        s.register_host_pool(sc.make_host_pool())
        with pytest.raises(ValueError, match="host_pages entries"):
            s.set_pages(sc.page_keys(1), [99])
        with pytest.raises(ValueError, match="contiguous CPU tensors"):
            s.set(sc.page_keys(1)[0], torch.zeros(4, 4).t())
        with pytest.raises(ValueError, match="keys and values must have the same length"):
            s.batch_set(sc.page_keys(2), [sc.random_page(0)])
        assert s.batch_exists([]) == [] and s.batch_get([]) == [] and s.batch_set([], []) == []
    finally:
        f.close()


def test_without_lmcache_the_backend_is_a_clear_error(monkeypatch):
    from hicache.storage.registry import create_storage_backend

    monkeypatch.setitem(sys.modules, "lmcache", None)  # makes "import lmcache..." fail
    with pytest.raises(ImportError) as e:
        create_storage_backend("lmcache", StorageConfig())
    assert "--hicache-storage-backend=lmcache needs the lmcache package" in str(e.value)
    assert "pip install --no-deps" in str(e.value)


def test_hicache_imports_without_lmcache():
    """The backend's modules import without LMCache (it is imported when one is built)."""
    import subprocess

    code = ("import sys, hicache.storage.lmcache_store, hicache.storage.lmcache_engine, "
            "hicache.storage.lmcache_config, hicache.storage.registry; "
            "assert not any(m == 'lmcache' or m.startswith('lmcache.') for m in sys.modules), sorted(sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True)


# -- the StorageController's prefetch across processes ----------------------------------------
@needs_lmcache
def test_warm_restart_in_a_new_process_through_the_server(tmp_path):
    """Two ``sparsehi run`` processes over one LMCache server: the first writes the prompt's
    pages, the second prefetches them (StorageController) and generates the same tokens."""
    from test_l3_restart_processes import PROMPT_PAGES, _assert_warm, sparsehi_run

    with LMCacheServer() as srv:
        extra = {"local_cpu": False, "max_local_cpu_size": 0.05, "remote_url": srv.url}
        first = sparsehi_run(tmp_path / "first", "lmcache", extra)
        second = sparsehi_run(tmp_path / "second", "lmcache", extra)
    assert first.row["l3_pages_fetched"] == 0 and first.row["l3_pages_written"] == PROMPT_PAGES, first.row
    assert first.storage["faults"] == 0 and first.storage["sets"] == PROMPT_PAGES, first.storage
    _assert_warm(second, first.tokens)
