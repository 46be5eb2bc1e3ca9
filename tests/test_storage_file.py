"""FileStorage: the shared backend checks, plus what is specific to files: atomic
publication, the size cap, key validation, on-disk corruption and unusable directories."""
from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import storage_conformance as sc
from hicache.storage.base import StorageConfig
from hicache.storage.file_store import (ENV_DIR, STALE_TMP_SECONDS, TMP_SUFFIX, FileStorage, namespace_dir_name)
from hicache.storage.integrity import HEADER_BYTES, seal, unseal

PAGE_FILE_BYTES = HEADER_BYTES + sc.PAGE_BYTES


@pytest.fixture
def root(tmp_path):
    return tmp_path / "l3"


def file_factory(root, cls=FileStorage, **extra):
    def make(config: StorageConfig) -> FileStorage:
        return cls(dataclasses.replace(config, extra={**config.extra, "file_path": str(root), **extra}))
    return make


def visible_objects(s: FileStorage) -> list[str]:
    return sorted(n for n in os.listdir(s.directory) if not n.startswith("."))


def temp_files(s: FileStorage) -> list[str]:
    return [n for n in os.listdir(s.directory) if n.endswith(TMP_SUFFIX)]


@pytest.mark.parametrize("check", sc.BASIC_CHECKS, ids=lambda f: f.__name__)
def test_conformance(root, check):
    check(file_factory(root))


@pytest.mark.parametrize("layout", ["page_first_direct", "page_head"])
def test_page_round_trip_other_layouts(root, layout):
    sc.check_page_round_trip(file_factory(root), layout)


def test_mla_page_round_trip(root):
    sc.check_page_round_trip(file_factory(root), attention="mla")


def test_objects_are_sealed_pages(root):
    s = file_factory(root)(sc.fresh_config())
    key = sc.page_keys(1)[0]
    value = sc.random_page(1)
    s.set(key, value)
    with open(s.path_of(key), "rb") as f:
        raw = f.read()
    assert raw == seal(value) and bytes(unseal(raw)) == value.numpy().tobytes()


def _flip_payload_byte(s, key):
    with open(s.path_of(key), "r+b") as f:
        f.seek(HEADER_BYTES + 100)
        b = f.read(1)
        f.seek(HEADER_BYTES + 100)
        f.write(bytes([b[0] ^ 0xFF]))


def _truncate(n):
    def damage(s, key):
        with open(s.path_of(key), "r+b") as f:
            f.truncate(n)
    return damage


def _append(s, key):
    with open(s.path_of(key), "ab") as f:
        f.write(b"\0" * 8)


def _bad_header(s, key):
    with open(s.path_of(key), "r+b") as f:
        f.write(b"JUNK")


@pytest.mark.parametrize("damage", [_flip_payload_byte, _truncate(PAGE_FILE_BYTES - 1), _truncate(10), _truncate(0),
                                    _append, _bad_header],
                         ids=["flipped", "short_payload", "short_header", "empty", "long", "bad_magic"])
def test_corrupt_file_is_a_counted_miss(root, damage):
    sc.check_corrupt_object_is_miss(file_factory(root), damage)


def test_corrupt_file_is_removed_so_it_can_be_rewritten(root):
    s = file_factory(root)(sc.fresh_config())
    key = sc.page_keys(1)[0]
    s.set(key, sc.random_page(1))
    _flip_payload_byte(s, key)
    assert s.exists(key)  # existence does not read the page
    assert s.get(key) is None and not s.exists(key)
    assert s.set(key, sc.random_page(1)) and torch.equal(s.get(key), sc.random_page(1))


