"""HiRadixTree + HiCacheController on CPU pools: matching, splits, write policies, eviction
order, locks, host-only insert (sparse path), load-back, bad input."""
from __future__ import annotations

import pytest
import torch

from hicache.controller import HiCacheController
from hicache.device_pool import DeviceKVPool
from hicache.host_pool import HostKVPool
from hicache.kv_spec import KVCacheSpec
from hicache.radix_tree import HiRadixTree
from l3_kit import DIM, HEADS, LAYERS, expected  # one KV-by-prefix rule for the tree and the L3 tests


def build(policy="write_through", page_size=4, dev_pages=16, ratio=2.0, io="direct", layout="layer_first"):
    spec = KVCacheSpec("mha", LAYERS, HEADS, DIM, torch.float32, page_size)
    dev = DeviceKVPool(spec, dev_pages * page_size, "cpu")
    host = HostKVPool(dev, hicache_ratio=ratio, layout=layout)
    ctl = HiCacheController(dev, host, write_policy=policy, io_backend=io)
    return HiRadixTree(ctl), ctl, dev, host


def prefill(dev: DeviceKVPool, tokens, slots) -> None:
    kv = expected(tokens)
    for layer in range(LAYERS):
        dev.set_kv(layer, slots, kv[layer, 0], kv[layer, 1])


def read_device(dev: DeviceKVPool, slots) -> torch.Tensor:
    return torch.stack([torch.stack([b[slots] for b in dev.layer_buffers(l)]) for l in range(LAYERS)])


def read_host(host: HostKVPool, slots) -> torch.Tensor:
    return torch.stack([torch.stack(host.read_tokens(l, slots)) for l in range(LAYERS)])


def put(tree, dev, tokens):
    """Prefill `tokens` on device and insert them (the scheduler's cache_finished_req)."""
    slots = dev.allocator.alloc(len(tokens))
    prefill(dev, tokens, slots)
    res = tree.insert(tokens, device_indices=slots)
    dev.allocator.free(res.device_unused)
    return res


def seq(start, n):
    return list(range(start, start + n))


def test_insert_and_match_device_hit_maps_to_written_kv():
    tree, ctl, dev, host = build()
    toks = seq(100, 12)
    put(tree, dev, toks)
    m = tree.match_prefix(toks + [1, 2, 3])  # trailing partial page is dropped
    assert m.device_hit_length == 12 and m.host_hit_length == 0
    assert torch.equal(read_device(dev, m.device_indices), expected(toks))
    tree.check_invariants()


def test_match_inside_node_splits_at_page_boundary():
    tree, ctl, dev, host = build(page_size=4)
    toks = seq(0, 12)
    put(tree, dev, toks)
    q = toks[:6] + [999, 998]  # diverges inside page 1 -> only page 0 matches
    m = tree.match_prefix(q)
    assert m.device_hit_length == 4
    nodes = sorted((len(n.key) for n in tree.nodes()))
    assert nodes == [4, 8]
    assert len(tree.root.children) == 1
    top = next(iter(tree.root.children.values()))
    assert top.key == tuple(toks[:4]) and next(iter(top.children.values())).key == tuple(toks[4:])
    assert torch.equal(read_device(dev, m.device_indices), expected(toks[:4]))
    tree.check_invariants()


def test_insert_rejects_partial_pages_and_mismatched_lengths_tree_unchanged():
    tree, ctl, dev, host = build(page_size=4)
    put(tree, dev, seq(0, 8))
    before = (tree.device_tokens(), tree.host_tokens(), len(list(tree.nodes())))
    slots = dev.allocator.alloc(8)
    with pytest.raises(ValueError, match="page_size"):
        tree.insert(seq(50, 6), device_indices=slots[:6])
    with pytest.raises(ValueError, match="must match"):
        tree.insert(seq(50, 8), device_indices=slots[:4])
    with pytest.raises(ValueError, match="device_indices and/or host_indices"):
        tree.insert(seq(50, 8))
    with pytest.raises(ValueError, match="whole pages"):
        tree.insert(seq(50, 8), device_indices=slots.flip(0))
    with pytest.raises(ValueError, match=r"\[0, "):
        tree.insert(seq(50, 8), device_indices=torch.full((8,), -1, dtype=torch.int64))
    assert before == (tree.device_tokens(), tree.host_tokens(), len(list(tree.nodes())))
    tree.check_invariants()


