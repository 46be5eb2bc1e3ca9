"""HiCacheController (queues, worker thread, acks, layer-wise loads) and LayerLoadCounter.
CPU tests run the same code path with synchronous copies; GPU tests check the stream path."""
from __future__ import annotations

import threading

import pytest
import torch

from hicache.config import HiCacheConfig
from hicache.controller import HiCacheController
from hicache.device_pool import DeviceKVPool
from hicache.host_pool import HostKVPool
from hicache.kv_spec import KVCacheSpec
from hicache.layer_sync import LayerLoadCounter
from hicache.radix_tree import HiRadixTree
from hicache.transfer import KVTransferEngine

LAYERS, HEADS, DIM, PS = 3, 2, 4, 4


def pools(device="cpu", layout="layer_first", dev_pages=16):
    spec = KVCacheSpec("mha", LAYERS, HEADS, DIM, torch.float32, PS)
    dev = DeviceKVPool(spec, dev_pages * PS, device)
    host = HostKVPool(dev, hicache_ratio=2.0, layout=layout)
    return dev, host


def fill(dev, slots, seed):
    g = torch.Generator().manual_seed(seed)
    for layer in range(LAYERS):
        k = torch.randn(slots.numel(), HEADS, DIM, generator=g)
        v = torch.randn(slots.numel(), HEADS, DIM, generator=g)
        dev.set_kv(layer, slots, k.to(dev.device), v.to(dev.device))


def dev_rows(dev, slots):
    return torch.stack([torch.stack([b[slots.to(dev.device)].cpu() for b in dev.layer_buffers(l)])
                        for l in range(LAYERS)])


def host_rows(host, slots):
    return torch.stack([torch.stack(host.read_tokens(l, slots.cpu())) for l in range(LAYERS)])


class GatedTransfer:
    """Real copies (through the real engine), but completion is reported only once
    ``gate`` is set: models a transfer still in flight on the copy stream."""

    def __init__(self, engine: KVTransferEngine):
        self.engine = engine
        self.gate = threading.Event()

    def _wrap(self, handle):
        gate = self.gate
        outer = self

        class H:
            def done(self):
                return gate.is_set() and handle.done()

            def wait_layer(self, layer):
                handle.wait_layer(layer)

        outer.last = handle
        return H()

    def backup(self, *a, **k):
        return self._wrap(self.engine.backup(*a, **k))

    def load(self, *a, **k):
        return self._wrap(self.engine.load(*a, **k))


def test_write_and_load_roundtrip_through_acks():
    dev, host = pools()
    ctl = HiCacheController(dev, host, io_backend="direct")
    d = dev.allocator.alloc(8)
    fill(dev, d, 0)
    h = host.alloc(8)
    ctl.write(d, h, ack_id=5)
    assert ctl.write_acks_ready() == 0 and ctl.stats()["write_queue_depth"] == 1
    assert ctl.start_writing() == 8
    ctl.wait_writes()
    assert ctl.write_acks_ready() == 1 and ctl.pop_write_ack() == [5]
    assert torch.equal(host_rows(host, h), dev_rows(dev, d))
    d2 = dev.allocator.alloc(8)
    ctl.load(h, d2, ack_id=6)
    ctl.load(h[:4], dev.allocator.alloc(4), ack_id=7)
    pid = ctl.start_loading()
    assert pid == 0 and ctl.layer_counter.consumer == 0 and ctl.layer_counter.outstanding() == 1
    ctl.wait_loads()
    assert ctl.pop_load_ack() == [6, 7]
    assert ctl.layer_counter.outstanding() == 0
    assert torch.equal(dev_rows(dev, d2), dev_rows(dev, d))
    s = ctl.stats()
    assert s["bytes_d2h"] == 8 * dev.spec.token_bytes and s["bytes_h2d"] == 12 * dev.spec.token_bytes
    assert ctl.start_loading() == -1 and ctl.start_writing() == 0
    ctl.close()