@pytest.mark.parametrize("damage", ["short", "long", "header_only"])
@pytest.mark.parametrize("with_pool", [True, False], ids=["pool", "no_pool"])
def test_existence_check_refuses_a_file_of_the_wrong_length(root, damage, with_pool):
    """One lstat per key: a file whose size is not a sealed page's is absent, counted as
    corrupt and removed. The page size is the registered host pool's; without a pool, any
    size beyond the header passes (the read checks the rest)."""
    s = file_factory(root)(sc.fresh_config())
    nbytes = sc.PAGE_BYTES
    if with_pool:
        pool = sc.make_host_pool(seed=3)
        s.register_host_pool(pool)
        nbytes = pool.page_tensor(0).numel() * pool.page_tensor(0).element_size()
    keys = sc.page_keys(2)
    pages = [sc.random_page(1, nbytes), sc.random_page(2, nbytes)]
    assert s.batch_set(keys, pages) == [True, True] and s.batch_exists(keys) == [True, True]
    size = HEADER_BYTES + nbytes
    with open(s.path_of(keys[0]), "r+b") as f:
        if damage == "long":
            f.seek(size)
            f.write(b"\0" * 8)
        else:
            f.truncate(size - 1 if damage == "short" else HEADER_BYTES)
    before = s.stats.corrupt
    if not with_pool and damage != "header_only":
        assert s.batch_exists(keys) == [True, True]  # the read finds it (test_corrupt_file_is_a_counted_miss)
        return
    assert s.batch_exists(keys) == [False, True]
    assert s.stats.corrupt == before + 1 and not os.path.exists(s.path_of(keys[0]))
    assert s.set(keys[0], pages[0]) and torch.equal(s.get(keys[0]), pages[0])  # repaired by the next write


def _replace_directory_with_file(s):
    shutil.rmtree(s.directory)
    with open(s.directory, "w") as f:
        f.write("not a directory")


def test_unusable_directory_is_a_miss(root):
    sc.check_fault_is_miss(file_factory(root), _replace_directory_with_file)


class RaisingReads(FileStorage):
    def _read(self, path, target):
        raise RuntimeError("disk controller on fire")


class FullDisk(FileStorage):
    def _write_tmp(self, tmp, header, payload):
        with open(tmp, "wb") as f:
            f.write(header)  # a partial temp file, then the disk is full
        raise OSError(28, "No space left on device")


def test_backend_raising_is_a_miss_logged_once(root, caplog):
    s = file_factory(root)(sc.fresh_config())
    keys = sc.page_keys(3)
    s.batch_set(keys, [sc.random_page(i) for i in range(3)])
    broken = file_factory(root, RaisingReads)(dataclasses.replace(s.config))
    with caplog.at_level(logging.WARNING, logger="hicache.storage"):
        assert broken.batch_get(keys) == [None] * 3
        assert broken.get(keys[0], torch.zeros(sc.PAGE_BYTES, dtype=torch.uint8)) is None
    assert broken.stats.faults == 4 and broken.stats.misses == 4 and broken.stats.corrupt == 0
    assert len([r for r in caplog.records if "read fault" in r.getMessage()]) == 1
    assert s.batch_exists(keys) == [True] * 3  # a read fault deletes nothing


def test_failed_write_leaves_nothing(root):
    s = file_factory(root, FullDisk)(sc.fresh_config())
    keys = sc.page_keys(2)
    assert s.batch_set(keys, [sc.random_page(0), sc.random_page(1)]) == [False, False]
    assert s.stats.faults == 2 and s.stats.sets == 0
    assert os.listdir(s.directory) == [] and s.used_bytes == 0 and s.num_objects == 0


def test_writes_leave_no_temp_files(root):
    s = file_factory(root)(sc.fresh_config())
    keys = sc.page_keys(6)
    s.batch_set(keys, [sc.random_page(i) for i in range(6)])
    assert temp_files(s) == [] and visible_objects(s) == sorted(k + ".kv" for k in keys)


class FailsBeforePublish(FileStorage):
    def _publish(self, tmp, path):
        raise OSError("interrupted between write and rename")