def test_write_through_backs_up_at_once_and_holds_lock_until_ack():
    tree, ctl, dev, host = build("write_through")
    toks = seq(10, 8)
    res = put(tree, dev, toks)
    node = res.last_node
    assert node.backed_up and node.write_ack is not None and node.lock_ref == 1  # in flight
    assert not tree.backup_complete(node)
    tree.writing_check(block=True)
    assert node.write_ack is None and node.lock_ref == 0 and tree.backup_complete(node)
    assert torch.equal(read_host(host, node.host_indices), expected(toks))
    assert tree.stats()["bytes_d2h"] == 8 * dev.spec.token_bytes
    tree.check_invariants()


def test_write_through_selective_backs_up_on_second_access():
    tree, ctl, dev, host = build("write_through_selective")
    toks = seq(10, 8)
    node = put(tree, dev, toks).last_node
    tree.writing_check(block=True)
    assert not node.backed_up
    tree.match_prefix(toks)
    assert node.backed_up
    tree.writing_check(block=True)
    assert torch.equal(read_host(host, node.host_indices), expected(toks))


def test_write_back_only_on_eviction_then_load_back():
    tree, ctl, dev, host = build("write_back")
    toks = seq(10, 8)
    node = put(tree, dev, toks).last_node
    for _ in range(3):
        tree.match_prefix(toks)
    tree.writing_check(block=True)
    assert not node.backed_up
    free0 = dev.allocator.available_size()
    assert tree.evict(8) == 8  # waits for the backup, then demotes
    assert node.backed_up and not node.on_device and dev.allocator.available_size() == free0 + 8
    assert torch.equal(read_host(host, node.host_indices), expected(toks))
    m = tree.match_prefix(toks)
    assert m.device_hit_length == 0 and m.host_hit_length == 8
    slots, last = tree.init_load_back(m.last_host_node, m.host_hit_length)
    assert last is node and slots.numel() == 8 and node.loading and node.lock_ref == 1
    pid = tree.ready_to_load_host_cache()
    assert pid >= 0 and ctl.layer_counter.consumer == pid
    for layer in range(LAYERS):
        ctl.layer_counter.wait_until(layer)
    tree.loading_check(block=True)
    assert not node.loading and node.lock_ref == 0
    assert torch.equal(read_device(dev, slots), expected(toks))
    tree.check_invariants()


def test_backup_continuity_child_waits_for_parent():
    tree, ctl, dev, host = build("write_back")
    put(tree, dev, seq(0, 4))
    child = put(tree, dev, seq(0, 8)).last_node
    parent = child.parent
    assert tree.write_backup(child) == 0 and not child.backed_up  # parent not backed up yet
    assert tree.write_backup(parent) == 4
    assert tree.write_backup(child) == 4
    tree.writing_check(block=True)
    tree.check_invariants()


def test_write_back_eviction_backs_up_unbacked_ancestors_first():
    tree, ctl, dev, host = build("write_back")
    put(tree, dev, seq(0, 4))
    child = put(tree, dev, seq(0, 8)).last_node
    parent = child.parent
    tree.evict_node(child)
    assert child.backed_up and parent.backed_up and parent.on_device and not child.on_device
    tree.check_invariants()


def test_device_eviction_is_lru_and_demotes_or_deletes():
    for policy, demoted in (("write_through", True), ("write_through_selective", False)):
        tree, ctl, dev, host = build(policy)
        a, b, c = seq(0, 4), seq(100, 4), seq(200, 4)
        na, nb, nc = (put(tree, dev, t).last_node for t in (a, b, c))
        tree.writing_check(block=True)
        tree.match_prefix(a)  # a is now most recent; b is the oldest
        assert tree.evict(4) == 4
        assert not nb.on_device and na.on_device and nc.on_device
        assert (nb in set(tree.nodes())) == demoted
        assert tree.evict(4) == 4
        assert not nc.on_device and na.on_device
        tree.check_invariants()


