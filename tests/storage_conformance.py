"""Checks every L3 backend must pass, shared by the backends' test files.

Each ``check_*`` function takes ``factory(config: StorageConfig) -> HiCacheStorage``. Two
calls whose configs have the same ``model_name`` must reach the same stored objects (two
ranks, or a restart); each check picks a fresh model name, so checks never see each other's
pages. ``BASIC_CHECKS`` lists the checks that need nothing but the factory; the corruption
and fault checks also take a callback that damages a stored object or breaks the backend,
which only the backend's own tests know how to do.
"""
from __future__ import annotations

import threading
import uuid
from typing import Callable, Optional

import torch

from hicache.device_pool import DeviceKVPool
from hicache.host_pool import HostKVPool
from hicache.kv_spec import KVCacheSpec
from hicache.storage.base import HiCacheStorage, StorageConfig
from hicache.storage.keys import page_hash_chain, storage_key

StorageFactory = Callable[[StorageConfig], HiCacheStorage]
PAGE_BYTES = 4096


def fresh_config(tp_rank: int = 0, tp_size: int = 1, is_mla: bool = False,
                 model_name: Optional[str] = None) -> StorageConfig:
    """A config in a namespace no other check uses (unless ``model_name`` is given)."""
    return StorageConfig(tp_rank=tp_rank, tp_size=tp_size, is_mla=is_mla,
                         model_name=model_name or f"conformance-{uuid.uuid4().hex[:12]}")


def page_keys(n: int, tp_rank: int = 0, is_mla: bool = False, seed: int = 0, page_size: int = 4) -> list[str]:
    """Storage keys of ``n`` chained pages of a random token sequence."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 50_000, (n * page_size,), generator=g).tolist()
    return [storage_key(h, tp_rank, is_mla) for h in page_hash_chain(tokens, page_size)]


def random_page(seed: int, nbytes: int = PAGE_BYTES) -> torch.Tensor:
    """``uint8 [nbytes]`` of random bytes."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)


def make_host_pool(layout: str = "page_first", attention: str = "mha", page_size: int = 4,
                   seed: Optional[int] = 0) -> HostKVPool:
    """A small CPU host pool in a page layout; filled with random bf16 values when ``seed``
    is given, zeros otherwise."""
    if attention == "mha":
        spec = KVCacheSpec("mha", 3, 2, 8, torch.bfloat16, page_size)
    else:
        spec = KVCacheSpec("mla", 2, 1, 24, torch.bfloat16, page_size, kv_lora_rank=16)
    pool = HostKVPool(DeviceKVPool(spec, 8 * page_size, "cpu"), hicache_ratio=2.0, layout=layout, pin_memory=False)
    if seed is not None:
        g = torch.Generator().manual_seed(seed)
        pool.kv_data.copy_(torch.randn(pool.kv_data.shape, generator=g).to(pool.kv_data.dtype))
    return pool


def page_bytes(pool: HostKVPool, page: int) -> torch.Tensor:
    return pool.page_tensor(page).view(torch.uint8).reshape(-1).clone()