def test_interrupted_publish_leaves_no_visible_object(root):
    s = file_factory(root, FailsBeforePublish)(sc.fresh_config())
    key = sc.page_keys(1)[0]
    assert s.set(key, sc.random_page(0)) is False
    assert os.listdir(s.directory) == [] and not s.exists(key)


_CRASH_WRITER = textwrap.dedent("""
    import os, sys, torch
    from hicache.storage.base import StorageConfig
    from hicache.storage.file_store import FileStorage

    class CrashBeforeRename(FileStorage):
        def _publish(self, tmp, path):
            os._exit(17)  # the process dies with the page written but not published

    s = CrashBeforeRename(StorageConfig(model_name="m", extra={"file_path": sys.argv[1]}))
    s.set(sys.argv[2], torch.ones(4096, dtype=torch.uint8))
""")


def test_killed_writer_leaves_no_visible_partial_object(root):
    key = sc.page_keys(1)[0]
    proc = subprocess.run([sys.executable, "-c", _CRASH_WRITER, str(root), key], env=os.environ.copy(),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 17, proc.stderr
    s = file_factory(root)(StorageConfig(model_name="m"))
    tmps = temp_files(s)
    assert len(tmps) == 1 and tmps[0].startswith(".")  # the orphan is hidden ...
    assert not s.exists(key) and s.get(key) is None and s.stats.faults == 0  # ... and never read
    assert s.num_objects == 0 and visible_objects(s) == []
    old = time.time() - STALE_TMP_SECONDS - 60
    os.utime(os.path.join(s.directory, tmps[0]), (old, old))
    file_factory(root)(StorageConfig(model_name="m"))  # a new instance removes stale orphans
    assert temp_files(s) == []


def test_size_cap_evicts_least_recently_used(root):
    s = file_factory(root, file_max_bytes=3 * PAGE_FILE_BYTES)(sc.fresh_config())
    keys = sc.page_keys(5)
    assert s.batch_set(keys[:3], [sc.random_page(i) for i in range(3)]) == [True] * 3
    assert s.get(keys[0]) is not None  # keys[1] is now the least recently used
    assert s.set(keys[3], sc.random_page(3))
    assert s.batch_exists(keys) == [True, False, True, True, False]
    assert s.used_bytes == 3 * PAGE_FILE_BYTES and len(visible_objects(s)) == 3
    # Recency now: keys[2], keys[0], keys[3]; two new pages push out the two oldest.
    assert s.batch_set([keys[4], keys[1]], [sc.random_page(4), sc.random_page(1)]) == [True, True]
    assert s.batch_exists(keys) == [False, True, False, True, True]


def test_size_cap_never_evicts_pages_of_the_same_batch(root):
    s = file_factory(root, file_max_bytes=2 * PAGE_FILE_BYTES)(sc.fresh_config())
    keys = sc.page_keys(3)
    assert s.batch_set(keys, [sc.random_page(i) for i in range(3)]) == [True, True, False]
    assert s.batch_exists(keys) == [True, True, False]


def test_page_larger_than_the_cap_is_not_stored(root):
    s = file_factory(root, file_max_bytes=PAGE_FILE_BYTES - 1)(sc.fresh_config())
    key = sc.page_keys(1)[0]
    assert s.set(key, sc.random_page(0)) is False and not s.exists(key) and s.used_bytes == 0


def test_index_and_recency_are_rebuilt_on_start(root):
    cfg = sc.fresh_config()
    s = file_factory(root)(cfg)
    keys = sc.page_keys(4)
    s.batch_set(keys, [sc.random_page(i) for i in range(4)])
    now = time.time()
    for age, k in zip((400, 100, 300, 200), keys):  # recency order: keys[0], [2], [3], [1]
        os.utime(s.path_of(k), (now - age, now - age))
    again = file_factory(root)(cfg)
    assert again.num_objects == 4 and again.used_bytes == 4 * PAGE_FILE_BYTES
    # A restart with a smaller cap trims to it, oldest first.
    small = file_factory(root, file_max_bytes=2 * PAGE_FILE_BYTES)(cfg)
    assert small.batch_exists(keys) == [False, True, False, True]


def test_instances_sharing_a_directory_see_each_others_pages(root):
    cfg = sc.fresh_config()
    a, b = file_factory(root)(cfg), file_factory(root, file_max_bytes=2 * PAGE_FILE_BYTES)(cfg)
    keys = sc.page_keys(3)
    a.batch_set(keys[:2], [sc.random_page(0), sc.random_page(1)])
    assert b.batch_exists(keys) == [True, True, False] and b.used_bytes == 2 * PAGE_FILE_BYTES
    assert b.set(keys[2], sc.random_page(2))  # b's cap counts a's pages it has seen
    assert b.used_bytes == 2 * PAGE_FILE_BYTES and a.batch_exists(keys).count(True) == 2


@pytest.mark.parametrize("bad", ["../escape", "..", "a/b", "/etc/passwd", "", "ABCDEF", "abc_", "abc_x",
                                 "abc.kv", "abc\x00", 123, None])
def test_keys_cannot_escape_the_directory(root, bad):
    s = file_factory(root)(sc.fresh_config())
    v = sc.random_page(0)
    for call in (lambda: s.set(bad, v), lambda: s.get(bad), lambda: s.exists(bad),
                 lambda: s.batch_set(["ab", bad], [v, v]), lambda: s.batch_exists(["ab", bad])):
        with pytest.raises(ValueError, match="key"):
            call()
    assert os.listdir(s.directory) == [] and os.listdir(root) == [os.path.basename(s.directory)]


def test_model_name_cannot_escape_the_root(root):
    for name in ("../../evil", "..", "org/model", "/abs"):
        d = file_factory(root)(sc.fresh_config(model_name=name)).directory
        assert os.path.dirname(os.path.realpath(d)) == os.path.realpath(root)
        assert ".." not in os.path.basename(d)
    assert namespace_dir_name("a/b") != namespace_dir_name("a_b")


def test_bad_arguments_name_the_parameter(root):
    s = file_factory(root)(sc.fresh_config())
    keys = sc.page_keys(2)
    with pytest.raises(ValueError, match="values"):
        s.batch_set(keys, [sc.random_page(0)])
    with pytest.raises(ValueError, match=r"values\[0\]"):
        s.batch_set(keys[:1], [torch.zeros(8, 8)[:, 0]])
    with pytest.raises(ValueError, match="targets"):
        s.batch_get(keys, [torch.zeros(4)])
    with pytest.raises(RuntimeError, match="register_host_pool"):
        s.get_pages(keys, [0, 1])
    s.register_host_pool(sc.make_host_pool())
    with pytest.raises(ValueError, match="host_pages"):
        s.get_pages(keys, [0, 99])
    with pytest.raises(ValueError, match="layer_first"):
        s.register_host_pool(sc.make_host_pool("layer_first"))


@pytest.mark.parametrize("cap", [-1, "1GB", 1.5, True])
def test_bad_cap_is_rejected(root, cap):
    with pytest.raises(ValueError, match="file_max_bytes"):
        file_factory(root, file_max_bytes=cap)(sc.fresh_config())


def test_directory_defaults_to_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_DIR, str(tmp_path / "env"))
    s = FileStorage(StorageConfig(model_name="m"))
    assert s.directory.startswith(str(tmp_path / "env") + os.sep)
    unusable = tmp_path / "plain_file"
    unusable.write_text("x")
    with pytest.raises(ValueError, match="file_path"):
        FileStorage(StorageConfig(extra={"file_path": str(unusable)}))


def test_clear_on_an_unusable_directory_is_counted_not_raised(root):
    s = file_factory(root)(sc.fresh_config())
    _replace_directory_with_file(s)
    s.clear()
    assert s.stats.faults == 1
