"""SparseKVCacheManager invariants over long random decode traces, and bad input."""
from __future__ import annotations

import pytest
import torch

from hicache.device_pool import DeviceKVPool
from hicache.host_pool import HostKVPool
from hicache.kv_spec import KVCacheSpec
from hicache.transfer import KVTransferEngine
from lru_model import naive_lru_step
from sparsehi.config import SparseConfig
from sparsehi.kernels import lru_diff as lru_diff_mod
from sparsehi.decode import SparseDecoder
from sparsehi.kv_manager import SparseKVCacheManager

L, H, D = 2, 2, 4


def make_manager(ps=2, top_k_pages=4, buf_pages=6, sink=1, recent=2, io_backend="direct", layers_sparse=(0, 1),
                 dense_pool_tokens=None):
    cfg = SparseConfig(algorithm="oracle", page_size=ps, top_k=top_k_pages * ps, device_buffer_size=buf_pages * ps,
                       sink_tokens=sink * ps, recent_tokens=recent * ps, min_sparse_prompt_len=0)
    spec = KVCacheSpec("mha", L, H, D, torch.float32, ps)
    dev = DeviceKVPool(spec, ps * 160, "cpu")
    host = HostKVPool(dev, hicache_ratio=3.0, pin_memory=False)
    eng = KVTransferEngine(dev, host, io_backend=io_backend)
    mgr = SparseKVCacheManager(cfg, dev, mode="hierarchical", host_pool=host, transfer=eng,
                               sparse_layers=layers_sparse, max_num_reqs=4, max_context_len=128,
                               dense_pool_tokens=dense_pool_tokens)
    return mgr, SparseDecoder.over(mgr)


class Truth:
    def __init__(self, n_req, seed):
        g = torch.Generator().manual_seed(seed)
        self.k = torch.randn(L, n_req, 128, H, D, generator=g)
        self.v = torch.randn(L, n_req, 128, H, D, generator=g)


def prefill(mgr, truth, rows, prompts):
    ps = mgr.sizes.page_size
    for r in rows:
        mgr.begin_request(r)
    ts = torch.full((len(rows), max(prompts)), -1, dtype=torch.int64)
    for b, (r, n) in enumerate(zip(rows, prompts)):
        ts[b, :n] = mgr.device_pool.allocator.alloc(n)[:n]
        for layer in range(L):
            mgr.device_pool.set_kv(layer, ts[b, :n], truth.k[layer, r, :n], truth.v[layer, r, :n])
    mgr.finish_prefill(rows, prompts, [0] * len(rows), ts)


def begin_decode(mgr, dec, rows, seq):
    """The host part, then the step's device state (what SparseCoordinator.forward_begin runs)."""
    dec.end_step()
    has_dense = mgr.prepare_decode(rows, seq)
    return dec.begin_step(torch.tensor(rows), torch.tensor(seq, dtype=torch.int32), has_dense, mgr.step)


def decode_step(mgr, dec, truth, rows, seq):
    step = begin_decode(mgr, dec, rows, seq)
    pos = torch.tensor(seq) - 1
    for layer in range(L):
        k, v = truth.k[layer, rows, pos], truth.v[layer, rows, pos]
        mgr.device_pool.set_kv(layer, step.out_loc, k, v)
        dec.backup_token(layer, step, k, v)
    return step


