"""Writes to L3: after a node's host backup, only pages L3 lacks, host pages locked while in
flight; host-only inserts written on request; MLA pages written by rank 0 only; failed
writes leave the node unmarked and unlocked."""
from __future__ import annotations

import threading

import pytest
import torch

from hicache.storage.base import StorageConfig
from hicache.storage.keys import page_hash_chain, storage_key
from hicache.storage_controller import StoragePolicy
from l3_kit import PS, LAYERS, build, expected, put, store, wait_until
from memory_storage import MemoryStorage

TOKS = list(range(500, 564))  # 16 pages


def keys_of(tokens, rank=0):
    return [storage_key(h, rank) for h in page_hash_chain(tokens, PS)]


def test_write_through_sends_only_new_nodes_and_only_missing_pages():
    s = MemoryStorage()
    tree, dev, _ = build(s)
    store(tree, dev, TOKS[:32])
    assert sum(s.set_calls, []) == keys_of(TOKS[:32])  # in batches of io_batch_pages
    s.set_calls.clear()
    store(tree, dev, TOKS)  # shares 32 tokens: only the new node goes out
    assert sum(s.set_calls, []) == keys_of(TOKS)[8:]
    assert tree.stats()["l3_write_skipped_existing"] == 0
    tree.close()
    # another instance over the same store: the backend is asked first, existing pages skipped
    other = MemoryStorage(objects=s.objects)
    tree, dev, _ = build(other)
    store(tree, dev, TOKS + list(range(9000, 9016)))
    assert sum(other.set_calls, []) == keys_of(TOKS + list(range(9000, 9016)))[16:]
    st = tree.stats()
    assert st["l3_write_skipped_existing"] == 16 and st["l3_pages_written"] == 4
    tree.close()


def test_stored_bytes_are_the_host_pages():
    s = MemoryStorage()
    tree, dev, host = build(s)
    res = store(tree, dev, TOKS[:8])
    from hicache.storage.integrity import unseal

    node = res.last_node
    for i, k in enumerate(keys_of(TOKS[:8])):
        page = int(node.host_indices[i * PS]) // PS
        assert bytes(unseal(s.objects[k])) == host.page_tensor(page).contiguous().view(torch.uint8).numpy().tobytes()
    tree.close()


def test_host_pages_stay_locked_while_the_write_is_in_flight():
    s = MemoryStorage()
    s.set_gate = threading.Event()
    tree, dev, host = build(s)
    res = put(tree, dev, TOKS[:16])
    tree.writing_check(block=True)  # host copy done -> L3 write submitted, stalled in the backend
    node = res.last_node
    assert node.backed_up and node.storage_op is not None and node.host_lock_ref == 1
    tree.evict(10 ** 6)  # device copy demoted; the host copy is what is being written
    assert not node.on_device
    assert tree.evict_host(10 ** 6) == 0
    with pytest.raises(ValueError, match="locked"):
        tree.evict_host_node(node)
    tree.check_hicache_events()
    assert node.host_lock_ref == 1  # not acknowledged yet
    tree.check_invariants()
    s.set_gate.set()
    wait_until(lambda: tree.storage_ctl.in_flight() == 0)
    tree.check_hicache_events()
    assert node.host_lock_ref == 0 and node.storage_op is None and node.in_storage
    assert tree.evict_host(10 ** 6) == 16
    tree.check_invariants()
    tree.close()


def test_a_split_while_in_flight_marks_both_halves():
    s = MemoryStorage()
    s.set_gate = threading.Event()
    tree, dev, _ = build(s)
    res = put(tree, dev, TOKS[:16])
    tree.writing_check(block=True)
    m = tree.match_prefix(TOKS[:8] + [1, 2, 3, 4])  # splits the node being written
    head = m.last_device_node
    assert head is not res.last_node and head.storage_op == res.last_node.storage_op
    tree.check_invariants()
    s.set_gate.set()
    tree.flush_storage()
    assert head.in_storage and res.last_node.in_storage and head.host_lock_ref == 0
    tree.check_invariants()
    tree.close()


def test_host_only_insert_is_written_on_request():
    """The sparse runtime fills host pages itself and inserts host-only nodes."""
    s = MemoryStorage()
    tree, _, host = build(s)
    slots = host.alloc(32)
    kv = expected(TOKS[:32])
    for layer in range(LAYERS):
        host.write_tokens(layer, slots, kv[layer, 0], kv[layer, 1])
    res = tree.insert(TOKS[:32], host_indices=slots)
    assert not s.set_calls  # nothing written by itself: the caller knows when its pages are complete
    assert tree.write_backup_storage(res.last_node) == 8
    assert tree.write_backup_storage(res.last_node) == 0  # in flight: not twice
    tree.flush_storage()
    assert set(s.objects) == set(keys_of(TOKS[:32]))
    assert tree.write_backup_storage(res.last_node) == 0  # already in L3
    tree.close()


def test_write_failures_leave_the_node_unmarked_and_unlocked():
    s = MemoryStorage()
    s.fail_set = True
    tree, dev, _ = build(s)
    res = store(tree, dev, TOKS[:16])
    node = res.last_node
    st = tree.stats()
    assert not node.in_storage and node.host_lock_ref == 0 and node.storage_op is None
    assert st["storage_backup_failed_ops"] == 1 and st["l3_write_incomplete_ops"] == 1
    s.fail_set = False
    assert tree.write_backup_storage(node) == 4  # a later try writes it
    tree.flush_storage()
    assert node.in_storage and set(s.objects) == set(keys_of(TOKS[:16]))
    tree.close()


def test_mla_pages_are_written_by_rank_zero_only():
    for rank, writes in ((1, False), (0, True)):
        s = MemoryStorage(StorageConfig(tp_rank=rank, tp_size=2, is_mla=True))
        tree, dev, _ = build(s)
        res = store(tree, dev, TOKS[:16])
        assert bool(s.set_calls) is writes
        if writes:  # MLA keys carry no rank suffix
            assert set(s.objects) == {storage_key(h, 0, is_mla=True) for h in page_hash_chain(TOKS[:16], PS)}
        assert res.last_node.host_lock_ref == 0 and res.last_node.in_storage
        tree.close()


def test_write_through_can_be_switched_off():
    s = MemoryStorage()
    tree, dev, _ = build(s, StoragePolicy(write_through=False, prefetch_threshold=8))
    store(tree, dev, TOKS[:16])
    assert not s.set_calls
    tree.close()