def test_in_flight_write_keeps_lock_until_ack():
    dev, host = pools()
    gated = GatedTransfer(KVTransferEngine(dev, host, "direct"))
    ctl = HiCacheController(dev, host, "write_through", "direct", transfer=gated)
    tree = HiRadixTree(ctl)
    d = dev.allocator.alloc(8)
    fill(dev, d, 1)
    node = tree.insert(list(range(8)), device_indices=d).last_node
    assert tree.writing_check() == 0  # issued, not finished
    assert node.lock_ref == 1 and node.write_ack is not None
    assert tree.evict(8) == 0 and node.on_device  # cannot evict a node being written
    assert tree.stats()["writes_in_flight"] == 1
    gated.gate.set()
    ctl.wait_writes()
    assert tree.writing_check() == 1 and node.lock_ref == 0
    assert tree.evict(8) == 8 and node.backed_up and not node.on_device
    tree.check_invariants()
    ctl.close()


def test_in_flight_load_keeps_chain_locked_until_ack():
    dev, host = pools()
    gated = GatedTransfer(KVTransferEngine(dev, host, "direct"))
    gated.gate.set()
    ctl = HiCacheController(dev, host, "write_through", "direct", transfer=gated)
    tree = HiRadixTree(ctl)
    d = dev.allocator.alloc(8)
    fill(dev, d, 2)
    ref = dev_rows(dev, d)
    node = tree.insert(list(range(8)), device_indices=d).last_node
    tree.writing_check(block=True)
    tree.evict(8)
    gated.gate.clear()
    m = tree.match_prefix(list(range(8)))
    slots, _ = tree.init_load_back(m.last_host_node)
    tree.ready_to_load_host_cache()
    assert tree.loading_check() == 0 and node.loading and node.lock_ref == 1
    assert tree.evict(8) == 0 and tree.evict_host(8) == 0
    gated.gate.set()
    ctl.wait_loads()
    assert tree.loading_check() == 1 and not node.loading and node.lock_ref == 0
    assert torch.equal(dev_rows(dev, slots), ref)
    ctl.close()


def test_worker_error_is_acked_as_failed_not_raised():
    dev, host = pools()

    class Broken:
        def backup(self, *a, **k):
            class H:
                def done(self):
                    raise RuntimeError("copy engine fault")
            return H()

    ctl = HiCacheController(dev, host, io_backend="direct", transfer=Broken())
    ctl.write(dev.allocator.alloc(4), host.alloc(4), 1)
    ctl.start_writing()
    ctl.wait_writes()  # the fault comes back through the ack, the scheduler keeps running
    batch = ctl.pop_write_result()
    assert batch.ack_ids == [1] and batch.ok is False and "copy engine fault" in str(batch.error)
    assert ctl.stats()["write_batches_failed"] == 1 and ctl.last_error is batch.error
    ctl.close()


class FaultyEngine(KVTransferEngine):
    """The real engine with injected faults: ``fail`` holds "backup" / "load" while that
    direction should fail, raising at issue (``when="issue"``) or when the worker polls
    the finished copy (``when="complete"``, after the real copy ran)."""

    def __init__(self, *a, when: str = "issue", **k):
        super().__init__(*a, **k)
        self.fail: set[str] = set()
        self.when = when

    def _maybe_fail(self, kind, run):
        if kind not in self.fail:
            return run()
        if self.when == "issue":
            raise RuntimeError(f"injected {kind} fault")
        run()

        class Failed:
            def done(self):
                raise RuntimeError(f"injected {kind} fault")

            def wait_layer(self, layer):
                pass

        return Failed()

    def backup(self, *a, **k):
        return self._maybe_fail("backup", lambda: super(FaultyEngine, self).backup(*a, **k))

    def load(self, *a, **k):
        return self._maybe_fail("load", lambda: super(FaultyEngine, self).load(*a, **k))


def faulty_tree(when="issue", policy="write_through"):
    dev, host = pools()
    eng = FaultyEngine(dev, host, "direct", when=when)
    ctl = HiCacheController(dev, host, policy, "direct", transfer=eng)
    return HiRadixTree(ctl), ctl, eng, dev, host


