"""Kernels that read a sparse layer's selection with a per-row choice (``RowChoice``: rows
that do not use the algorithm's Top-k read the plain candidate list) give exactly what they
give on the substituted selection the coordinator used to build with two ``torch.where``s:
the LRU diff, the selection table (hierarchical, own pages, buffer slots) and the fused copy
and table, Triton (interpreted on CPU, native on GPU) and torch references alike. The side a
row does not use holds garbage (repeated and out-of-range ids, counts beyond K), so a
kernel that read it would give another result."""
from __future__ import annotations

import pytest
import torch

from hicache.config import HOST_LAYOUTS
from sparsehi.kernels.lru_diff import LruDiffResult, lru_diff_reference, lru_diff_triton
from sparsehi.kernels.selection_table import selection_table_reference, selection_table_triton
from sparsehi.kernels.swap_in_fused import swap_in_copy_and_table_reference, swap_in_copy_and_table_triton
from sparsehi.row_choice import RowChoice
from test_selection_table import _case
from test_swap_in_copy import DEV, _lists, _pools
from test_swap_in_fused import _table_inputs

# Triton reads CPU tensors under the interpreter only (no CUDA); a GPU runs the cuda params
DEVICES = [pytest.param("cpu", marks=pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter on CPU only")),
           pytest.param("cuda", marks=pytest.mark.gpu)]


def split(topk: torch.Tensor, valid: torch.Tensor, use: torch.Tensor, seed: int):
    """``(sel, val, choice)`` with ``choice.apply(sel, val) == (topk, valid)``: rows with
    ``use`` hold the selection in ``sel``/``val``, the others in the choice's ids/count; the
    unused side of every row is garbage."""
    g = torch.Generator().manual_seed(seed)
    b, k = topk.shape
    junk = torch.randint(-3, 60, (b, k), generator=g, dtype=torch.int32)
    junk[:, 1::2] = junk[:, :1]  # repeated ids
    junk_n = torch.randint(-2, k + 4, (b,), generator=g, dtype=torch.int32)
    u = use[:, None]
    sel, val = torch.where(u, topk, junk), torch.where(use, valid, junk_n)
    ids, count = torch.where(u, junk.flip(1), topk), torch.where(use, junk_n + 1, valid)
    return sel, val, RowChoice(use, ids.contiguous(), count)


def _diff_state(rows: int, s: int, m: int, dev: str):
    return [torch.full((rows, s), -1, dtype=torch.int32, device=dev),
            torch.full((rows, s), -1, dtype=torch.int32, device=dev),
            torch.full((rows, m), -1, dtype=torch.int32, device=dev)]


def _diff_steps(b: int, k: int, m: int, steps: int, seed: int):
    """Per step a batch of ascending ids (valid then -1) drawn from ``[0, m)``, distinct but
    for a repeat in row 0 every other step."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        topk = torch.full((b, k), -1, dtype=torch.int32)
        valid = torch.randint(0, k + 1, (b,), generator=g, dtype=torch.int32)
        for r in range(b):
            n = int(valid[r])
            topk[r, :n] = torch.randperm(m, generator=g)[:n].sort().values.int()
        if int(valid[0]) >= 2 and len(out) % 2:
            topk[0, 1] = topk[0, 0]  # unvalidated input: a repeated id (the diff's exact path)
        out.append((topk, valid))
    return out


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("helpers,miss_side", [(0, False), (1, True), (1, False)])
def test_lru_diff_with_a_row_choice_matches_the_substituted_selection(dev, helpers, miss_side):
    b, k, s, m = 5, 6, 8, 20
    rows = torch.tensor([2, 0, -1, 3, 1], device=dev)  # batch row 2 pads
    st_ref, st_new = _diff_state(4, s, m, dev), _diff_state(4, s, m, dev)
    loads = 0
    for step, (topk, valid) in enumerate(_diff_steps(b, k, m, 6, seed=helpers + 2 * miss_side), start=1):
        use = torch.tensor([step % 2 == 0, True, step % 3 == 0, False, step % 2 == 1])
        sel, val, choice = split(topk, valid, use, seed=step)
        want = lru_diff_reference(topk.to(dev), valid.to(dev), *st_ref, step, rows=rows)
        c = RowChoice(*(x.to(dev) for x in (choice.use, choice.ids, choice.count)))
        out = LruDiffResult(*(torch.empty(b, k, dtype=torch.int32, device=dev) for _ in range(3)),
                            torch.empty(b, dtype=torch.int32, device=dev), torch.empty(b, dtype=torch.int32, device=dev))
        got = lru_diff_triton(sel.to(dev), val.to(dev), *st_new, step, rows=rows, out=out, helpers=helpers,
                              miss_side=miss_side, choice=c)
        for name in ("device_slots", "load_ids", "load_slots", "num_loads", "num_valid"):
            assert torch.equal(getattr(got, name), getattr(want, name)), (step, name)
        for a, x in zip(st_ref, st_new):
            assert torch.equal(a, x), step
        loads += int(want.num_loads.sum())
    assert loads > 0


def test_lru_diff_reference_with_a_row_choice_is_the_substituted_selection():
    b, k, s, m = 5, 6, 8, 20
    st_a, st_b = _diff_state(5, s, m, "cpu"), _diff_state(5, s, m, "cpu")
    for step, (topk, valid) in enumerate(_diff_steps(b, k, m, 3, seed=9), start=1):
        sel, val, choice = split(topk, valid, torch.tensor([True, False, True, False, False]), seed=step)
        a = lru_diff_reference(topk, valid, *st_a, step)
        c = lru_diff_reference(sel, val, *st_b, step, choice=choice)
        for name in ("device_slots", "load_ids", "load_slots", "num_loads", "num_valid"):
            assert torch.equal(getattr(a, name), getattr(c, name)), (step, name)


def test_a_mismatched_row_choice_is_rejected():
    topk = torch.zeros(2, 3, dtype=torch.int32)
    valid = torch.zeros(2, dtype=torch.int32)
    st = _diff_state(2, 4, 8, "cpu")
    bad = {"use": RowChoice(torch.ones(2, dtype=torch.int32), topk, valid),
           "ids": RowChoice(torch.ones(2, dtype=torch.bool), torch.zeros(2, 4, dtype=torch.int32), valid),
           "count": RowChoice(torch.ones(2, dtype=torch.bool), topk, torch.zeros(3, dtype=torch.int32))}
    for name, choice in bad.items():
        with pytest.raises(ValueError, match=f"RowChoice.{name}"):
            lru_diff_reference(topk, valid, *st, 1, choice=choice)


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("hier,slots", [(True, False), (True, True), (False, False)])
def test_selection_table_with_a_row_choice_matches_the_substituted_selection(dev, hier, slots):
    args, kw = _case(4, hier)
    if slots:
        kw["topk_phys"] = kw["topk_phys"] % 9
        kw["slot_table"] = torch.randint(1, 1000, (8, 9), generator=torch.Generator().manual_seed(4), dtype=torch.int32)
    topk, valid = args[0], args[1]
    sel, val, choice = split(topk, valid, torch.tensor([False, True, False, True, True, False]), seed=7)
    rest = tuple(a.to(dev) for a in args[2:])
    kw = {k: (v.to(dev) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    c = RowChoice(*(x.to(dev) for x in (choice.use, choice.ids, choice.count)))
    want = selection_table_reference(topk.to(dev), valid.to(dev), *rest, **kw)
    got = selection_table_triton(sel.to(dev), val.to(dev), *rest, **kw, choice=c)
    ref = selection_table_reference(sel.to(dev), val.to(dev), *rest, **kw, choice=c)
    for name in ("logical", "physical", "page_table", "num_valid", "attended"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
        assert torch.equal(getattr(ref, name), getattr(want, name)), name


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("layout", [HOST_LAYOUTS[0], HOST_LAYOUTS[-1]])
def test_fused_copy_and_table_with_a_row_choice_matches_the_substituted_selection(dev, layout):
    if dev != DEV:
        pytest.skip(f"the pools of test_swap_in_copy live on {DEV}")
    ps = 4
    pool, host = _pools("mha", ps, layout)
    load_ids, load_slots, num, rows, host_pages, slot_pages = (a.to(DEV) for a in _lists(host.num_slots // ps,
                                                                                         pool.num_slots // ps))
    topk, valid, npages, seq, slots, sink_t, ring_t = _table_inputs(4, 6, slot_pages.shape[1], 2, 3, ps)
    sel, val, choice = split(topk, valid, torch.tensor([True, False, False, True]), seed=3)
    c = RowChoice(*(x.to(DEV) for x in (choice.use, choice.ids, choice.count)))
    kw = dict(sink=2, recent=3, sink_table=sink_t.to(DEV), ring_table=ring_t.to(DEV), device_slots=slots.to(DEV))
    head = (load_ids, load_slots, num, rows, host_pages, slot_pages, ps)
    tail = (npages.to(DEV), seq.to(DEV), rows.clamp(min=0))
    pool.kv_data.zero_()
    want = swap_in_copy_and_table_reference(host.paged_view(), pool.paged_view(), 1, *head, topk.to(DEV),
                                            valid.to(DEV), *tail, **kw)
    want_kv = pool.kv_data.clone()
    for fn in (swap_in_copy_and_table_triton, swap_in_copy_and_table_reference):
        pool.kv_data.zero_()
        got = fn(host.paged_view(), pool.paged_view(), 1, *head, sel.to(DEV), val.to(DEV), *tail, **kw, choice=c)
        assert torch.equal(pool.kv_data, want_kv), fn.__name__
        for name in ("logical", "physical", "page_table", "num_valid", "attended"):
            assert torch.equal(getattr(got, name), getattr(want, name)), (fn.__name__, name)
