"""Tensor-parallel agreement: 2 CPU processes over gloo. Ranks that see different ack
counts or different host capacity must still make identical tree decisions."""
from __future__ import annotations

import os
import socket
import threading

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hicache import tp_sync


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _GatedTransfer:
    """Real copies; completion reported only once ``gate`` is set (a slow rank)."""

    def __init__(self, engine):
        self.engine, self.gate = engine, threading.Event()

    def _wrap(self, h):
        gate = self.gate

        class H:
            def done(self):
                return gate.is_set() and h.done()

            def wait_layer(self, layer):
                h.wait_layer(layer)

        return H()

    def backup(self, *a, **k):
        return self._wrap(self.engine.backup(*a, **k))

    def load(self, *a, **k):
        return self._wrap(self.engine.load(*a, **k))


def _shape(tree):
    """Rank-independent description of the tree (what every rank must agree on)."""
    out = []
    for n in tree.nodes():
        path, x = [], n
        while x is not tree.root:
            path.append(x.key)
            x = x.parent
        out.append((tuple(reversed(path)), n.on_device, n.backed_up, n.lock_ref, n.write_ack is None))
    return sorted(out)


def _same_everywhere(obj) -> bool:
    objs = [None, None]
    dist.all_gather_object(objs, obj)
    return objs[0] == objs[1]


def _worker(rank: int, port: int) -> None:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        from hicache.controller import HiCacheController
        from hicache.device_pool import DeviceKVPool
        from hicache.host_pool import HostKVPool
        from hicache.kv_spec import KVCacheSpec
        from hicache.radix_tree import HiRadixTree
        from hicache.transfer import KVTransferEngine

        # helpers
        assert tp_sync.agree_min(10 + rank) == 10
        assert tp_sync.agree_min_many([5 - rank, 3 + rank]) == [4, 3]
        assert tp_sync.all_ranks_true(rank == 0) is False
        assert tp_sync.all_ranks_true(True) is True

        spec = KVCacheSpec("mha", 2, 1, 2, torch.float32, 2)
        dev = DeviceKVPool(spec, 64, "cpu")
        # rank 1 has a smaller host pool: its backups fail first
        host = HostKVPool(dev, hicache_ratio=2.0 if rank == 0 else 1.25)
        gated = _GatedTransfer(KVTransferEngine(dev, host, "direct"))
        if rank == 0:
            gated.gate.set()  # rank 0's copies finish at once, rank 1's are slow
        ctl = HiCacheController(dev, host, "write_through", "direct", transfer=gated)
        tree = HiRadixTree(ctl)

        d = dev.allocator.alloc(8)
        node = tree.insert(list(range(8)), device_indices=d).last_node
        ctl.start_writing()
        if rank == 0:
            ctl.wait_writes()
            assert ctl.write_acks_ready() == 1
        # rank 0 has the ack, rank 1 does not: nobody retires it
        assert tree.writing_check() == 0
        assert node.lock_ref == 1 and node.write_ack is not None
        assert _same_everywhere(_shape(tree))
        gated.gate.set()
        tree.writing_check(block=True)
        assert node.lock_ref == 0 and node.write_ack is None
        assert _same_everywhere(_shape(tree))

        # fill the host pools (rank 1's is smaller): every rank must back up and host-evict alike
        for i in range(1, 10):
            dd = dev.allocator.alloc(8)
            if dd is None:
                tree.evict(8)
                dd = dev.allocator.alloc(8)
            tree.insert([100 * i + t for t in range(8)], device_indices=dd)
            tree.writing_check(block=True)
            tree.check_invariants()
            assert _same_everywhere(_shape(tree)), f"trees diverged at insert {i}"
        s = tree.stats()
        assert _same_everywhere((s["backup_tokens"], s["host_evicted_tokens"], s["write_alloc_failures"]))
        assert tp_sync.agree_min(s["host_evicted_tokens"] + s["write_alloc_failures"]) > 0  # pressure happened

        # ranks whose local host hits differ must match and load back the same length
        seq = [7000 + t for t in range(16)]
        for n in (8, 16):
            dd = dev.allocator.alloc(n)
            if dd is None:
                tree.evict(n)
                dd = dev.allocator.alloc(n)
            res = tree.insert(seq[:n], device_indices=dd)
            dev.allocator.free(res.device_unused)
            tree.writing_check(block=True)
        c = res.last_node
        p = c.parent
        assert len(p.key) == 8 and len(c.key) == 8 and tree.backup_complete(c)
        tree.evict_node(c)
        tree.evict_node(p)
        if rank == 1:
            tree.evict_host_node(c)  # only rank 1 lost the second half from host
        local_host_hit = sum(len(x.key) for x in (p, c) if x.backed_up and (x is p or x.parent is p))
        assert local_host_hit == (16 if rank == 0 else 8)
        m = tree.match_prefix(seq)
        assert m.device_hit_length == 0 and m.host_hit_length == 8, m.host_hit_length
        assert _same_everywhere((m.device_hit_length, m.host_hit_length, m.last_host_node.key))
        slots, last = tree.init_load_back(m.last_host_node, m.host_hit_length)
        assert slots.numel() == 8 and last is p
        tree.ready_to_load_host_cache()
        tree.loading_check(block=True)
        tree.check_invariants()
        # load-back from each rank's own deepest host node: still the agreed length
        tree.evict_node(p)
        deepest = c if rank == 0 else p
        slots, last = tree.init_load_back(deepest)
        assert slots.numel() == 8 and last is p and p.on_device
        assert _same_everywhere(slots.numel())
        if rank == 0:
            assert not c.on_device and c.backed_up
        tree.loading_check(block=True)
        tree.check_invariants()
        ctl.close()
    finally:
        dist.destroy_process_group()


def test_two_ranks_agree_over_gloo():
    mp.spawn(_worker, args=(_free_port(),), nprocs=2, join=True)


def test_single_process_passthrough():
    assert tp_sync.world_size() == 1
    assert tp_sync.agree_min(3) == 3 and tp_sync.agree_min_many([1, 2]) == [1, 2]
    assert tp_sync.all_ranks_true(False) is False
