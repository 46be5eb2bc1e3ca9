"""The host-backed allocator over SGLang 0.5.23's real allocators, KV pools and KV index
translator (CPU; SGLang's translation kernels under the Triton interpreter).

The scheduler allocates virtual slots (the host pool's), every allocation maps its pages
to GPU pages and every free gives them back; SGLang's own translator, switched by the
plugin, turns the virtual slots a forward writes and reads into GPU slots.
"""
from __future__ import annotations

import pytest

pytest.importorskip("sglang.srt.plugins", reason="SGLang is not installed (run scripts/setup_sglang_env.sh)")

import torch  # noqa: E402
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.kv_index_translator import KVIndexTranslator  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool  # noqa: E402
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode  # noqa: E402

from hicache.residency import KVResidency  # noqa: E402
from sparsehi.sglang_plugin import sglang_api  # noqa: E402
from sparsehi.sglang_plugin.host_backed_allocator import host_backed_allocator_class, is_host_backed  # noqa: E402


def _alloc(virtual: int = 64, physical_pages: int = 16, page: int = 1):
    kv = MHATokenToKVPool(physical_pages * page, page, torch.float32, 2, 8, 2, "cpu", False)
    base = TokenToKVPoolAllocator if page == 1 else PagedTokenToKVPoolAllocator
    cls, args, kwargs = sglang_api.allocator_class_args(
        base(8 * page, torch.float32, "cpu", kv, False) if page == 1 else base(8 * page, page, torch.float32, "cpu", kv,
                                                                                 False), virtual)
    alloc = host_backed_allocator_class(cls)(*args, **kwargs)
    res = KVResidency(virtual // page, physical_pages - 1, "cpu")
    alloc.bind_residency(res, settle_tag=lambda: None)
    return alloc, res, kv


def test_allocations_map_gpu_pages_and_frees_return_them():
    alloc, res, _ = _alloc()
    assert is_host_backed(alloc) and isinstance(alloc, TokenToKVPoolAllocator)
    ids = alloc.alloc(10)
    assert ids is not None and alloc.available_size() == 64 - 10  # the scheduler's count is virtual
    assert (res.v2p[ids] > 0).all()
    assert res.counts()["resident"] == 10
    alloc.free(ids[:4])
    assert (res.v2p[ids[:4]] == 0).all() and (res.v2p[ids[4:]] > 0).all()
    assert alloc.available_size() == 64 - 6
    res.check()


def test_free_groups_release_gpu_pages_at_the_group_end():
    alloc, res, _ = _alloc()
    ids = alloc.alloc(6)
    alloc.free_group_begin()
    alloc.free(ids[:3])
    assert (res.v2p[ids[:3]] > 0).all()  # deferred, as SGLang defers the slots
    alloc.free_group_end()
    assert (res.v2p[ids[:3]] == 0).all()
    res.check()


def test_short_gpu_pages_refuse_the_allocation_and_keep_the_virtual_slots_free():
    alloc, res, _ = _alloc(virtual=64, physical_pages=9)  # 8 GPU pages
    a = alloc.alloc(8)
    assert a is not None
    before = alloc.available_size()
    assert alloc.alloc(1) is None  # no GPU page left
    assert alloc.available_size() == before
    res.demote(a[:2])  # GPU pages given back on the device: the exact count finds them
    b = alloc.alloc(2)
    assert b is not None and (res.v2p[b] > 0).all()
    res.check()


def test_capacity_hooks_count_gpu_tokens():
    alloc, res, _ = _alloc(virtual=64, physical_pages=9)
    alloc.alloc(6)
    assert alloc.gpu_tokens_free() == 2
    assert alloc.check_decode_capacity(num_tokens=2, tree_cache=None)
    assert not alloc.check_decode_capacity(num_tokens=3, tree_cache=None)
    # a prompt longer than the GPU pages can never be prefilled
    assert alloc.max_new_tokens_for_memory(9, 16, token_capacity=64, sliding_window_size=None, chunk_size=None) is None
    got = alloc.max_new_tokens_for_memory(4, 16, token_capacity=64, sliding_window_size=None, chunk_size=None)
    assert got == 16
    # a continuing chunk gets a token of reserve, so SGLang checks it against the budget
    assert alloc.request_slot_reserve(has_req_pool_slot=True, prefill_tokens=5) == 1
    assert alloc.request_slot_reserve(has_req_pool_slot=False, prefill_tokens=5) == 0


def test_prefill_budget_is_capped_by_gpu_tokens():
    alloc, res, _ = _alloc(virtual=64, physical_pages=9)
    tree = type("Tree", (), {"evictable_size": lambda self: 20, "supports_mamba": lambda self: False})()
    budget = alloc.create_prefill_budget(tree)
    assert budget.remaining_total == 8  # virtual 64 + 20 evictable, GPU 8
    budget.reserve(3, 2)  # what the round admits counts against it (3 + a page + 2 new tokens)
    assert budget.remaining_total == 2
    alloc.alloc(5)
    assert alloc.create_prefill_budget(tree).remaining_total == 3  # the next round


def test_paged_allocator_maps_only_new_pages():
    alloc, res, _ = _alloc(virtual=64, physical_pages=9, page=4)
    assert isinstance(alloc, PagedTokenToKVPoolAllocator)
    pre = torch.tensor([0])
    ids = alloc.alloc_extend(pre, pre, torch.tensor([6]), torch.tensor([6]), torch.tensor([-1]), 6)
    assert ids is not None and res.counts()["resident"] == 2
    last = ids[-1:]
    more = alloc.alloc_decode(torch.tensor([7]), torch.tensor([7]), last)  # same page
    assert res.counts()["resident"] == 2 and int(more[0]) == int(last[0]) + 1
    seq = torch.tensor([9])
    alloc.alloc_extend(torch.tensor([7]), torch.tensor([7]), seq, seq, more, 2)  # opens a third page
    assert res.counts()["resident"] == 3
    alloc.free(ids)
    assert res.counts()["resident"] == 1
    res.check()


def test_translator_switched_by_the_plugin_reads_and_writes_gpu_slots():
    """SGLang's own KVIndexTranslator, built for the plain pool and switched with
    ``make_translating``: a forward's plan binds GPU write slots, and its read stream (the
    triton backend's kv_indices, SGLang's kernel under the interpreter) is the GPU slot of
    every virtual slot of the rows."""
    alloc, res, kv = _alloc(virtual=64, physical_pages=33)
    rp = ReqToTokenPool(4, 32, "cpu", False)
    t = KVIndexTranslator(req_to_token=rp.req_to_token, token_to_kv_pool_allocator=alloc, token_to_kv_pool=kv,
                          page_size=1, device="cpu")
    assert not t.is_translating
    sglang_api.make_translating(t, alloc)
    junk = alloc.alloc(5)  # the GPU slots are not the virtual ones any more
    alloc.free(junk[::2])
    ids = alloc.alloc(7)
    rp.req_to_token[2, :7] = ids.to(torch.int32)
    fb = ForwardBatch(forward_mode=ForwardMode.EXTEND, batch_size=1, input_ids=torch.zeros(7, dtype=torch.long),
                      req_pool_indices=torch.tensor([2]), seq_lens=torch.tensor([7]), out_cache_loc=ids,
                      seq_lens_sum=7, seq_lens_cpu=torch.tensor([7]))
    plan = t.own_plan(fb)
    plan.bind(fb, t)
    want = res.v2p[ids]
    assert torch.equal(fb.out_cache_loc, want) and torch.equal(fb.out_cache_loc_virtual, ids)
    assert not torch.equal(want, ids)
    out = torch.zeros(7, dtype=torch.int64)
    assert t.pack_read_stream(plan, req_pool_indices=torch.tensor([2]), seq_lens=torch.tensor([7]),
                              indptr=torch.tensor([0, 7], dtype=torch.int32), out=out)
    assert torch.equal(out, want)
    # a page off the GPU reads the padding slot 0, never another request's
    res.demote(ids[:2])
    out.zero_()
    t.pack_read_stream(plan, req_pool_indices=torch.tensor([2]), seq_lens=torch.tensor([7]),
                       indptr=torch.tensor([0, 7], dtype=torch.int32), out=out)
    assert out[:2].tolist() == [0, 0] and torch.equal(out[2:], want[2:])


def test_version_check_names_both_versions():
    assert sglang_api.check_sglang_version("0.5.23") is None
    assert sglang_api.check_sglang_version("0.5.23.post1") is None
    msg = sglang_api.check_sglang_version("0.5.24")
    assert "0.5.24" in msg and "0.5.23" in msg
    assert "not installed" in sglang_api.check_sglang_version(None)
    assert sglang_api.check_sglang_version(sglang_api.installed_sglang_version()) is None  # this environment's


def test_register_refuses_another_version(monkeypatch, caplog):
    import sparsehi.sglang_plugin as plugin

    monkeypatch.setattr(plugin, "installed_sglang_version", lambda: "0.6.0")
    with caplog.at_level("WARNING"):
        assert plugin.register() == []
    assert any("0.6.0" in r.getMessage() and "0.5.23" in r.getMessage() for r in caplog.records)