@pytest.mark.parametrize("when", ["issue", "complete"])
def test_failed_backup_frees_host_slots_and_leaves_node_device_only(when):
    tree, ctl, eng, dev, host = faulty_tree(when)
    host_free = host.available_size()
    d = dev.allocator.alloc(8)
    fill(dev, d, 4)
    ref = dev_rows(dev, d)
    eng.fail.add("backup")
    node = tree.insert(list(range(8)), device_indices=d).last_node
    assert node.write_ack is not None and node.lock_ref == 1
    tree.writing_check(block=True)
    assert not node.backed_up and node.on_device and node.write_ack is None and node.lock_ref == 0
    assert host.available_size() == host_free and tree.host_tokens() == 0
    assert tree.stats()["write_failures"] == 1
    tree.check_invariants()
    eng.fail.clear()
    tree.match_prefix(list(range(8)))  # the next hit writes again
    tree.writing_check(block=True)
    assert tree.backup_complete(node) and torch.equal(host_rows(host, node.host_indices), ref)
    tree.evict(8)
    m = tree.match_prefix(list(range(8)))
    assert m.host_hit_length == 8
    slots, _ = tree.init_load_back(m.last_host_node)
    tree.loading_check(block=True)
    assert torch.equal(dev_rows(dev, slots), ref)
    tree.check_invariants()
    ctl.close()


def test_failed_backup_drops_host_copies_below_it():
    tree, ctl, eng, dev, host = faulty_tree()
    host_free = host.available_size()
    d = dev.allocator.alloc(8)
    eng.fail.add("backup")
    a = tree.insert(list(range(8)), device_indices=d).last_node  # write queued, not issued
    h = host.alloc(16)  # a sparse request offloaded a longer prompt: adopted host-only below a
    res = tree.insert(list(range(16)), host_indices=h)
    host.free(res.host_unused)
    assert res.last_node.parent is a and not res.last_node.on_device
    tree.writing_check(block=True)
    assert not a.backed_up and not a.children and host.available_size() == host_free
    tree.check_invariants()
    ctl.close()


def test_failed_backup_under_a_host_lock_is_retried():
    tree, ctl, eng, dev, host = faulty_tree()
    d = dev.allocator.alloc(8)
    fill(dev, d, 5)
    ref = dev_rows(dev, d)
    eng.fail.add("backup")
    a = tree.insert(list(range(8)), device_indices=d).last_node
    tree.inc_host_lock(a)  # someone reads its host pages: they must end up valid
    tree.writing_check(block=True)
    assert a.backed_up and a.write_ack is not None and a.lock_ref == 1
    assert tree.stats()["write_retries"] == 1
    tree.check_invariants()
    eng.fail.clear()
    tree.writing_check(block=True)  # issues the retry
    tree.writing_check(block=True)
    assert tree.backup_complete(a) and a.lock_ref == 0
    assert torch.equal(host_rows(host, a.host_indices), ref)
    tree.dec_host_lock(a)
    ctl.close()


def _demoted(tree, dev, seed):
    d = dev.allocator.alloc(8)
    fill(dev, d, seed)
    ref = dev_rows(dev, d)
    node = tree.insert(list(range(8)), device_indices=d).last_node
    tree.writing_check(block=True)
    tree.evict(8)
    assert node.backed_up and not node.on_device
    return node, ref


@pytest.mark.parametrize("when", ["issue", "complete"])
def test_failed_load_frees_device_slots_and_keeps_host_copy(when):
    tree, ctl, eng, dev, host = faulty_tree(when)
    node, ref = _demoted(tree, dev, 6)
    dev_free = dev.allocator.available_size()
    eng.fail.add("load")
    m = tree.match_prefix(list(range(8)))
    slots, last = tree.init_load_back(m.last_host_node)
    assert slots.numel() == 8 and node.loading
    tree.ready_to_load_host_cache()
    tree.loading_check(block=True)
    assert not node.on_device and node.backed_up and not node.loading and node.lock_ref == 0
    assert dev.allocator.available_size() == dev_free and tree.stats()["load_failures"] == 1
    tree.check_invariants()
    eng.fail.clear()
    m = tree.match_prefix(list(range(8)))
    assert m.device_hit_length == 0 and m.host_hit_length == 8  # a miss on device, not wrong KV
    slots, _ = tree.init_load_back(m.last_host_node)
    tree.loading_check(block=True)
    assert torch.equal(dev_rows(dev, slots), ref)
    ctl.close()


