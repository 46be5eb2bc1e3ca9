"""L3 under tensor parallelism: 2 CPU processes over gloo on 127.0.0.1, each rank with its
own backend (MHA: rank-suffixed keys). Ranks that see different L3 hits, different fetch
progress, a read that hangs on one rank only, or different write completion still reserve,
insert, lock and release alike."""
from __future__ import annotations

import os
import socket
import threading
import time

import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _shape(tree):
    out = []
    for n in tree.nodes():
        path, x = [], n
        while x is not tree.root:
            path.append(x.key)
            x = x.parent
        out.append((tuple(reversed(path)), n.on_device, n.backed_up, n.lock_ref, n.host_lock_ref, n.in_storage))
    return sorted(out)


def _same_everywhere(obj) -> bool:
    objs = [None, None]
    dist.all_gather_object(objs, obj)
    return objs[0] == objs[1]


def _worker(rank: int, port: int) -> None:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        from hicache.storage.base import StorageConfig
        from hicache.storage.keys import page_hash_chain, storage_key
        from hicache.storage_controller import StoragePolicy
        from l3_kit import PS, build, empty_tiers, expected, put, read_host, wait_until
        from memory_storage import MemoryStorage

        toks = list(range(2000, 2064))  # 16 pages
        s = MemoryStorage(StorageConfig(tp_rank=rank, tp_size=2))
        policy = StoragePolicy(prefetch_policy="best_effort", prefetch_threshold=8, io_batch_pages=2)
        tree, dev, host = build(s, policy)

        # writes: rank 1's backend is slow; neither rank retires the write before both have it
        if rank == 1:
            s.set_gate = threading.Event()
        res = put(tree, dev, toks)
        tree.writing_check(block=True)
        if rank == 0:
            wait_until(lambda: tree.storage_ctl.backup_acks_ready() == 1)
        else:
            wait_until(lambda: s.set_waiting == 1)
        tree.check_hicache_events()
        assert res.last_node.host_lock_ref == 1 and not res.last_node.in_storage
        assert _same_everywhere(_shape(tree))
        if rank == 1:
            s.set_gate.set()
        tree.flush_storage()
        assert res.last_node.host_lock_ref == 0 and res.last_node.in_storage
        assert set(s.objects) == {storage_key(h, rank) for h in page_hash_chain(toks, PS)}  # own keys
        assert _same_everywhere(_shape(tree))

        # rank 1 lost page 10: both ranks fetch the agreed 10 pages
        if rank == 1:
            del s.objects[storage_key(page_hash_chain(toks, PS)[10], 1)]
        empty_tiers(tree)
        m = tree.match_prefix(toks)
        # best effort with different progress: rank 0 has all its pages, rank 1 only 4
        if rank == 1:
            s.get_gate, s.block_after = threading.Event(), s.pages_read + 4
        assert tree.prefetch_from_storage("a", m.last_backed_node, toks) == 64  # reserved; L3 is asked later
        op = tree.ongoing_prefetch["a"]
        wait_until(lambda: op.planned_pages is not None)
        assert op.planned_pages == (16 if rank == 0 else 10)  # each rank's own existence check
        if rank == 1:
            wait_until(lambda: op.completed_pages == 4)
        else:
            wait_until(lambda: op.done)
        dist.barrier()
        assert tree.check_prefetch_progress("a")
        m = tree.match_prefix(toks)
        assert m.backed_length == 16, m.backed_length
        assert bool((read_host(host, m.backed_host_indices) == expected(toks[:16])).all())
        assert _same_everywhere(_shape(tree))
        if rank == 1:
            s.get_gate.set()
        wait_until(lambda: op.done)
        dist.barrier()
        tree.check_hicache_events()
        assert tree.storage_leaks() == 0 and tree.stats()["prefetch_reserved_pages"] == 0
        assert _same_everywhere(_shape(tree))

        # wait_complete: nobody settles while one rank is still fetching
        assert tree.detach_storage_backend() is s
        tree.attach_storage_backend(s, StoragePolicy(prefetch_policy="wait_complete", prefetch_threshold=8,
                                                     io_batch_pages=2))
        empty_tiers(tree)
        if rank == 1:
            s.get_gate, s.block_after = threading.Event(), s.pages_read + 2
        m = tree.match_prefix(toks)
        assert tree.prefetch_from_storage("b", m.last_backed_node, toks) == 64
        op = tree.ongoing_prefetch["b"]
        if rank == 0:
            wait_until(lambda: op.done)
        else:
            wait_until(lambda: op.completed_pages == 2)
        for _ in range(3):
            assert not tree.check_prefetch_progress("b")
        if rank == 1:
            s.get_gate.set()
        assert tree.wait_prefetch("b", 10)
        deadline = time.monotonic() + 10
        while not tree.check_prefetch_progress("b"):  # the same number of calls on both ranks
            assert time.monotonic() < deadline
        m = tree.match_prefix(toks)
        assert m.backed_length == 40
        assert bool((read_host(host, m.backed_host_indices) == expected(toks[:40])).all())
        assert _same_everywhere(_shape(tree))
        tree.check_invariants()
        assert tree.storage_leaks() == 0 and tree.stats()["prefetch_reserved_pages"] == 0

        # a read that hangs on rank 1 only: both ranks end the fetch at its deadline, adopt the
        # same pages and have every other page of the reservation back while it still hangs
        assert tree.detach_storage_backend() is s
        tree.attach_storage_backend(s, StoragePolicy(prefetch_policy="wait_complete", prefetch_threshold=8,
                                                     io_batch_pages=2, backend_call_timeout_s=0.5))
        empty_tiers(tree)
        alloc = host.allocator
        free0 = alloc.num_free_pages()
        hang = threading.Event()
        if rank == 1:
            s.get_gate, s.block_after = hang, s.pages_read + 4  # the third batch never returns
        m = tree.match_prefix(toks)
        assert tree.prefetch_from_storage("c", m.last_backed_node, toks) == 64
        deadline = time.monotonic() + 10
        while not tree.check_prefetch_progress("c"):
            assert time.monotonic() < deadline
        st = tree.stats()
        assert st["l3_stages_retired"] == (1 if rank == 1 else 0) and st["l3_call_timeouts"] == rank
        assert tree.match_prefix(toks).backed_length == 16 and alloc.num_free_pages() == free0 - 4
        assert tree.storage_leaks() == 0 and st["prefetch_reserved_pages"] == 0 and not tree._orphans
        assert _same_everywhere(_shape(tree))
        hang.set()  # the late read lands in its staging buffer only
        wait_until(lambda: tree.storage_ctl.calls.abandoned == 0 and tree.stats()["l3_stages_retired"] == 0)
        dist.barrier()
        tree.check_storage_events()
        m = tree.match_prefix(toks)
        assert m.backed_length == 16 and alloc.num_free_pages() == free0 - 4
        assert bool((read_host(host, m.backed_host_indices) == expected(toks[:16])).all())
        assert _same_everywhere(_shape(tree))
        tree.check_invariants()
        assert tree.storage_leaks() == 0
        tree.close()
    finally:
        dist.destroy_process_group()


def test_two_ranks_agree_on_l3_over_gloo():
    mp.spawn(_worker, args=(_free_port(),), nprocs=2, join=True)