def test_locked_nodes_survive_eviction_and_bad_unlocks_raise():
    tree, ctl, dev, host = build("write_through")
    na = put(tree, dev, seq(0, 8)).last_node
    nb = put(tree, dev, seq(100, 8)).last_node
    tree.writing_check(block=True)
    tree.inc_lock_ref(na)
    assert tree.protected_size() == 8 and tree.evictable_size() == 8
    assert tree.evict(100) == 8
    assert na.on_device and not nb.on_device
    with pytest.raises(ValueError, match="locked"):
        tree.evict_node(na)
    assert na.on_device
    tree.dec_lock_ref(na)
    with pytest.raises(ValueError, match="below zero"):
        tree.dec_lock_ref(na)
    assert na.lock_ref == 0 and tree.evictable_size() == 8
    tree.check_invariants()


def test_host_eviction_only_of_evicted_unlocked_nodes():
    tree, ctl, dev, host = build("write_through")
    na = put(tree, dev, seq(0, 8)).last_node
    nb = put(tree, dev, seq(100, 8)).last_node
    tree.writing_check(block=True)
    assert tree.evict_host(100) == 0  # both still on device
    tree.evict(100)
    tree.inc_host_lock(na)
    with pytest.raises(ValueError, match="locked"):
        tree.evict_host_node(na)
    free0 = host.available_size()
    assert tree.evict_host(100) == 8
    assert na in set(tree.nodes()) and nb not in set(tree.nodes())
    assert host.available_size() == free0 + 8
    tree.dec_host_lock(na)
    with pytest.raises(ValueError, match="below zero"):
        tree.dec_host_lock(na)
    assert tree.evict_host(100) == 8 and not list(tree.nodes())
    tree.check_invariants()


def test_host_only_insert_sparse_flow():
    """A sparse request offloads its KV to host itself and inserts host-only; a later
    request reuses the host prefix; duplicates are reported, identical slots are not."""
    tree, ctl, dev, host = build("write_through")
    toks = seq(0, 16)
    kv = expected(toks)
    hs = host.alloc(16)
    for layer in range(LAYERS):
        host.write_tokens(layer, hs, kv[layer, 0], kv[layer, 1])
    res = tree.insert(toks, host_indices=hs)
    assert res.host_unused.numel() == 0 and not res.last_node.on_device
    tree.inc_host_lock(res.last_node)
    m = tree.match_prefix(toks + seq(500, 8))
    assert m.device_hit_length == 0 and m.host_hit_length == 16 and m.backed_length == 16
    assert torch.equal(read_host(host, m.backed_host_indices), kv)
    # a second request: reuse the 16-token host prefix, offload 8 new tokens itself
    toks2 = toks + seq(500, 8)
    new = host.alloc(8)
    kv2 = expected(toks2)
    for layer in range(LAYERS):
        host.write_tokens(layer, new, kv2[layer, 0, 16:], kv2[layer, 1, 16:])
    res2 = tree.insert(toks2, host_indices=torch.cat([m.backed_host_indices, new]))
    assert res2.host_unused.numel() == 0
    # same tokens with other host slots: the tree keeps its own, reports ours
    other = host.alloc(8)
    res3 = tree.insert(toks[:8], host_indices=other)
    assert torch.equal(res3.host_unused, other)
    host.free(res3.host_unused)
    # host-locked pages survive host eviction
    tree.evict_host(10_000)
    m = tree.match_prefix(toks)
    assert m.backed_length == 16 and torch.equal(read_host(host, m.backed_host_indices), kv)
    tree.dec_host_lock(res.last_node)
    tree.check_invariants()


def test_device_insert_adopts_slots_for_host_only_nodes():
    tree, ctl, dev, host = build("write_through")
    toks = seq(0, 8)
    node = put(tree, dev, toks).last_node
    tree.writing_check(block=True)
    tree.evict(8)
    assert not node.on_device
    slots = dev.allocator.alloc(8)
    prefill(dev, toks, slots)
    res = tree.insert(toks, device_indices=slots)
    assert res.device_unused.numel() == 0 and res.prefix_len == 0
    assert node.on_device and torch.equal(node.device_indices, slots)
    # inserting again: everything already on device, our copy is unused
    slots2 = dev.allocator.alloc(8)
    res = tree.insert(toks, device_indices=slots2)
    assert res.prefix_len == 8 and torch.equal(res.device_unused, slots2)
    tree.check_invariants()


