"""The file backend stays inside its directory whatever the keys or the extra config say,
and a page that fails its length or checksum check is never taken into the host tier
(through the real prefetch path of the tree)."""
from __future__ import annotations

import os

import pytest
import torch

from hicache.storage.base import StorageConfig
from hicache.storage.file_store import FileStorage
from hicache.storage.integrity import HEADER_BYTES, seal
from hicache.storage.keys import page_hash_chain, storage_key
from l3_kit import PS, build, empty_tiers, expected, no_leaks, read_host, settle, store

BAD_KEYS = ["../x", "../../etc/passwd", "/etc/passwd", "/tmp/x", "a\x00b", "ab" * 5000, "..", ".", "",
            "ab/cd", "ab\\cd", "AB", "ab_1/../..", "ab_", " ab", "ab\n", "ab.kv", 7, None, b"ab"]


def _all_files(top) -> set[str]:
    out = set()
    for d, dirs, files in os.walk(top):
        out.update(os.path.join(d, f) for f in files + dirs)
    return out


@pytest.fixture
def sandbox(tmp_path):
    """(store root, a sibling directory a bad key might reach)."""
    root, outside = tmp_path / "l3", tmp_path / "outside"
    outside.mkdir()
    (outside / "victim.kv").write_bytes(b"precious")
    return root, outside


def _backend(root, **extra) -> FileStorage:
    return FileStorage(StorageConfig(model_name="m", extra={"file_path": str(root), **extra}))


@pytest.mark.parametrize("key", BAD_KEYS, ids=lambda k: repr(k)[:20])
def test_bad_keys_are_refused_by_every_entry_point(sandbox, key):
    root, outside = sandbox
    s = _backend(root)
    before = _all_files(root.parent)
    page = torch.zeros(16, dtype=torch.uint8)
    calls = [lambda: s.exists(key), lambda: s.get(key), lambda: s.set(key, page),
             lambda: s.batch_exists(["ab", key]), lambda: s.batch_get(["ab", key]),
             lambda: s.batch_set(["ab", key], [page, page]), lambda: s.path_of(key)]
    for call in calls:
        with pytest.raises(ValueError, match=r"is invalid: a storage key is a lowercase hex hash"):
            call()
    assert _all_files(root.parent) == before  # nothing created or removed anywhere
    assert (outside / "victim.kv").read_bytes() == b"precious"
    assert s.num_objects == 0


def test_extra_config_cannot_move_objects_out(sandbox, tmp_path):
    root, outside = sandbox
    with pytest.raises(ValueError, match=r"file_path must be a directory path \(str without NUL\)"):
        _backend(str(root) + "\x00x")
    with pytest.raises(ValueError, match="file_path must be a directory path"):
        FileStorage(StorageConfig(extra={"file_path": ["/tmp"]}))
    with pytest.raises(ValueError, match="file_max_bytes must be an int >= 0"):
        _backend(root, file_max_bytes="../1")
    # a model name (the namespace) cannot climb out of file_path either
    for name in ("../../outside", "/abs/path", "..", "a\x00b", "x" * 5000):
        s = FileStorage(StorageConfig(model_name=name, extra={"file_path": str(root)}))
        assert os.path.dirname(s.directory) == os.path.abspath(root), name
        assert s.set("ab", torch.ones(8, dtype=torch.uint8))
        assert os.path.exists(os.path.join(s.directory, "ab.kv"))
    assert sorted(os.listdir(outside)) == ["victim.kv"]
    # unknown keys (say, a 'namespace' or 'directory') change nothing
    s = _backend(root, namespace="../outside", directory=str(outside))
    assert s.set("cd", torch.ones(8, dtype=torch.uint8))
    assert sorted(os.listdir(outside)) == ["victim.kv"]


def test_symlinked_objects_are_never_followed(sandbox):
    root, outside = sandbox
    s = _backend(root)
    good = torch.arange(16, dtype=torch.uint8)
    target = outside / "planted.kv"
    target.write_bytes(seal(good.numpy().tobytes()))  # a valid sealed page, outside
    link = os.path.join(s.directory, "ab.kv")
    os.symlink(target, link)
    assert not s.exists("ab") and s.get("ab") is None
    # a write replaces the link itself; the file it pointed at is untouched
    assert s.set("ab", torch.full((16,), 9, dtype=torch.uint8))
    assert not os.path.islink(link) and s.get("ab").tolist() == [9] * 16
    assert target.read_bytes() == seal(good.numpy().tobytes())
    # a restart's index skips links
    os.symlink(target, os.path.join(s.directory, "cd.kv"))
    s2 = _backend(root)
    assert s2.num_objects == 1 and not s2.exists("cd")


def _flip_payload_byte(raw: bytearray) -> bytearray:
    raw[HEADER_BYTES + 5] ^= 0xFF  # length right, checksum wrong: found by the read
    return raw


def _cut_last_byte(raw: bytearray) -> bytearray:
    return raw[:-1]  # wrong length: found by the existence check


def _append_bytes(raw: bytearray) -> bytearray:
    return raw + b"\0" * 8


@pytest.mark.parametrize("damage,read_fails", [(_flip_payload_byte, True), (_cut_last_byte, False),
                                               (_append_bytes, False)], ids=["checksum", "short", "long"])
def test_a_corrupt_page_is_never_taken_into_the_host_tier(tmp_path, damage, read_fails):
    toks = list(range(100, 132))  # 8 pages
    s = _backend(tmp_path / "l3")
    tree, dev, host = build(s)
    store(tree, dev, toks)
    keys = [storage_key(h, 0) for h in page_hash_chain(toks, PS)]
    assert all(s.exists(k) for k in keys)
    empty_tiers(tree)
    # Another request's pages on host: their bytes must survive the fetch untouched.
    other = list(range(900, 916))
    store(tree, dev, other)
    tree.evict(10 ** 9)
    m_other = tree.match_prefix(other)
    other_slots = m_other.backed_host_indices.clone()
    other_before = read_host(host, other_slots).clone()

    bad = 3  # the 4th page is damaged
    path = s.path_of(keys[bad])
    raw = damage(bytearray(open(path, "rb").read()))
    open(path, "wb").write(bytes(raw))

    m = tree.match_prefix(toks)
    assert tree.prefetch_from_storage("r", m.last_backed_node, toks) == 32
    settle(tree, "r")
    m = tree.match_prefix(toks)
    assert m.backed_length == bad * PS  # the prefix ends before the corrupt page
    assert torch.equal(read_host(host, m.backed_host_indices), expected(toks[:bad * PS]))
    # no tree node covers the corrupt page or anything after it
    held = set(tree.all_host_indices().tolist())
    assert len(held) == (bad + 4) * PS  # 3 fetched pages + the other request's 4 pages
    assert torch.equal(read_host(host, other_slots), other_before)
    st = tree.stats()
    # a checksum fails when the page is read; a wrong length already in the existence check
    assert st["l3_fetch_miss_pages"] == int(read_fails) and s.stats.corrupt == 1
    assert st["l3_pages_fetched"] == bad and st["prefetch_adopted_pages"] == bad
    assert not os.path.exists(path)  # dropped, so the next write-back can repair it
    no_leaks(tree)
    tree.close()
