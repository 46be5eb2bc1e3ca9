"""sparse-hier with the prefix tree under host-pool pressure: the tree caches every finished
request in the host pool the running requests write, so a run longer than the pool must
evict the tree's least recently used prefixes (and retire finished L3 writes, whose host
locks pin their pages) instead of failing with "host KV pool is full"."""
from __future__ import annotations

import pytest
import torch

from hicache.storage_controller import StoragePolicy
from memory_storage import MemoryStorage
from sparsehi.config import SparseConfig
from sparsehi.runtime.model_config import get_model_config
from sparsehi.runtime.runtime_config import RuntimeConfig
from sparsehi.runtime.runner import ModelRunner
from sparsehi.runtime.weights import build_model

pytestmark = pytest.mark.usefixtures("one_thread")

PS = 4


def _runner(storage=None, host_pages=24):
    model = build_model(config=get_model_config("tiny-gqa", num_layers=2))
    sc = SparseConfig(algorithm="quest", page_size=PS, top_k=2 * PS, device_buffer_size=4 * PS, sink_tokens=PS,
                      recent_tokens=PS, min_sparse_prompt_len=0, dense_layers=(0,), io_backend="direct")
    rt = RuntimeConfig(mode="sparse-hier", sparse=sc, max_num_reqs=2, max_context_len=48,
                       host_kv_tokens=host_pages * PS, host_layout="page_first_direct", storage=storage,
                       storage_policy=StoragePolicy(prefetch_policy="wait_complete", prefetch_threshold=PS)
                       if storage is not None else None)
    return ModelRunner(model, rt)


def _prompts(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 512, (int(torch.randint(9, 30, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


@pytest.mark.parametrize("with_l3", [False, True], ids=["host-only", "l3-writes"])
def test_more_distinct_prompts_than_the_host_pool_holds(with_l3):
    storage = MemoryStorage() if with_l3 else None
    runner = _runner(storage)
    mode = runner.mode
    host = mode.host.allocator
    start_free = host.num_free_pages()
    prompts = _prompts(30)
    assert sum(len(p) for p in prompts) // PS > 3 * host.num_pages  # far more than the pool holds
    for i in range(0, len(prompts), 2):
        runner.generate(prompts[i:i + 2], 3)
        mode.tree.check_invariants()
    st = mode.tree.stats()
    assert st["host_evicted_tokens"] > 0
    if with_l3:
        assert st["l3_pages_written"] > 0 and storage.objects
        mode.tree.flush_storage()
    # every page in use belongs to the tree; evicting it all gives the pool back
    assert start_free - host.num_free_pages() == mode.tree.host_tokens() // PS
    mode.tree.evict_host(10 ** 9)
    assert host.num_free_pages() == start_free
    runner.mode.close()


def test_l3_write_locks_are_released_while_the_run_goes_on():
    """Acknowledged L3 writes are retired at the next request or decode step, not only when
    the run flushes: no host lock outlives its write for long."""
    storage = MemoryStorage()
    runner = _runner(storage, host_pages=64)
    mode = runner.mode
    p1, p2 = _prompts(2, seed=1)
    runner.generate([p1], 2)
    assert mode.tree.storage_ctl.wait_idle(5.0)  # the write finished; its ack is queued
    assert mode.tree.ongoing_backup
    runner.generate([p2], 1)  # the next request's step retires it
    assert mode.tree.storage_ctl.wait_idle(5.0)
    runner.generate([p1], 1)
    assert len(mode.tree.ongoing_backup) <= 1  # only the last request's write can be pending
    runner.mode.close()


def test_room_is_made_from_finished_l3_writes_not_yet_retired():
    """The pool is short and the tree's evictable pages are locked by L3 writes that have
    finished but whose acknowledgements no step has retired yet (nothing is in flight):
    making room retires them and evicts, where it had only waited for writes in flight."""
    storage = MemoryStorage()
    runner = _runner(storage)
    mode = runner.mode
    prompts = _prompts(8, seed=3)
    for i in range(0, len(prompts), 2):
        runner.generate(prompts[i:i + 2], 2)
    ctl = mode.tree.storage_ctl
    assert ctl.wait_idle(5.0) and ctl.in_flight() == 0
    runner.generate(_prompts(1, seed=11), 2)  # a new prompt: its L3 writes are queued
    assert ctl.wait_idle(5.0) and ctl.in_flight() == 0
    assert mode.tree.ongoing_backup  # finished, not retired: their nodes stay locked
    want = mode.host.num_slots - mode.host.available_size()  # every slot the tree holds
    mode._make_host_room(want)
    assert mode.host.available_size() >= want
    mode.tree.check_invariants()
    runner.mode.close()