def test_split_of_node_with_write_in_flight():
    tree, ctl, dev, host = build("write_through")
    toks = seq(0, 12)
    node = put(tree, dev, toks).last_node
    assert node.write_ack is not None
    tree.match_prefix(toks[:4] + [7777] * 4)  # splits the in-flight node
    top = node.parent
    assert top.write_ack == node.write_ack and top.lock_ref == 1
    tree.writing_check(block=True)
    assert top.write_ack is None and node.write_ack is None and top.lock_ref == 0 and node.lock_ref == 0
    assert torch.equal(read_host(host, torch.cat([top.host_indices, node.host_indices])), expected(toks))
    tree.check_invariants()


def test_load_back_makes_room_by_evicting_and_respects_quota():
    tree, ctl, dev, host = build("write_through", dev_pages=6)  # 5 usable pages = 20 tokens
    a, b = seq(0, 12), seq(100, 12)
    na = put(tree, dev, a).last_node
    tree.writing_check(block=True)
    tree.evict(12)
    nb = put(tree, dev, b).last_node
    tree.writing_check(block=True)
    m = tree.match_prefix(a)
    assert m.host_hit_length == 12
    assert tree.load_back(m.last_host_node, mem_quota=8) is None  # over the quota
    assert nb.on_device
    slots = tree.load_back(m.last_host_node)  # needs 12 tokens, 8 free: demotes b
    assert slots is not None and na.on_device and not nb.on_device and nb.backed_up
    tree.ready_to_load_host_cache()
    tree.loading_check(block=True)
    assert torch.equal(read_device(dev, slots), expected(a))
    tree.check_invariants()


def test_stats_counts_hits_per_tier_and_evictions():
    tree, ctl, dev, host = build("write_through")
    toks = seq(0, 8)
    put(tree, dev, toks)
    tree.writing_check(block=True)
    tree.match_prefix(toks)
    tree.evict(8)
    tree.match_prefix(toks + seq(90, 4))
    s = tree.stats()
    assert s["device_hit_tokens"] == 8 and s["host_hit_tokens"] == 8 and s["miss_tokens"] == 4
    assert s["device_evicted_tokens"] == 8 and s["device_demoted_tokens"] == 8
    assert s["bytes_d2h"] == 8 * dev.spec.token_bytes and s["writes_in_flight"] == 0
    assert s["host_tokens"] == 8 and s["device_tokens"] == 0


def test_page_size_one_and_kernel_backend_roundtrip():
    tree, ctl, dev, host = build("write_through", page_size=1, dev_pages=32, io="kernel", layout="page_first")
    toks = seq(3, 5)
    node = put(tree, dev, toks).last_node
    tree.writing_check(block=True)
    tree.evict(5)
    m = tree.match_prefix(toks[:3] + [0])
    assert m.host_hit_length == 3
    slots, last = tree.init_load_back(m.last_host_node)
    tree.ready_to_load_host_cache()
    tree.loading_check(block=True)
    assert torch.equal(read_device(dev, slots), expected(toks[:3]))
    assert node in set(tree.nodes())
    tree.check_invariants()


def test_from_config_builds_host_pool_and_policy():
    from hicache.config import HiCacheConfig

    spec = KVCacheSpec("mha", LAYERS, HEADS, DIM, torch.float32, 4)
    dev = DeviceKVPool(spec, 64, "cpu")
    cfg = HiCacheConfig(page_size=4, hicache_ratio=3.0, hicache_write_policy="write_through_selective",
                        hicache_io_backend="direct", hicache_mem_layout="page_first_direct")
    tree = HiRadixTree.from_config(cfg, dev)
    assert tree.write_policy == "write_through_selective" and tree.write_through_threshold == 2
    assert tree.controller.host_pool.layout == "page_first_direct" and tree.controller.host_num_slots == 192
    put(tree, dev, seq(0, 8))
    m = tree.match_prefix(seq(0, 8))
    tree.writing_check(block=True)
    assert torch.equal(read_host(tree.controller.host_pool, m.backed_host_indices), expected(seq(0, 8)))
    with pytest.raises(ValueError, match="page-size"):
        HiRadixTree.from_config(HiCacheConfig(page_size=8), dev)
    tree.close()