# -- checks that need only the factory -------------------------------------------------------
def check_single_round_trip(factory: StorageFactory) -> None:
    s = factory(fresh_config())
    key = page_keys(1)[0]
    assert s.get(key) is None and not s.exists(key)
    value = random_page(1)
    assert s.set(key, value) is True
    assert s.exists(key)
    got = s.get(key)
    assert got is not None and torch.equal(got.view(torch.uint8).reshape(-1), value)
    target = torch.zeros(PAGE_BYTES // 2, dtype=torch.bfloat16)  # any dtype of the right byte size
    assert s.get(key, target) is target and torch.equal(target.view(torch.uint8), value)
    assert s.stats.hits == 2 and s.stats.misses == 1 and s.stats.sets == 1


def check_batch_round_trip(factory: StorageFactory) -> None:
    s = factory(fresh_config())
    keys = page_keys(5, seed=2)
    values = [random_page(10 + i) for i in range(5)]
    assert s.batch_set(keys, values) == [True] * 5
    got = s.batch_get(keys)
    assert all(g is not None and torch.equal(g.view(torch.uint8).reshape(-1), v) for g, v in zip(got, values))
    targets = [torch.empty(PAGE_BYTES, dtype=torch.uint8) for _ in keys]
    got = s.batch_get(keys, targets)
    assert all(g is t for g, t in zip(got, targets))
    assert all(torch.equal(t, v) for t, v in zip(targets, values))
    assert s.stats.bytes_read >= 10 * PAGE_BYTES and s.stats.bytes_written >= 5 * PAGE_BYTES


def check_exists_reports_hole(factory: StorageFactory) -> None:
    """One bool per key: a missing page in the middle of a prefix stays visible."""
    s = factory(fresh_config())
    keys = page_keys(5, seed=3)
    held = [0, 1, 3, 4]
    assert s.batch_set([keys[i] for i in held], [random_page(i) for i in held]) == [True] * 4
    assert s.batch_exists(keys) == [True, True, False, True, True]
    got = s.batch_get(keys)
    assert [g is not None for g in got] == [True, True, False, True, True]


def check_only_new_pages_written(factory: StorageFactory) -> None:
    s = factory(fresh_config())
    keys = page_keys(5, seed=4)
    first = [random_page(i) for i in range(3)]
    assert s.batch_set(keys[:3], first) == [True] * 3
    assert (s.stats.sets, s.stats.skipped_existing) == (3, 0)
    # The held keys come with other bytes: content-addressed keys are never rewritten.
    again = [random_page(100 + i) for i in range(5)]
    assert s.batch_set(keys, again) == [True] * 5
    assert (s.stats.sets, s.stats.skipped_existing) == (5, 3)
    expected = first + again[3:]
    got = s.batch_get(keys)
    assert all(torch.equal(g.view(torch.uint8).reshape(-1), e) for g, e in zip(got, expected))
    assert s.batch_set(keys[:1] * 2, [random_page(7)] * 2) == [True, True]
    assert s.stats.sets == 5


def check_mismatched_target_is_miss(factory: StorageFactory) -> None:
    """A page that does not fit the target (long or short) is a miss, not a partial copy."""
    s = factory(fresh_config())
    key = page_keys(1, seed=5)[0]
    assert s.set(key, random_page(5))
    for n in (PAGE_BYTES - 1, PAGE_BYTES + 1):
        assert s.get(key, torch.zeros(n, dtype=torch.uint8)) is None


def check_page_round_trip(factory: StorageFactory, layout: str = "page_first", attention: str = "mha") -> None:
    """set_pages from one host pool, get_pages into other page ids of a second, zeroed pool
    through a second instance (a restart, or another rank for MLA)."""
    cfg = fresh_config(is_mla=attention == "mla")
    src, dst = make_host_pool(layout, attention, seed=6), make_host_pool(layout, attention, seed=None)
    writer = factory(cfg)
    writer.register_host_pool(src)
    keys = page_keys(4, is_mla=cfg.is_mla, seed=6)
    assert writer.set_pages(keys[:3], [5, 1, 2]) == [True] * 3
    assert writer.set_pages(keys[:3], [5, 1, 2]) == [True] * 3
    assert writer.stats.sets == 3 and writer.stats.skipped_existing == 3
    reader = factory(cfg)
    reader.register_host_pool(dst)
    assert reader.get_pages(keys, [0, 3, 7, 6]) == [True, True, True, False]
    for s_page, d_page in ((5, 0), (1, 3), (2, 7)):
        assert torch.equal(page_bytes(dst, d_page), page_bytes(src, s_page))
    assert torch.count_nonzero(page_bytes(dst, 4)) == 0  # untouched


def check_mla_single_writer(factory: StorageFactory) -> None:
    """MLA pages are shared: rank 1 does not write them, rank 0 does, rank 1 reads them."""
    name = fresh_config().model_name
    r0 = factory(fresh_config(0, 2, True, name))
    r1 = factory(fresh_config(1, 2, True, name))
    keys = page_keys(2, is_mla=True, seed=7)
    assert r1.batch_set(keys, [random_page(1), random_page(2)]) == [False, False]
    assert r0.batch_exists(keys) == [False, False]
    assert r0.batch_set(keys, [random_page(1), random_page(2)]) == [True, True]
    got = r1.batch_get(keys)
    assert torch.equal(got[1].view(torch.uint8).reshape(-1), random_page(2))


def check_namespaces_are_separate(factory: StorageFactory) -> None:
    a, b = factory(fresh_config()), factory(fresh_config())
    key = page_keys(1, seed=8)[0]
    assert a.set(key, random_page(8))
    assert not b.exists(key) and b.get(key) is None


def check_clear(factory: StorageFactory) -> None:
    cfg = fresh_config()
    s, other = factory(cfg), factory(fresh_config())
    keys = page_keys(3, seed=9)
    s.batch_set(keys, [random_page(i) for i in range(3)])
    other.set(keys[0], random_page(0))
    s.clear()
    assert s.batch_exists(keys) == [False] * 3
    assert factory(cfg).batch_exists(keys) == [False] * 3
    assert other.exists(keys[0])  # another namespace keeps its pages
    assert s.batch_set(keys, [random_page(i) for i in range(3)]) == [True] * 3


def check_concurrent_use(factory: StorageFactory, threads: int = 4, pages: int = 12, exact_sets: bool = True) -> None:
    """Threads writing and reading overlapping keys: every read that hits is exact, and (with
    ``exact_sets``) each page is written once although threads race to write it."""
    s = factory(fresh_config())
    keys = page_keys(pages, seed=10)
    values = [random_page(200 + i) for i in range(pages)]
    errors: list[BaseException] = []

    def work(offset: int) -> None:
        try:
            for step in range(pages):
                i = (offset + step) % pages
                assert s.set(keys[i], values[i])
                got = s.get(keys[(i + 1) % pages])
                assert got is None or torch.equal(got.view(torch.uint8).reshape(-1), values[(i + 1) % pages])
        except BaseException as e:  # surfaced in the main thread
            errors.append(e)

    ts = [threading.Thread(target=work, args=(t * 3,)) for t in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors, errors
    assert s.batch_exists(keys) == [True] * pages
    assert s.stats.faults == 0
    assert s.stats.sets == pages if exact_sets else s.stats.sets >= pages


BASIC_CHECKS: tuple[Callable[[StorageFactory], None], ...] = (
    check_single_round_trip, check_batch_round_trip, check_exists_reports_hole, check_only_new_pages_written,
    check_mismatched_target_is_miss, check_page_round_trip, check_mla_single_writer, check_namespaces_are_separate,
    check_clear, check_concurrent_use,
)


# -- checks that need a backend-specific callback ----------------------------------------------
def check_corrupt_object_is_miss(factory: StorageFactory, damage: Callable[[HiCacheStorage, str], None]) -> None:
    """``damage(backend, key)`` changes the stored object of ``key`` (flips bytes, truncates,
    ...). Reading it must be a miss counted as corrupt, in every form of read, and the
    caller's target must not be reported as filled."""
    s = factory(fresh_config())
    pool = make_host_pool(seed=11)
    s.register_host_pool(pool)
    keys = page_keys(3, seed=11)
    assert s.set_pages(keys, [0, 1, 2]) == [True] * 3
    damage(s, keys[1])
    before = s.stats.corrupt
    assert s.get_pages(keys, [3, 4, 5]) == [True, False, True]
    assert s.stats.corrupt == before + 1 and s.stats.faults >= 1
    assert torch.equal(page_bytes(pool, 3), page_bytes(pool, 0))
    assert torch.equal(page_bytes(pool, 5), page_bytes(pool, 2))
    for read in (lambda: s.get(keys[1]), lambda: s.get(keys[1], torch.zeros(PAGE_BYTES, dtype=torch.uint8))):
        assert read() is None


def check_fault_is_miss(factory: StorageFactory, break_backend: Callable[[HiCacheStorage], None]) -> None:
    """After ``break_backend(backend)`` (lost connection, unusable directory, ...), no public
    method raises: reads and existence checks miss, writes report False, faults are counted."""
    s = factory(fresh_config())
    pool = make_host_pool(seed=12)
    s.register_host_pool(pool)
    keys = page_keys(2, seed=12)
    assert s.set_pages(keys[:1], [0]) == [True]
    break_backend(s)
    assert s.get(keys[0]) is None
    assert s.get_pages(keys, [3, 4]) == [False, False]
    assert s.set_pages(keys[1:], [1]) == [False]
    assert s.batch_exists(keys)[1] is False
    assert s.stats.faults >= 2