def test_failed_load_of_a_held_node_is_never_matched_and_dropped_on_unlock():
    tree, ctl, eng, dev, host = faulty_tree()
    node, ref = _demoted(tree, dev, 7)
    dev_free = dev.allocator.available_size()
    eng.fail.add("load")
    m = tree.match_prefix(list(range(8)))
    slots, last = tree.init_load_back(m.last_host_node)
    tree.inc_lock_ref(last)  # the request that asked for it
    tree.loading_check(block=True)
    assert node.on_device and tree.stats()["stale_nodes"] == 1
    m = tree.match_prefix(list(range(8)))
    assert m.total_hit_length == 0  # never handed out again
    tree.check_invariants()
    tree.dec_lock_ref(last)
    assert not node.on_device and node.backed_up and dev.allocator.available_size() == dev_free
    assert tree.stats()["stale_nodes"] == 0
    tree.check_invariants()
    eng.fail.clear()
    m = tree.match_prefix(list(range(8)))
    slots, _ = tree.init_load_back(m.last_host_node)
    tree.loading_check(block=True)
    assert torch.equal(dev_rows(dev, slots), ref)
    ctl.close()


def test_layer_counter_waits_only_for_the_asked_layer():
    calls = []

    class H:
        def __init__(self, name):
            self.name = name

        def wait_layer(self, layer):
            calls.append((self.name, layer))

    c = LayerLoadCounter(4)
    a, b, cc = c.register(H("a")), c.register(H("b")), c.register(H("c"))
    c.set_consumer(b)
    c.wait_until(2)
    assert calls == [("a", 2), ("b", 2)]  # not the later producer c, not other layers
    c.release(a)
    calls.clear()
    c.wait_until(0)
    assert calls == [("b", 0)]
    with pytest.raises(ValueError, match="layer"):
        c.wait_until(4)
    with pytest.raises(ValueError, match="producer"):
        c.set_consumer(7)
    with pytest.raises(ValueError, match="num_layers"):
        LayerLoadCounter(0)


def test_controller_rejects_bad_arguments():
    dev, host = pools()
    with pytest.raises(ValueError, match="write_policy"):
        HiCacheController(dev, host, write_policy="lazy")
    with pytest.raises(ValueError, match="io_backend"):
        HiCacheController(dev, host, io_backend="dma")
    ctl = HiCacheController(dev, host, io_backend="direct")
    with pytest.raises(ValueError, match="same length"):
        ctl.write(dev.allocator.alloc(8), host.alloc(4), 1)
    cfg = HiCacheConfig(page_size=PS, hicache_mem_layout="page_first")
    with pytest.raises(ValueError, match="hicache-mem-layout"):
        HiCacheController.from_config(cfg, dev, host)
    with pytest.raises(ValueError, match="page-size"):
        HiCacheController.from_config(HiCacheConfig(page_size=8), dev, host)
    ok = HiCacheController.from_config(HiCacheConfig(page_size=PS, hicache_write_policy="write_back"), dev, host)
    assert ok.write_policy == "write_back" and ok.io_backend == "kernel"
    ctl.close()
    ok.close()


def _gpu_flow(layout: str, io: str) -> None:
    dev, host = pools("cuda", layout=layout, dev_pages=64)
    ctl = HiCacheController(dev, host, "write_through", io)
    tree = HiRadixTree(ctl)
    toks = list(range(40))
    d = dev.allocator.alloc(40)
    fill(dev, d, 3)  # on the current (compute) stream, right before the write is issued
    ref = dev_rows(dev, d)
    node = tree.insert(toks, device_indices=d).last_node
    tree.writing_check(block=True)
    assert torch.equal(host_rows(host, node.host_indices), ref)
    tree.evict(40)
    dev.kv_data.zero_()
    m = tree.match_prefix(toks)
    slots, _ = tree.init_load_back(m.last_host_node)
    tree.ready_to_load_host_cache()
    for layer in range(LAYERS):
        ctl.layer_counter.wait_until(layer)
        got = torch.stack([b[slots] for b in dev.layer_buffers(layer)]).cpu()  # read on current stream
        assert torch.equal(got, ref[layer]), f"layer {layer} not ready after wait_until"
    tree.loading_check(block=True)
    assert node.lock_ref == 0 and not node.loading
    tree.check_invariants()
    ctl.close()


@pytest.mark.gpu
@pytest.mark.parametrize("layout,io", [("layer_first", "kernel"), ("page_first", "kernel"),
                                       ("layer_first", "direct"), ("page_first_direct", "direct")])
def test_gpu_tree_flow_layerwise(layout, io):
    _gpu_flow(layout, io)