def candidates(mgr, seq):
    P = -(-seq // mgr.sizes.page_size)
    cs = min(mgr.sizes.sink, P)
    return cs, max(cs, P - mgr.sizes.recent)


@pytest.mark.parametrize("io_backend", ["direct", "kernel"])
def test_long_random_trace_invariants(io_backend, monkeypatch):
    triton_calls = []
    if io_backend == "kernel":
        # Really run the (interpreted) Triton LRU diff and transfer kernels, not the torch
        # references the CPU dispatch would otherwise pick.
        monkeypatch.setenv("SPARSEHI_FORCE_TRITON", "1")
        real = lru_diff_mod.lru_diff_triton
        monkeypatch.setattr(lru_diff_mod, "lru_diff_triton", lambda *a, **kw: triton_calls.append(1) or real(*a, **kw))
    mgr, dec = make_manager(io_backend=io_backend)
    truth = Truth(3, seed=5)
    rows, seq = [0, 2], [21, 16]
    prefill(mgr, truth, rows, seq)
    ps, S = mgr.sizes.page_size, mgr.sizes.lru_slots
    g = torch.Generator().manual_seed(7)
    naive = {(li, r): ([-1] * S, [-1] * S) for li in range(L) for r in rows}
    prev = {(li, r): [] for li in range(L) for r in rows}
    steps = 30 if io_backend == "direct" else 12
    for _ in range(steps):
        seq = [s + 1 for s in seq]
        step = decode_step(mgr, dec, truth, rows, seq)
        for layer in range(L):
            sel_rows = []
            for r, s in zip(rows, seq):
                cs, ce = candidates(mgr, s)
                n = int(torch.randint(0, min(mgr.sizes.top_k, ce - cs) + 1, (1,), generator=g))
                keep = [x for x in prev[(layer, r)] if x < ce and torch.rand(1, generator=g).item() < 0.8][:n]
                rest = [x for x in (cs + torch.randperm(ce - cs, generator=g)).tolist() if x not in keep]
                ids = keep + rest[: n - len(keep)]
                prev[(layer, r)] = ids
                sel_rows.append(ids)
            topk = torch.full((2, mgr.sizes.top_k), -1, dtype=torch.int32)
            for b, ids in enumerate(sel_rows):
                topk[b, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
            valid = torch.tensor([len(x) for x in sel_rows], dtype=torch.int32)
            ce_t = torch.tensor([candidates(mgr, s)[1] for s in seq], dtype=torch.int32)
            phys = dec.selected_pages(layer, step, topk, valid, ce_t)
            li = dec.sparse_index[layer]
            for b, (r, ids) in enumerate(zip(rows, sel_rows)):
                naive_lru_step(*naive[(li, r)], ids, mgr.step)
                # exact LRU: the manager's buffer holds what the naive model holds, slot for slot
                assert dec.lru.resident[li, r].tolist() == naive[(li, r)][0]
                assert dec.lru.last_used[li, r].tolist() == naive[(li, r)][1]
                res = dec.lru.resident[li, r]
                held = res[res >= 0]
                assert held.unique().numel() == held.numel(), "a slot holds two ids / an id in two slots"
                if not ids:
                    continue
                p = phys[b, : len(ids)]
                assert bool((p >= 0).all())
                # every selected page is resident and its slot holds exactly the host KV of that id
                dev_k, dev_v = mgr.device_pool.layer_buffers(layer)
                slots = (p.long()[:, None] * ps + torch.arange(ps)).reshape(-1)
                lids = torch.tensor(ids)
                hslots = (mgr.tables.host_pages[r, lids].long()[:, None] * ps + torch.arange(ps)).reshape(-1)
                hk, hv = mgr.host_pool.read_tokens(layer, hslots)
                assert torch.equal(dev_k[slots], hk) and torch.equal(dev_v[slots], hv)
                tpos = (lids[:, None] * ps + torch.arange(ps)).reshape(-1)
                assert torch.equal(hk, truth.k[layer, r, tpos]) and torch.equal(hv, truth.v[layer, r, tpos])
        dec.end_step()
    st = dec.stats()
    assert st["steps"] == steps and st["hits"] > 0 and st["misses"] > 0
    if io_backend == "kernel":
        assert len(triton_calls) == steps * L
    assert st["bytes_loaded"] == st["misses"] * mgr.device_pool.spec.page_bytes_per_layer


def _snapshot(mgr, dec):
    return [t.clone() for t in (dec.lru.resident, dec.lru.last_used, dec.lru.slot_of,
                                mgr.device_pool.kv_data)]


def _same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


def test_bad_input_rejected_and_state_unchanged():
    mgr, dec = make_manager()
    truth = Truth(2, seed=1)
    prefill(mgr, truth, [0], [30])
    step = decode_step(mgr, dec, truth, [0], [31])
    cs, ce = candidates(mgr, 31)
    ce_t = torch.tensor([ce], dtype=torch.int32)
    ok = torch.tensor([[cs, cs + 1, -1, -1]], dtype=torch.int32)
    dec.selected_pages(0, step, ok, torch.tensor([2], dtype=torch.int32), ce_t)
    before = _snapshot(mgr, dec)
    cases = {
        "K must be <= S": (torch.full((1, mgr.sizes.lru_slots + 1), -1, dtype=torch.int32), torch.tensor([0], dtype=torch.int32)),
        "beyond": (torch.tensor([[cs, ce, -1, -1]], dtype=torch.int32), torch.tensor([2], dtype=torch.int32)),
        "duplicate": (torch.tensor([[cs + 2, cs + 2, -1, -1]], dtype=torch.int32), torch.tensor([2], dtype=torch.int32)),
        "padding": (torch.tensor([[cs, -1, cs + 3, -1]], dtype=torch.int32), torch.tensor([2], dtype=torch.int32)),
    }
    for msg, (topk, valid) in cases.items():
        with pytest.raises(ValueError, match=msg):
            dec.selected_pages(0, step, topk, valid, ce_t)
        assert _same(before, _snapshot(mgr, dec)), msg
    with pytest.raises(ValueError, match="not a live request"):
        mgr.prepare_decode([3], [5])
    with pytest.raises(ValueError, match="not a live request"):
        mgr.end_request(1)
    with pytest.raises(ValueError, match="not a sparse layer"):
        m2, d2 = make_manager(layers_sparse=(1,))
        prefill(m2, truth, [0], [30])
        s2 = decode_step(m2, d2, truth, [0], [31])
        d2.selected_pages(0, s2, ok, torch.tensor([2], dtype=torch.int32), ce_t)
    assert _same(before, _snapshot(mgr, dec))


def test_prefill_offload_buffers_and_release():
    mgr, dec = make_manager()
    truth = Truth(2, seed=2)
    free0 = mgr.device_pool.allocator.num_free_pages()
    prefill(mgr, truth, [1], [25])  # 13 pages: prompt pages released, buffer pages kept
    used = free0 - mgr.device_pool.allocator.num_free_pages()
    assert used == mgr.sizes.sink + mgr.sizes.recent + mgr.sizes.lru_slots
    req = mgr.reqs[1]
    hs = (torch.tensor(req.host_pages)[:, None] * mgr.sizes.page_size + torch.arange(mgr.sizes.page_size)).reshape(-1)[:25]
    for layer in range(L):
        k, v = mgr.host_pool.read_tokens(layer, hs)
        assert torch.equal(k, truth.k[layer, 1, :25]) and torch.equal(v, truth.v[layer, 1, :25])
        dk, _ = mgr.device_pool.layer_buffers(layer)
        # sink page 0 and the recent ring (pages 11, 12 -> ring slots 1, 0) hold the prompt's KV
        sink = (req.sink_pages[0] * mgr.sizes.page_size + torch.arange(mgr.sizes.page_size))
        assert torch.equal(dk[sink], truth.k[layer, 1, : mgr.sizes.page_size])
        r12 = req.ring_pages[12 % mgr.sizes.recent] * mgr.sizes.page_size
        assert torch.equal(dk[r12], truth.k[layer, 1, 24])
    out = mgr.end_request(1)
    assert torch.equal(out.host_slots, hs)
    assert mgr.device_pool.allocator.num_free_pages() == free0


# --------------------------------------------------------------------------- review fixes
def _alloc_prompts(mgr, truth, rows, prompts):
    ts = torch.full((len(rows), max(prompts)), -1, dtype=torch.int64)
    for b, (r, n) in enumerate(zip(rows, prompts)):
        ts[b, :n] = mgr.device_pool.allocator.alloc(n)[:n]
        for layer in range(L):
            mgr.device_pool.set_kv(layer, ts[b, :n], truth.k[layer, r, :n], truth.v[layer, r, :n])
    return ts


def _free_counts(mgr):
    dense = mgr.dense_pool.allocator.num_free_pages() if mgr.dense_pool is not None else None
    return mgr.device_pool.allocator.num_free_pages(), mgr.host_pool.available_size(), dense


@pytest.mark.parametrize("short", ["device", "dense", "host"])
def test_prefill_out_of_memory_rolls_back(short):
    """Running out of any pool for the second request of a batch gives back every page taken
    for the batch and leaves both requests un-prefilled; after freeing space the same
    prefill succeeds."""
    mgr, dec = make_manager(layers_sparse=(1,), dense_pool_tokens=2 * 40)  # layer 0 dense
    truth = Truth(2, seed=3)
    rows, prompts = [0, 1], [30, 30]  # 15 pages each
    for r in rows:
        mgr.begin_request(r)
    ts = _alloc_prompts(mgr, truth, rows, prompts)
    if short == "device":
        hog = mgr.device_pool.allocator.alloc_pages(mgr.device_pool.allocator.num_free_pages() - (mgr.sizes.sink + mgr.sizes.recent + mgr.sizes.lru_slots) - 1)
        release = lambda: mgr.device_pool.allocator.free_pages(hog)  # noqa: E731
    elif short == "dense":
        hog = mgr.dense_pool.allocator.alloc_pages(mgr.dense_pool.allocator.num_free_pages() - 15 - 1)
        release = lambda: mgr.dense_pool.allocator.free_pages(hog)  # noqa: E731
    else:
        hog = mgr.host_pool.alloc((mgr.host_pool.available_size() // mgr.sizes.page_size - 15 - 1) * mgr.sizes.page_size)
        release = lambda: mgr.host_pool.free(hog)  # noqa: E731
    before = _free_counts(mgr)
    with pytest.raises(RuntimeError, match="out of space.*rolled back"):
        mgr.finish_prefill(rows, prompts, [0, 0], ts)
    assert _free_counts(mgr) == before
    for r in rows:
        req = mgr.reqs[r]
        assert not req.prefilled and req.host_pages == [] and req.dense_pages == [] and req.sink_pages is None
    release()
    mgr.finish_prefill(rows, prompts, [0, 0], ts)
    for r in rows:
        hs = (torch.tensor(mgr.reqs[r].host_pages)[:, None] * mgr.sizes.page_size + torch.arange(mgr.sizes.page_size)).reshape(-1)[:30]
        assert torch.equal(mgr.host_pool.read_tokens(1, hs)[0], truth.k[1, r, :30])


def test_prefill_rejects_duplicate_rows_and_length_mismatch():
    mgr, dec = make_manager()
    mgr.begin_request(0)
    free0 = _free_counts(mgr)
    ts = torch.stack([mgr.device_pool.allocator.alloc(10)[:10] for _ in range(2)])
    free1 = _free_counts(mgr)
    with pytest.raises(ValueError, match="req_pool_indices must be distinct"):
        mgr.finish_prefill([0, 0], [10, 10], [0, 0], ts)
    with pytest.raises(ValueError, match="one entry per batch row"):
        mgr.finish_prefill([0], [10, 10], [0, 0], ts[:1])
    assert _free_counts(mgr) == free1 and not mgr.reqs[0].prefilled
    mgr.device_pool.allocator.free(ts.reshape(-1))
    mgr.end_request(0)
    assert _free_counts(mgr) == free0


def test_prepare_decode_rejects_length_mismatch():
    mgr, dec = make_manager()
    prefill(mgr, Truth(2, seed=4), [0, 1], [9, 12])
    with pytest.raises(ValueError, match="one entry per batch row"):
        mgr.prepare_decode([0, 1], [10])
    assert mgr.step == 0 and [mgr.reqs[r].seq_len for r in (0, 1)] == [9, 12]


def test_dense_layer_copy_gathers_only_the_requests_slots(monkeypatch):
    """The prefill copy into the dense-layer pool must not materialise every slot of the
    big pool for the dense layers (``kv[:, dense_layers]``): only the request's slots."""
    ps = 2
    cfg = SparseConfig(algorithm="oracle", page_size=ps, top_k=4 * ps, device_buffer_size=6 * ps, sink_tokens=ps,
                       recent_tokens=2 * ps)
    spec = KVCacheSpec("mha", 4, 1, 4, torch.float32, ps)
    dev = DeviceKVPool(spec, 1 << 16, "cpu")  # 1 MiB per layer and buffer
    host = HostKVPool(dev, hicache_ratio=2.0, pin_memory=False)
    mgr = SparseKVCacheManager(cfg, dev, mode="hierarchical", host_pool=host,
                               transfer=KVTransferEngine(dev, host, io_backend="direct"), sparse_layers=(2, 3),
                               max_num_reqs=2, max_context_len=64, dense_pool_tokens=128)
    mgr.begin_request(0)
    ts = dev.allocator.alloc(32)[None, :32]
    vals = torch.randn(32, 1, 4)
    for layer in range(4):
        dev.set_kv(layer, ts[0], vals + layer, vals - layer)
    largest = [0]
    orig = torch.Tensor.__getitem__

    def spy(self, idx):
        out = orig(self, idx)
        # Views share the pool's storage (no copy); only new tensors are temporaries.
        if isinstance(out, torch.Tensor) and out.untyped_storage().data_ptr() != self.untyped_storage().data_ptr():
            largest[0] = max(largest[0], out.numel() * out.element_size())
        return out

    monkeypatch.setattr(torch.Tensor, "__getitem__", spy)
    mgr.finish_prefill([0], [32], [0], ts)
    monkeypatch.undo()
    # request data: 2 buffers x 2 dense layers x 32 slots x 4 floats = 2 KiB; the pool slice is 2 MiB
    assert largest[0] <= 64 * 1024, largest[0]
    dk, dv = mgr.dense_pool.layer_buffers(1)
    d_sl = (torch.tensor(mgr.reqs[0].dense_pages)[:, None] * ps + torch.arange(ps)).reshape(-1)[:32]
    assert torch.equal(dk[d_sl], vals + 1) and torch.equal(dv[d_sl], vals - 1)


def test_same_layer_twice_in_one_step_is_rejected():
    mgr, dec = make_manager()
    truth = Truth(1, seed=6)
    prefill(mgr, truth, [0], [30])
    step = decode_step(mgr, dec, truth, [0], [31])
    cs, _ = candidates(mgr, 31)
    topk = torch.tensor([[cs, cs + 1, -1, -1]], dtype=torch.int32)
    valid = torch.tensor([2], dtype=torch.int32)
    dec.selected_pages(0, step, topk, valid)
    before = _snapshot(mgr, dec)
    with pytest.raises(ValueError, match="layer_id=0 already ran its LRU diff"):
        dec.selected_pages(0, step, topk, valid)
    assert _same(before, _snapshot(mgr, dec))
    dec.selected_pages(1, step, topk, valid)  # another layer in the same step is fine
    dec.end_step()
    step = decode_step(mgr, dec, truth, [0], [32])
    dec.selected_pages(0, step, topk, valid)  # the next step is fine
    assert dec.lru.last_used[0, 0].max().item() == 2


def test_stats_history_is_bounded_but_totals_cover_every_step():
    mgr, dec = make_manager()
    dec.STATS_HISTORY = 3
    dec.reset_stats()
    truth = Truth(1, seed=8)
    prefill(mgr, truth, [0], [30])
    seq = 30
    for _ in range(5):
        seq += 1
        step = decode_step(mgr, dec, truth, [0], [seq])
        cs, _ = candidates(mgr, seq)
        ids = [cs + (seq % 5), cs + 5 + (seq % 3)]
        r = dec.selected_pages(0, step, torch.tensor([ids + [-1, -1]], dtype=torch.int32), torch.tensor([2], dtype=torch.int32))
        assert bool((r[0, :2] >= 0).all())
        dec.end_step()
    st = dec.stats()
    assert st["steps"] == 5 and len(st["per_step"]) == 3
    assert [x["step"] for x in st["per_step"]] == [3, 4, 5]
    assert st["hits"] + st["misses"] == 10  # all five steps, not just the kept three
    misses = st["misses"]
    assert st["bytes_loaded"] == misses * mgr.device_pool.spec.page_bytes_per_layer
    assert st["per_layer_hit_rate"][0] == pytest.approx(st["hits"] / 10)


def test_end_request_waits_for_device_to_host_writes(monkeypatch):
    """Decode backups (kernel io backend) are asynchronous on the current stream: the host
    slots handed to the runtime must be complete, so end_request synchronises that stream
    before returning them. (On CPU copies are synchronous; the stream is stood in for.)"""
    mgr, dec = make_manager()
    truth = Truth(1, seed=9)
    prefill(mgr, truth, [0], [12])
    decode_step(mgr, dec, truth, [0], [13])
    events = []

    class Stream:
        def synchronize(self):
            events.append("sync")

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())
    mgr.device = torch.device("cuda", 0)  # only the sync decision reads it in end_request
    out = mgr.end_request(0)
    events.append("returned")
    assert events == ["sync", "returned"]
    assert out.host_slots.shape == (13,)


def test_decode_page_allocation_out_of_space_changes_nothing():
    """A row that opens a page when a pool is full: RuntimeError, every page taken for the
    batch given back, no table, length or step counter moved; after freeing space it works."""
    mgr, dec = make_manager(layers_sparse=(1,), dense_pool_tokens=2 * 64)  # layer 0 dense: three pools take pages
    truth = Truth(2, seed=11)
    prefill(mgr, truth, [0, 1], [20, 24])  # both open a page at the next token (page size 2)
    hog = mgr.host_pool.alloc(mgr.host_pool.available_size() - mgr.sizes.page_size)  # room for one page only
    before = (_free_counts(mgr), mgr.step, mgr.tables.host_pages.clone(), mgr.tables.dense_pool_pages.clone(),
              [mgr.reqs[r].seq_len for r in (0, 1)])
    with pytest.raises(RuntimeError, match="host pool is out of space"):
        mgr.prepare_decode([0, 1], [21, 25])
    after = (_free_counts(mgr), mgr.step, mgr.tables.host_pages, mgr.tables.dense_pool_pages, [mgr.reqs[r].seq_len for r in (0, 1)])
    assert before[0] == after[0] and before[1] == after[1] and before[4] == after[4]
    assert torch.equal(before[2], after[2]) and torch.equal(before[3], after[3])
    mgr.host_pool.free(hog)
    step = decode_step(mgr, dec, truth, [0, 1], [21, 25])
    assert int(step.num_pages[0]) == 11 and mgr.reqs[0].host_pages[10] >= 1


def test_deferred_page_entries_match_the_written_tables():
    """With defer_page_entries (the runtime's decode graph writes them), prepare_decode
    leaves the device tables alone and hands out exactly the entries that the immediate
    path writes: applied with table_scatter they give the same tables."""
    from sparsehi.kernels.table_scatter import table_scatter

    tabs = {}
    for defer in (False, True):
        mgr, dec = make_manager(layers_sparse=(1,), dense_pool_tokens=4 * 64)
        mgr.tables.defer_entries = defer
        prefill(mgr, Truth(2, seed=3), [0, 1], [20, 24])  # both open a page at the next token
        before = [t.clone() for t in mgr.tables.entry_tables()]
        mgr.prepare_decode([0, 1], [21, 25])
        ents = mgr.tables.take_entries()
        if defer:
            assert ents is not None and len(ents) == 4  # host and dense-pool page of two rows
            assert all(torch.equal(a, b) for a, b in zip(before, mgr.tables.entry_tables()))  # nothing written yet
            table_scatter(torch.from_numpy(ents).to(mgr.device), mgr.tables.entry_tables())
            assert mgr.tables.take_entries() is None  # taken once
        else:
            assert ents is None
        tabs[defer] = [t.clone() for t in mgr.tables.entry_tables()]
    assert all(torch.equal(a, b) for a, b in zip(tabs[False], tabs[True]))
    assert not torch.equal(tabs[True][0], before[0])  # the host page table did change
