"""swap_in_copy_and_table: the copy of the misses and the selection table in one launch
(Triton interpreted on CPU, native on GPU) against the two torch references, MHA pages and
MLA rows, every host layout, padding rows included."""
from __future__ import annotations

import pytest
import torch

from hicache.config import HOST_LAYOUTS
from sparsehi.kernels.swap_in_fused import swap_in_copy_and_table_reference, swap_in_copy_and_table_triton
from test_swap_in_copy import DEV, _lists, _pools


def _table_inputs(b: int, k: int, s: int, sink: int, recent: int, ps: int, seed: int = 2):
    g = torch.Generator().manual_seed(seed)
    pages = torch.tensor([40, 0, 33, 25])[:b]  # row 1: a padding row (no pages)
    topk = torch.full((b, k), -1, dtype=torch.int32)
    valid = torch.zeros(b, dtype=torch.int32)
    slots = torch.full((b, k), -1, dtype=torch.int32)
    for r in range(b):
        n = int(pages[r])
        if n == 0:
            continue
        cand = torch.arange(sink, n - recent)
        v = min(k, cand.numel()) - (r % 2)
        ids = cand[torch.randperm(cand.numel(), generator=g)[:v]].sort().values
        topk[r, :v] = ids.int()
        valid[r] = v
        slots[r, :v] = torch.randperm(s, generator=g)[:v].int()
    seq = (pages - 1).clamp(min=0) * ps + 1 + torch.arange(b) % ps
    sink_t = torch.randint(1, 50, (4, sink), generator=g, dtype=torch.int32)
    ring_t = torch.randint(1, 50, (4, recent), generator=g, dtype=torch.int32)
    return topk, valid, pages.int(), seq.int(), slots, sink_t, ring_t


@pytest.mark.parametrize("layout", HOST_LAYOUTS)
@pytest.mark.parametrize("attention,ps", [("mha", 4), ("mla", 1)])
def test_fused_launch_matches_the_two_references(layout, attention, ps):
    dev, host = _pools(attention, ps, layout)
    load_ids, load_slots, num, rows, host_pages, slot_pages = (a.to(DEV) for a in _lists(host.num_slots // ps,
                                                                                         dev.num_slots // ps))
    topk, valid, npages, seq, slots, sink_t, ring_t = (a.to(DEV) for a in _table_inputs(4, 6, slot_pages.shape[1],
                                                                                        2, 3, ps))
    trows = rows.clamp(min=0)
    kw = dict(sink=2, recent=3, sink_table=sink_t, ring_table=ring_t, device_slots=slots)
    args = (load_ids, load_slots, num, rows, host_pages, slot_pages, ps, topk, valid, npages, seq, trows)
    dev.kv_data.zero_()
    want = swap_in_copy_and_table_reference(host.paged_view(), dev.paged_view(), 1, *args, **kw)
    want_kv = dev.kv_data.clone()
    for bb in (64, 4096):  # runs split pages / several pages per run
        dev.kv_data.zero_()
        got = swap_in_copy_and_table_triton(host.paged_view(), dev.paged_view(), 1, *args, **kw, block_bytes=bb)
        assert torch.equal(dev.kv_data, want_kv), bb
        for name in ("logical", "physical", "page_table", "num_valid", "attended"):
            assert torch.equal(getattr(got, name), getattr(want, name)), (bb, name)
    assert int(want.num_valid[1]) == 0 and (want.logical[1] == -1).all()


def test_mismatched_batches_are_rejected():
    dev, host = _pools("mla", 1, "layer_first")
    load_ids, load_slots, num, rows, host_pages, slot_pages = (a.to(DEV) for a in _lists(host.num_slots,
                                                                                         dev.num_slots))
    topk, valid, npages, seq, slots, sink_t, ring_t = (a.to(DEV) for a in _table_inputs(3, 6, 8, 2, 3, 1))
    with pytest.raises(ValueError):
        swap_in_copy_and_table_triton(host.paged_view(), dev.paged_view(), 0, load_ids, load_slots, num, rows,
                                      host_pages, slot_pages, 1, topk, valid, npages, seq, rows[:3].clamp(min=0),
                                      sink=2, recent=3, sink_table=sink_t, ring_table=ring_t, device_slots=slots)
