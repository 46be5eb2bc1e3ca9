"""LRU diff kernel: Triton (interpreted on CPU) == torch reference == a naive per-slot
exact-LRU model, on random traces and edge cases (helper programs on and off, sparse stamps
that need the kernel's fallback searches); bad input rejected."""
from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from hypothesis import given, settings, strategies as st

from lru_model import naive_lru_step
from sparsehi.kernels import lru_diff as lru_diff_mod
from sparsehi.kernels.lru_diff import (
    _exclusive_cumsum,
    check_lru_diff_values,
    lru_diff,
    lru_diff_reference,
    lru_diff_triton,
)


@triton.jit
def _scan_probe(x_ptr, o_ptr, N: tl.constexpr, R: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(o_ptr + i, _exclusive_cumsum(tl.load(x_ptr + i), N, R))


# Tests on CPU tensors run the kernel under the Triton interpreter (tests/conftest.py); on
# a CUDA machine Triton cannot read CPU tensors, and the gpu-marked tests below cover the
# compiled kernel (same comparisons, at scale).
interpreted = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tensors via the Triton interpreter")


def new_state(rows: int, s: int, m: int, device="cpu"):
    return {
        "resident": torch.full((rows, s), -1, dtype=torch.int32, device=device),
        "last_used": torch.full((rows, s), -1, dtype=torch.int32, device=device),
        "slot_of": torch.full((rows, m), -1, dtype=torch.int32, device=device),
    }


def clone(state):
    return {k: v.clone() for k, v in state.items()}


def make_topk(rows_ids: list[list[int]], k: int):
    b = len(rows_ids)
    topk = torch.full((b, k), -1, dtype=torch.int32)
    for i, ids in enumerate(rows_ids):
        topk[i, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
    return topk, torch.tensor([len(x) for x in rows_ids], dtype=torch.int32)


def run_both(topk, valid, st_ref, st_tri, step, rows=None, **triton_kw):
    a = lru_diff_reference(topk, valid, st_ref["resident"], st_ref["last_used"], st_ref["slot_of"], step, rows=rows)
    b = lru_diff_triton(topk, valid, st_tri["resident"], st_tri["last_used"], st_tri["slot_of"], step, rows=rows,
                        **triton_kw)
    for name in ("device_slots", "load_ids", "load_slots", "num_loads"):
        assert torch.equal(getattr(a, name), getattr(b, name)), (step, name)
    for name in st_ref:
        assert torch.equal(st_ref[name], st_tri[name]), (step, name)
    return a


def check_consistent(state):
    """Every row holds each id in at most one slot, slot_of finds every resident id, and its
    stale entries (evicted ids) never point at a slot that holds that id."""
    for i in range(state["resident"].shape[0]):
        r = state["resident"][i].cpu()
        held = r[r >= 0]
        assert held.unique().numel() == held.numel(), f"row {i}: an id in two slots: {r.tolist()}"
        so = state["slot_of"][i].cpu()
        assert torch.equal(so[held.long()], torch.nonzero(r >= 0).flatten().int()), f"row {i}: slot_of"
        stale = torch.nonzero(so >= 0).flatten()
        stale = stale[~torch.isin(stale, held.long())]
        assert not bool((r[so[stale].long()] == stale.int()).any()), f"row {i}: stale slot_of entry"


def check_against_naive(res, rows_ids, naive_rows, state=None, step=0):
    for i, ids in enumerate(rows_ids):
        resident, last_used = naive_rows[i]
        dev, lids, lslots = naive_lru_step(resident, last_used, ids, step)
        if state is not None:
            assert state["resident"][i].tolist() == resident and state["last_used"][i].tolist() == last_used
        n = len(ids)
        assert res.device_slots[i, :n].tolist() == dev
        assert (res.device_slots[i, n:] == -1).all()
        nl = int(res.num_loads[i])
        assert nl == len(lids)
        assert res.load_ids[i, :nl].tolist() == lids and res.load_slots[i, :nl].tolist() == lslots
        assert (res.load_ids[i, nl:] == -1).all() and (res.load_slots[i, nl:] == -1).all()


@interpreted
def test_random_trace_matches_naive_lru_and_reference():
    g = torch.Generator().manual_seed(0)
    b, k, s, m = 3, 8, 12, 48
    st_ref, st_tri = new_state(b, s, m), new_state(b, s, m)
    naive_rows = [([-1] * s, [-1] * s) for _ in range(b)]
    prev = [[] for _ in range(b)]
    for step in range(1, 40):
        rows_ids = []
        for i in range(b):
            n = int(torch.randint(0, k + 1, (1,), generator=g))
            keep = [x for x in prev[i] if torch.rand(1, generator=g).item() < 0.7][:n]
            pool = [x for x in torch.randperm(m, generator=g).tolist() if x not in keep]
            ids = keep + pool[: n - len(keep)]
            ids = [ids[j] for j in torch.randperm(len(ids), generator=g).tolist()]
            rows_ids.append(ids)
            prev[i] = ids
        topk, valid = make_topk(rows_ids, k)
        res = run_both(topk, valid, st_ref, st_tri, step)
        check_against_naive(res, rows_ids, naive_rows, st_tri, step)
        check_consistent(st_tri)


@interpreted
@pytest.mark.parametrize("case", ["all_hits", "all_misses", "empty", "exactly_full", "k_equals_s", "padding_rows"])
def test_edge_cases(case):
    k, s, m = 6, 6 if case == "k_equals_s" else 10, 40
    b = 2
    st_ref, st_tri = new_state(b, s, m), new_state(b, s, m)
    naive_rows = [([-1] * s, [-1] * s) for _ in range(b)]
    warm = [[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12]]
    if case == "exactly_full":
        warm = [list(range(i * 10, i * 10 + min(k, s))) for i in range(b)]
    res = run_both(*make_topk(warm, k), st_ref, st_tri, 1)
    check_against_naive(res, warm, naive_rows, st_tri, 1)
    if case == "exactly_full":  # fill the rest of the buffer so every slot holds an id
        extra = [list(range(i * 10 + k, i * 10 + k + (s - k))) for i in range(b)]
        res = run_both(*make_topk(extra, k), st_ref, st_tri, 2)
        check_against_naive(res, extra, naive_rows, st_tri, 2)
        assert bool((st_tri["resident"] >= 0).all())
    nxt = {
        "all_hits": [[6, 5, 4, 3, 2, 1], [12, 7]],
        "all_misses": [[20, 21, 22, 23, 24, 25], [30, 31, 32]],
        "empty": [[], []],
        "exactly_full": [[30, 31, 0, 32], [38, 39, 10]],
        "k_equals_s": [[1, 30, 31, 32, 33, 2], [7, 8, 9, 10, 11, 39]],
        "padding_rows": [[], [7, 20]],
    }[case]
    res = run_both(*make_topk(nxt, k), st_ref, st_tri, 3)
    check_against_naive(res, nxt, naive_rows, st_tri, 3)
    if case == "all_hits":
        assert res.num_loads.tolist() == [0, 0]
    if case == "all_misses":
        assert res.num_loads.tolist() == [6, 3]
    if case == "exactly_full":
        # evictions take the least recently used slots: the ids loaded at step 1 (not reselected)
        evicted_row0 = set(range(0, k)) - {0}
        still = set(st_tri["resident"][0].tolist())
        assert len(evicted_row0 - still) == 3


@interpreted
def test_rows_map_batch_rows_to_state_rows():
    k, s, m = 4, 6, 20
    st_ref, st_tri = new_state(5, s, m), new_state(5, s, m)
    rows = torch.tensor([4, 1], dtype=torch.int64)
    for step, ids in enumerate([[[1, 2, 3], [5]], [[2, 9], [5, 6, 7, 8]], [[10, 11, 12, 13], []]], start=1):
        run_both(*make_topk(ids, k), st_ref, st_tri, step, rows=rows)
    untouched = new_state(5, s, m)
    for name in st_tri:
        for r in (0, 2, 3):
            assert torch.equal(st_tri[name][r], untouched[name][r])


@interpreted
def test_step_as_tensor_and_dispatch_match(monkeypatch):
    # Force the dispatcher onto the (interpreted) Triton kernel: on CPU it would otherwise
    # pick the reference and compare the reference with itself.
    monkeypatch.setenv("SPARSEHI_FORCE_TRITON", "1")
    calls = []
    real = lru_diff_mod.lru_diff_triton
    monkeypatch.setattr(lru_diff_mod, "lru_diff_triton", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    k, s, m = 4, 8, 16
    st1, st2 = new_state(2, s, m), new_state(2, s, m)
    for step, ids in ((7, [[1, 2], [3]]), (9, [[2, 5, 6, 7], [8, 3]])):
        topk, valid = make_topk(ids, k)
        a = lru_diff(topk, valid, st1["resident"], st1["last_used"], st1["slot_of"], torch.tensor([step], dtype=torch.int32))
        b = lru_diff_reference(topk, valid, st2["resident"], st2["last_used"], st2["slot_of"], step)
        for name in ("device_slots", "load_ids", "load_slots", "num_loads"):
            assert torch.equal(getattr(a, name), getattr(b, name)), name
        for name in st1:
            assert torch.equal(st1[name], st2[name]), name
    assert calls == [1, 1]
    assert int(st1["last_used"].max()) == 9


@interpreted
@pytest.mark.parametrize("helpers", [0, 1, 2, 4])
@pytest.mark.parametrize("stride", [1, 5])
@pytest.mark.parametrize("miss_side", [False, True])
def test_helpers_and_sparse_stamps_give_identical_results(helpers, stride, miss_side):
    # stride 5: steps far apart, so the window of consecutive stamp values from the oldest
    # rarely holds the victims and the distinct-minimum rounds run
    k, s, m = 8, 20, 60
    g = torch.Generator().manual_seed(helpers * 10 + stride)
    st_ref, st_tri = new_state(2, s, m), new_state(2, s, m)
    naive_rows = [([-1] * s, [-1] * s) for _ in range(2)]
    prev = [[], []]
    for i in range(1, 16):
        step = i * stride
        rows_ids = []
        for r in range(2):
            n = int(torch.randint(0, k + 1, (1,), generator=g))
            keep = [x for x in prev[r] if torch.rand(1, generator=g).item() < 0.6][:n]
            rest = [x for x in torch.randperm(m, generator=g).tolist() if x not in keep]
            rows_ids.append(keep + rest[: n - len(keep)])
            prev[r] = rows_ids[-1]
        res = run_both(*make_topk(rows_ids, k), st_ref, st_tri, step, helpers=helpers, miss_side=miss_side)
        check_against_naive(res, rows_ids, naive_rows, st_tri, step)


@interpreted
@pytest.mark.parametrize("old_hits", [1, 3, 4, 6])
@pytest.mark.parametrize("miss_side", [False, True])
def test_hits_among_the_oldest_slots(old_hits, miss_side):
    # Step 3 reselects old_hits ids of step 1 (the oldest stamps) next to two new ids: the
    # victims must skip those hits, which the kernel knows per slot only by reading their
    # stamps back.
    k, s, m = 8, 16, 40
    st_ref, st_tri = new_state(1, s, m), new_state(1, s, m)
    naive_rows = [([-1] * s, [-1] * s)]
    for step, ids in ((1, list(range(8))), (2, list(range(8, 16))), (3, list(range(old_hits)) + [20, 21])):
        res = run_both(*make_topk([ids], k), st_ref, st_tri, step, miss_side=miss_side)
        check_against_naive(res, [ids], naive_rows, st_tri, step)
    assert res.num_loads.tolist() == [2]
    assert sorted(res.load_slots[0, :2].tolist()) == res.load_slots[0, :2].tolist()
    assert set(res.load_slots[0, :2].tolist()) == {old_hits, old_hits + 1}


def _fill_one_per_step(s: int, k: int, m: int, steps: list[int]):
    """State after selecting id i alone at steps[i]: slot i holds id i stamped steps[i]."""
    st_ref, st_tri = new_state(1, s, m), new_state(1, s, m)
    naive_rows = [([-1] * s, [-1] * s)]
    for i, step in enumerate(steps):
        res = run_both(*make_topk([[i]], k), st_ref, st_tri, step)
        check_against_naive(res, [[i]], naive_rows, st_tri, step)
    return st_ref, st_tri, naive_rows


@interpreted
@pytest.mark.parametrize("helpers", [0, 1])
@pytest.mark.parametrize("miss_side", [False, True])
def test_every_non_hit_slot_evicted_without_search(helpers, miss_side):
    # K = S, stamps 5 steps apart, two hits among the oldest slots and as many misses as
    # there are non-hit slots: the kernel takes every non-hit slot without searching
    k = s = 8
    st_ref, st_tri, naive_rows = _fill_one_per_step(s, k, 40, [5 * (i + 1) for i in range(s)])
    ids = [0, 3] + list(range(20, 26))
    res = run_both(*make_topk([ids], k), st_ref, st_tri, 100, helpers=helpers, miss_side=miss_side)
    check_against_naive(res, [ids], naive_rows, st_tri, 100)
    assert res.load_slots[0, :6].tolist() == [1, 2, 4, 5, 6, 7]


@interpreted
@pytest.mark.parametrize("hit_old", [False, True])
@pytest.mark.parametrize("miss_side", [False, True])
def test_sparse_stamps_reach_the_bisection(hit_old, miss_side):
    # Empty slots 12-15, single stamps 5..20 at slots 3-6, three ties at 25 in slots 0-2,
    # later stamps above: 9 victims span more distinct stamps than the window (3 values)
    # and the distinct-minimum rounds (4) cover, so the bisection finds T = 25 and takes
    # one of its ties (the lowest slot). With hit_old, the slot stamped 10 is reselected.
    k, s, m = 16, 16, 60
    stamps = [25, 25, 25, 5, 10, 15, 20, 30, 35, 40, 45, 50, -1, -1, -1, -1]
    state = new_state(1, s, m)
    for sl, stamp in enumerate(stamps):
        if stamp >= 0:
            state["resident"][0, sl] = sl
            state["slot_of"][0, sl] = sl
            state["last_used"][0, sl] = stamp
    st_ref, st_tri = clone(state), clone(state)
    naive_rows = [(state["resident"][0].tolist(), state["last_used"][0].tolist())]
    ids = ([4] if hit_old else []) + list(range(30, 39))
    res = run_both(*make_topk([ids], k), st_ref, st_tri, 60, miss_side=miss_side)
    check_against_naive(res, [ids], naive_rows, st_tri, 60)
    victims = [0, 3, 5, 6, 12, 13, 14, 15, 1] if hit_old else [0, 3, 4, 5, 6, 12, 13, 14, 15]
    assert res.load_slots[0, :9].tolist() == sorted(victims)


@interpreted
@pytest.mark.parametrize("miss_side", [False, True])
def test_hits_stamped_early_change_nothing(miss_side):
    # A helper program that finishes before the main program leaves last_used = step on
    # hits (the main program snapshots the row afterwards): same outputs and final state.
    g = torch.Generator().manual_seed(3)
    k, s, m = 8, 14, 50
    st_a = new_state(2, s, m)
    for step in range(1, 9):  # a warm state with stamps and evictions
        ids = [torch.randperm(m, generator=g)[:k].tolist() for _ in range(2)]
        lru_diff_reference(*make_topk(ids, k), st_a["resident"], st_a["last_used"], st_a["slot_of"], step)
    ids = [st_a["resident"][r][st_a["resident"][r] >= 0][:5].tolist() + [45, 46, 47] for r in range(2)]
    st_b = clone(st_a)
    for r in range(2):  # pre-stamp every other hit of each row
        for x in ids[r][:5:2]:
            st_b["last_used"][r, int(st_b["slot_of"][r, x])] = 9
    topk, valid = make_topk(ids, k)
    a = lru_diff_triton(topk, valid, st_a["resident"], st_a["last_used"], st_a["slot_of"], 9, helpers=0,
                        miss_side=miss_side)
    b = lru_diff_triton(topk, valid, st_b["resident"], st_b["last_used"], st_b["slot_of"], 9, helpers=0,
                        miss_side=miss_side)
    for name in ("device_slots", "load_ids", "load_slots", "num_loads"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    for name in st_a:
        assert torch.equal(st_a[name], st_b[name]), name


def states_holding(rows: int, s: int, m: int, row: int, ids: list[int], stamps: list[int]):
    """Two equal states (reference, Triton) whose ``row`` holds ``ids`` in slots 0.. with
    the given (possibly corrupted) stamps."""
    pair = new_state(rows, s, m), new_state(rows, s, m)
    for st in pair:
        st["resident"][row, :len(ids)] = torch.tensor(ids, dtype=torch.int32)
        st["last_used"][row, :len(ids)] = torch.tensor(stamps, dtype=torch.int32)
        st["slot_of"][row, ids] = torch.arange(len(ids), dtype=torch.int32)
    return pair


@interpreted
@pytest.mark.parametrize("miss_side", [False, True])
def test_corrupted_stamps_stay_inside_their_row(miss_side):
    # INT_MIN stamps (a corrupted state; valid steps never produce them) must not make the
    # kernel read or write another batch row's lists or another state row
    k, s, m = 4, 6, 20
    st_ref, st_tri = states_holding(3, s, m, 1, [7, 8, 9], [-2**31, -2**31, 5])
    rows = torch.tensor([0, 1], dtype=torch.int64)
    res = run_both(*make_topk([[3, 4], [9, 11]], k), st_ref, st_tri, 6, rows=rows, miss_side=miss_side)
    assert res.load_ids.tolist() == [[3, 4, -1, -1], [11, -1, -1, -1]]
    untouched = new_state(3, s, m)
    for name in st_tri:
        assert torch.equal(st_tri[name][2], untouched[name][2]), name


@interpreted
@pytest.mark.parametrize("miss_side", [False, True])
def test_stamps_2_31_apart_stay_consistent(miss_side):
    # An INT_MIN stamp (corrupted state) next to a hit stamped near the step limit: the
    # stamp difference wraps in int32. The hit must not count as a miss (it once inflated
    # num_loads and sent installs through stale, reused output buffers).
    k, s, m = 2, 8, 10
    st_ref, st_tri = states_holding(1, s, m, 0, [0, 1], [-2**31, 2**31 - 2**28 + 3])
    topk, valid = make_topk([[1, 5]], k)
    stale = lru_diff_mod.LruDiffResult(*(torch.full((1, k), 7, dtype=torch.int32) for _ in range(3)),
                                       torch.zeros(1, dtype=torch.int32))
    a = lru_diff_reference(topk, valid, st_ref["resident"], st_ref["last_used"], st_ref["slot_of"], 2**31 - 2**28 + 4)
    b = lru_diff_triton(topk, valid, st_tri["resident"], st_tri["last_used"], st_tri["slot_of"], 2**31 - 2**28 + 4,
                        out=stale, helpers=0, miss_side=miss_side)
    assert b.num_loads.tolist() == [1] and b.load_ids.tolist() == [[5, -1]]
    for name in ("device_slots", "load_ids", "load_slots", "num_loads"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    for name in st_ref:
        assert torch.equal(st_ref[name], st_tri[name]), name


def test_step_out_of_range_is_a_clear_error():
    st = new_state(1, 8, 16)
    topk, valid = make_topk([[1]], 2)
    for bad in (2**31 - 1, -1, True):
        with pytest.raises(ValueError, match=r"step must be an int in \[0, "):
            lru_diff_reference(topk, valid, st["resident"], st["last_used"], st["slot_of"], bad)


@st.composite
def consistent_states(draw):
    """A random consistent buffer state (stale reverse-map entries, ties or sparse stamps)
    and a selection biased towards its oldest slots."""
    k = draw(st.integers(1, 8))
    s = k + draw(st.integers(0, 8))
    m = s + draw(st.integers(1, 16))
    seed = draw(st.integers(0, 10_000))
    spread = draw(st.sampled_from([1, 3, 50]))  # ties, close, sparse stamps
    g = torch.Generator().manual_seed(seed)
    occ = int(torch.randint(0, s + 1, (1,), generator=g))
    slots = torch.randperm(s, generator=g)[:occ]
    held = torch.randperm(m, generator=g)[:occ]
    state = new_state(1, s, m)
    state["resident"][0, slots] = held.int()
    state["last_used"][0, slots] = (torch.randint(0, 4, (occ,), generator=g) * spread).int()
    state["slot_of"][0, held] = slots.int()
    free = torch.nonzero(state["slot_of"][0] < 0).flatten()
    stale = free[torch.rand(free.numel(), generator=g) < 0.3]
    state["slot_of"][0, stale] = torch.randint(0, s, (stale.numel(),), generator=g).int()
    state["slot_of"][0, stale] = torch.where(state["resident"][0, state["slot_of"][0, stale].long()] == stale.int(),
                                             -1, state["slot_of"][0, stale])
    order = held[torch.argsort(state["last_used"][0, slots].long() * s + slots)] if occ else held
    n = int(torch.randint(0, k + 1, (1,), generator=g))
    nh = int(torch.randint(0, min(n, occ) + 1, (1,), generator=g))
    hits = order[:nh].tolist() if draw(st.booleans()) else held[torch.randperm(occ, generator=g)[:nh]].tolist()
    others = [x for x in torch.randperm(m, generator=g).tolist() if x not in set(held.tolist())]
    ids = hits + others[: n - nh]
    ids = [ids[j] for j in torch.randperm(len(ids), generator=g).tolist()]
    step = int(state["last_used"].max()) + draw(st.sampled_from([1, 2, 7]))
    return k, state, ids, step, draw(st.sampled_from([0, 1, 2])), draw(st.booleans())


@interpreted
@settings(max_examples=30, deadline=None)
@given(case=consistent_states())
def test_property_arbitrary_states_match_reference_and_naive(case):
    k, state, ids, step, helpers, miss_side = case
    st_ref, st_tri = clone(state), clone(state)
    naive_rows = [(state["resident"][0].tolist(), state["last_used"][0].tolist())]
    res = run_both(*make_topk([ids], k), st_ref, st_tri, step, helpers=helpers, miss_side=miss_side)
    check_against_naive(res, [ids], naive_rows, st_tri, step)


def test_k_greater_than_s_is_a_clear_error():
    st = new_state(1, 4, 16)
    topk, valid = make_topk([[1, 2]], 6)
    for fn in (lru_diff_reference, lru_diff_triton):
        with pytest.raises(ValueError, match="K must be <= S"):
            fn(topk, valid, st["resident"], st["last_used"], st["slot_of"], 1)


def test_bad_dtypes_and_values():
    st = new_state(1, 8, 16)
    topk, valid = make_topk([[1, 2]], 4)
    with pytest.raises(ValueError, match="topk must be"):
        lru_diff_reference(topk.long(), valid, st["resident"], st["last_used"], st["slot_of"], 1)
    with pytest.raises(ValueError, match="valid must be"):
        lru_diff_reference(topk, valid.long(), st["resident"], st["last_used"], st["slot_of"], 1)
    with pytest.raises(ValueError, match="step"):
        lru_diff_reference(topk, valid, st["resident"], st["last_used"], st["slot_of"], -3)
    with pytest.raises(ValueError, match="beyond"):
        check_lru_diff_values(topk, valid, 2)
    dup, dv = make_topk([[3, 3]], 4)
    with pytest.raises(ValueError, match="duplicate"):
        check_lru_diff_values(dup, dv, 16)
    dup, dv = make_topk([[1, 2], [5, 7, 5]], 4)  # (with validation off the kernel serves a repeat)
    with pytest.raises(ValueError, match="row 1 names id 5 twice"):
        check_lru_diff_values(dup, dv, 16)
    bad_pad = torch.tensor([[1, -1, 2, -1]], dtype=torch.int32)
    with pytest.raises(ValueError, match="padding"):
        check_lru_diff_values(bad_pad, torch.tensor([2], dtype=torch.int32), 16)
    with pytest.raises(ValueError, match="valid must lie"):
        check_lru_diff_values(topk, torch.tensor([5], dtype=torch.int32), 16)
    with pytest.raises(ValueError, match="distinct"):
        t2, v2 = make_topk([[1], [2]], 4)
        check_lru_diff_values(t2, v2, 16, rows=torch.tensor([0, 0]))


@interpreted
@settings(max_examples=15, deadline=None)
@given(
    k=st.integers(1, 6), extra=st.integers(0, 5), m=st.integers(6, 24), steps=st.integers(1, 6),
    seed=st.integers(0, 10_000), overlap=st.floats(0.0, 1.0),
)
def test_property_triton_equals_naive(k, extra, m, steps, seed, overlap):
    s = k + extra
    g = torch.Generator().manual_seed(seed)
    st_ref, st_tri = new_state(2, s, m), new_state(2, s, m)
    naive_rows = [([-1] * s, [-1] * s) for _ in range(2)]
    prev = [[], []]
    for step in range(1, steps + 1):
        rows_ids = []
        for i in range(2):
            n = int(torch.randint(0, min(k, m) + 1, (1,), generator=g))
            keep = [x for x in prev[i] if torch.rand(1, generator=g).item() < overlap][:n]
            rest = [x for x in torch.randperm(m, generator=g).tolist() if x not in keep]
            ids = keep + rest[: n - len(keep)]
            rows_ids.append(ids)
            prev[i] = ids
        res = run_both(*make_topk(rows_ids, k), st_ref, st_tri, step)
        check_against_naive(res, rows_ids, naive_rows, st_tri, step)


@pytest.mark.parametrize("n,r", [(1, 1), (2, 2), (16, 2), (8, 4), (8, 8), (64, 8), (256, 1)])
def test_folded_scan_equals_exclusive_cumsum(n, r):
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.randint(0, 3, (n,), dtype=torch.int32, generator=torch.Generator().manual_seed(n)).to(dev)
    out = torch.empty_like(x)
    _scan_probe[(1,)](x, out, N=n, R=r)
    assert torch.equal(out.long(), torch.cumsum(x.long(), 0) - x.long())


@interpreted
@pytest.mark.parametrize("scan_r", [1, 2, 8])
def test_scan_depths_give_identical_results(scan_r):
    k, s, m = 8, 13, 40
    g = torch.Generator().manual_seed(scan_r)
    st_ref, st_tri = new_state(2, s, m), new_state(2, s, m)
    for step in range(1, 6):
        rows_ids = [torch.randperm(m, generator=g)[: int(torch.randint(0, k + 1, (1,), generator=g))].tolist()
                    for _ in range(2)]
        run_both(*make_topk(rows_ids, k), st_ref, st_tri, step, scan_r=scan_r)


def test_bad_scan_r_is_a_clear_error():
    st = new_state(1, 8, 16)
    topk, valid = make_topk([[1, 2]], 4)
    with pytest.raises(ValueError, match="scan_r must be a power of two"):
        lru_diff_triton(topk, valid, st["resident"], st["last_used"], st["slot_of"], 1, scan_r=3)
    with pytest.raises(ValueError, match="helpers must be one of"):
        lru_diff_triton(topk, valid, st["resident"], st["last_used"], st["slot_of"], 1, helpers=3)
    with pytest.raises(ValueError, match="miss_side must be"):
        lru_diff_triton(topk, valid, st["resident"], st["last_used"], st["slot_of"], 1, miss_side=1)


def test_buffer_beyond_kernel_limit_is_a_clear_error():
    st = new_state(1, lru_diff_mod.MAX_SLOTS + 1, 4)
    topk, valid = make_topk([[1]], 2)
    with pytest.raises(ValueError, match="device_buffer_size"):
        lru_diff_reference(topk, valid, st["resident"], st["last_used"], st["slot_of"], 1)


def scale_trace(b: int, k: int, m: int, keep_p: float, steps: int = 20, seed: int = 1, repeat_p: float = 0.0,
                rows: int | None = None):
    """Selections for the GPU scale tests, per step ``(topk [B, K] int32, valid [B] int32)``:
    each row keeps every id of its previous selection with probability ``keep_p`` and draws
    a fresh id otherwise; distinct ids in a random column order, ``k - (row % 7) * 3`` of
    them. With ``repeat_p``, each later column of an odd row repeats an earlier column with
    that probability (even rows stay distinct, so one launch mixes both kinds of row).
    ``rows``: only the first rows, equal to those of the whole trace (the random draws are
    made for all ``b``)."""
    g = torch.Generator().manual_seed(seed)
    n = b if rows is None else min(rows, b)
    cols = torch.arange(k)
    want = (k - (torch.arange(n) % 7) * 3).clamp(min=0)
    odd = (torch.arange(n) % 2 == 1)[:, None]
    prev = torch.randint(0, m, (b, k), generator=g)[:n]
    for _ in range(steps):
        keep = torch.rand(b, k, generator=g)[:n] < keep_p
        cand = torch.where(keep, prev, torch.randint(0, m, (b, k), generator=g)[:n])
        cand = cand[:, torch.randperm(k, generator=g)]
        # first occurrences first, in column order
        first_col = torch.full((n, m), k).scatter_reduce_(1, cand, cols.expand(n, k), "amin")
        first = (first_col.gather(1, cand) == cols).long()
        nfirst = first.sum(1)
        pos = torch.where(first == 1, first.cumsum(1) - 1, nfirst[:, None] + (1 - first).cumsum(1) - 1)
        ids = torch.empty_like(cand).scatter_(1, pos, cand)
        valid = torch.minimum(nfirst, want)
        rep = (torch.rand(b, k, generator=g)[:n] < repeat_p) & (cols >= 1) & odd
        ids = torch.where(rep, ids.gather(1, (torch.rand(b, k, generator=g)[:n] * cols).long()), ids)
        prev = ids
        yield torch.where(cols < valid[:, None], ids, -1).int(), valid.int()


def count_evictions(res, resident_before) -> torch.Tensor:
    """Per row, the loads that went into a slot that held an id."""
    ls = res.load_slots.long()
    return ((ls >= 0) & (resident_before.gather(1, ls.clamp(min=0)) >= 0)).sum(1)


def trace_step(step: int) -> int:
    return step * 4 + step % 3  # gaps between step values: sparse stamps reach the fallbacks


GPU_SCALE_CASES = [  # b, k, s, m, num_warps, scan_r, helpers, keep_p, miss_side
    (64, 2048, 4096, 16384, None, None, None, 0.85, None), (64, 2048, 4096, 16384, 8, 1, 0, 0.85, None),
    (64, 2048, 4096, 16384, 16, 8, 1, 0.85, True), (64, 2048, 4096, 16384, 4, 2, 2, 0.6, None),
    (16, 2048, 8192, 16384, 16, 4, 4, 0.6, None), (16, 2048, 8192, 16384, None, None, None, 0.6, False),
    (128, 2048, 4096, 16384, None, None, None, 0.85, None),
    (64, 512, 4096, 16384, None, None, None, 0.3, None),  # K = S/8: keep 0.85 never filled the buffer
    (8, 1000, 3000, 6000, None, None, None, 0.5, None),  # K, S not powers of two (masked paths)
    (8, 700, 3000, 6000, None, None, None, 0.5, True),
    (4, 2048, 16000, 60000, None, None, 1, 0.3, None),  # the largest buffer the kernel takes (padded to 16384)
    (8, 2048, 2048, 16384, None, None, 1, 0.85, None),  # K = S: every non-hit slot is a victim
    (8, 2048, 2048, 16384, None, None, 1, 0.85, True),
]
GPU_REPEAT_CASES = [  # b, k, s, m, helpers, keep_p, miss_side, repeat_p
    (64, 2048, 4096, 16384, None, 0.6, None, 0.05), (64, 2048, 4096, 16384, 0, 0.6, True, 0.05),
    (128, 512, 4096, 16384, None, 0.3, False, 0.05), (16, 2048, 8192, 16384, 1, 0.6, None, 0.3),
    (8, 2048, 2048, 16384, 1, 0.85, None, 0.05),
]


GPU_TRACES = sorted({(b, k, s, m, kp) for b, k, s, m, *_, kp, _ in GPU_SCALE_CASES}
                    | {(b, k, s, m, kp) for b, k, s, m, _, kp, _, _ in GPU_REPEAT_CASES})


@pytest.mark.parametrize("b,k,s,m,keep_p", GPU_TRACES)
def test_gpu_scale_traces_evict(b, k, s, m, keep_p):
    # The GPU tests assert that their traces evict occupied slots (so the read-back and the
    # fallback searches run compiled); what a trace evicts does not depend on the kernel,
    # so the reference counts it here, on the trace's first rows (odd and even, full and
    # short).
    rows = 3
    st_ref = new_state(min(rows, b), s, m)
    evicted = torch.zeros(min(rows, b), dtype=torch.long)
    for step, (topk, valid) in enumerate(scale_trace(b, k, m, keep_p, rows=rows), start=1):
        before = st_ref["resident"].clone()
        res = lru_diff_reference(topk, valid, st_ref["resident"], st_ref["last_used"], st_ref["slot_of"],
                                 trace_step(step))
        evicted += count_evictions(res, before)
    assert bool((evicted > 0).all()), evicted.tolist()


@pytest.mark.gpu
@pytest.mark.parametrize("b,k,s,m,num_warps,scan_r,helpers,keep_p,miss_side", GPU_SCALE_CASES)
def test_gpu_kernel_matches_reference_at_scale(b, k, s, m, num_warps, scan_r, helpers, keep_p, miss_side):
    # 20 steps with gaps between step values: the buffers fill and then evict occupied
    # slots (asserted), so the read-back and the fallback searches run compiled
    dev = "cuda"
    st_ref, st_tri = new_state(b, s, m, dev), new_state(b, s, m, dev)
    evicted = 0
    for step, (topk, valid) in enumerate(scale_trace(b, k, m, keep_p), start=1):
        before = st_ref["resident"].clone()
        res = run_both(topk.to(dev), valid.to(dev), st_ref, st_tri, trace_step(step), num_warps=num_warps,
                       scan_r=scan_r, helpers=helpers, miss_side=miss_side)
        evicted += int(count_evictions(res, before).sum())
    assert evicted > 0


@pytest.mark.gpu
@pytest.mark.parametrize("b,k,s,m,helpers,keep_p,miss_side,repeat_p", GPU_REPEAT_CASES)
def test_gpu_repeats_match_reference_at_scale(b, k, s, m, helpers, keep_p, miss_side, repeat_p):
    # odd rows repeat ids (the exact path), even rows do not (the fast path), in one launch
    dev = "cuda"
    st_ref, st_tri = new_state(b, s, m, dev), new_state(b, s, m, dev)
    evicted, repeats = 0, 0
    for step, (topk, valid) in enumerate(scale_trace(b, k, m, keep_p, repeat_p=repeat_p), start=1):
        before = st_ref["resident"].clone()
        res = run_both(topk.to(dev), valid.to(dev), st_ref, st_tri, trace_step(step), helpers=helpers,
                       miss_side=miss_side)
        evicted += int(count_evictions(res, before).sum())
        sel = torch.arange(k) < valid[:, None].long()
        repeats += int(sel.sum()) - sum(len(set(r[:n].tolist())) for r, n in zip(topk, valid.tolist()))
        check_consistent(st_tri)
    assert evicted > 0 and repeats > 0


@interpreted
@pytest.mark.parametrize("miss_side", [False, True])
def test_unvalidated_bad_ids_stay_inside_their_row(miss_side):
    k, s, m = 4, 6, 10
    st_ref, st_tri = new_state(3, s, m), new_state(3, s, m)
    rows = torch.tensor([1], dtype=torch.int64)
    topk, valid = make_topk([[2, 50]], k)  # 50 >= M: a caller that skipped validation
    run_both(topk, valid, st_ref, st_tri, 1, rows=rows, miss_side=miss_side)
    fresh = new_state(3, s, m)
    for name in st_tri:
        for r in (0, 2):
            assert torch.equal(st_tri[name][r], fresh[name][r]), name


# --------------------------------------------------------------------------- repeated ids
# Without validation a row may name an id twice; the rule (module docstring of lru_diff): a
# repeat is served by its first column's slot, is not loaded and takes no victim.
both_sides = pytest.mark.parametrize("helpers,miss_side", [(0, False), (1, False), (0, True), (1, True)])


@interpreted
@both_sides
def test_repeated_miss_on_a_fresh_buffer_takes_one_slot(helpers, miss_side):
    # [[3, 3]] on a fresh buffer once gave device_slots [[1, 1]] and left id 3 in two slots
    st_ref, st_tri = new_state(1, 4, 8), new_state(1, 4, 8)
    naive_rows = [([-1] * 4, [-1] * 4)]
    res = run_both(*make_topk([[3, 3]], 2), st_ref, st_tri, 1, helpers=helpers, miss_side=miss_side)
    check_against_naive(res, [[3, 3]], naive_rows, st_tri, 1)
    assert res.device_slots.tolist() == [[0, 0]] and res.num_loads.tolist() == [1]
    assert res.load_ids.tolist() == [[3, -1]] and res.load_slots.tolist() == [[0, -1]]
    assert st_tri["resident"].tolist() == [[3, -1, -1, -1]]
    assert st_tri["last_used"].tolist() == [[1, -1, -1, -1]]
    assert int(st_tri["slot_of"][0, 3]) == 0
    check_consistent(st_tri)


@interpreted
@both_sides
@pytest.mark.parametrize("search", ["window", "every_non_hit", "rounds", "bisection"])
def test_repeated_hits_count_once(search, helpers, miss_side):
    # A full buffer whose slot order is not its LRU order, and a hit named several times
    # next to misses. Counting the repeats as more hit slots made the counts short and the
    # threshold too high: victims were taken in slot order from too many candidates. Each
    # case reaches the threshold search named.
    ids, stamps, sel, victims = {
        # window: stamps 1..2; evicts slot 2 (stamp 1), not slot 0 (stamp 2)
        "window": ([0, 1, 2], [2, 1, 1], [1, 1, 7], [2]),
        # K = S and as many misses as non-hit columns: the no-search branch
        "every_non_hit": ([0, 1, 2, 3], [10, 40, 20, 30], [0, 0, 7, 8], [2, 3]),
        # stamps 5 apart: past the window, distinct-minimum rounds
        "rounds": ([0, 1, 2, 3, 4, 5, 6, 7], [5, 15, 10, 20, 25, 30, 35, 40], [0, 0, 0, 9], [2]),
        # six repeats: more rounds than MAX_ROUNDS, the bisection
        "bisection": ([0, 1, 2, 3, 4, 5, 6, 7], [5, 15, 10, 20, 25, 30, 35, 40], [0] * 6 + [9], [2]),
    }[search]
    k, s, m = len(sel) if search != "rounds" else 4, len(ids), 20
    st_ref, st_tri = states_holding(1, s, m, 0, ids, stamps)
    naive_rows = [(st_ref["resident"][0].tolist(), st_ref["last_used"][0].tolist())]
    res = run_both(*make_topk([sel], k), st_ref, st_tri, 50, helpers=helpers, miss_side=miss_side)
    check_against_naive(res, [sel], naive_rows, st_tri, 50)
    assert res.load_slots[0, :len(victims)].tolist() == victims
    check_consistent(st_tri)


@interpreted
@both_sides
def test_repeated_misses_among_hits_load_each_id_once(helpers, miss_side):
    # hits 2 and 5 (5 repeated), new ids 30 (three times) and 31: two loads, in the order of
    # first columns, and every repeat on its first column's slot
    k, s, m = 8, 10, 40
    st_ref, st_tri = new_state(1, s, m), new_state(1, s, m)
    naive_rows = [([-1] * s, [-1] * s)]
    res = run_both(*make_topk([[1, 2, 3, 4, 5]], k), st_ref, st_tri, 1, helpers=helpers, miss_side=miss_side)
    check_against_naive(res, [[1, 2, 3, 4, 5]], naive_rows, st_tri, 1)
    sel = [5, 30, 5, 2, 30, 30, 31, 2]
    res = run_both(*make_topk([sel], k), st_ref, st_tri, 2, helpers=helpers, miss_side=miss_side)
    check_against_naive(res, [sel], naive_rows, st_tri, 2)
    ds = res.device_slots[0].tolist()
    assert res.num_loads.tolist() == [2] and res.load_ids[0, :2].tolist() == [30, 31]
    assert ds[0] == ds[2] and ds[3] == ds[7] and ds[1] == ds[4] == ds[5] == res.load_slots[0, 0]
    check_consistent(st_tri)


@interpreted
@both_sides
def test_rows_of_one_repeated_id(helpers, miss_side):
    # row 0: one new id in every column; row 1: one resident id in every column; row 2:
    # two ids alternating; across three steps, so the repeats hit, miss and evict
    k, s, m = 6, 8, 30
    st_ref, st_tri = new_state(3, s, m), new_state(3, s, m)
    naive_rows = [([-1] * s, [-1] * s) for _ in range(3)]
    steps = [
        [[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12], [1, 2, 3, 4]],
        [[20] * 6, [8] * 6, [21, 22] * 3],
        [[20] * 6, [23] * 6, [3, 24] * 3],
    ]
    for step, rows_ids in enumerate(steps, start=1):
        res = run_both(*make_topk(rows_ids, k), st_ref, st_tri, step, helpers=helpers, miss_side=miss_side)
        check_against_naive(res, rows_ids, naive_rows, st_tri, step)
        check_consistent(st_tri)
        if step == 2:
            assert res.num_loads.tolist() == [1, 0, 2]
            assert len(set(res.device_slots[0].tolist())) == 1 and len(set(res.device_slots[1].tolist())) == 1
    assert res.num_loads.tolist() == [0, 1, 1]


@interpreted
@both_sides
def test_repeats_and_padding(helpers, miss_side):
    # Columns past valid are padding even when they name a selected id; unvalidated -1
    # inside the valid range is clamped to id 0 and repeats like any id.
    k, s, m = 4, 6, 20
    st_ref, st_tri = new_state(2, s, m), new_state(2, s, m)
    topk = torch.tensor([[5, 5, 5, 5], [-1, 0, -1, 3]], dtype=torch.int32)
    valid = torch.tensor([1, 4], dtype=torch.int32)
    res = run_both(topk, valid, st_ref, st_tri, 1, helpers=helpers, miss_side=miss_side)
    assert res.device_slots.tolist() == [[0, -1, -1, -1], [0, 0, 0, 1]]
    assert res.num_loads.tolist() == [1, 2] and res.load_ids.tolist() == [[5, -1, -1, -1], [0, 3, -1, -1]]
    check_consistent(st_tri)


@interpreted
@both_sides
def test_repeats_are_per_row(helpers, miss_side):
    # an id repeated in one row is an ordinary miss in another (state rows mapped by rows)
    k, s, m = 3, 4, 10
    st_ref, st_tri = new_state(3, s, m), new_state(3, s, m)
    rows = torch.tensor([2, 0], dtype=torch.int64)
    res = run_both(*make_topk([[3, 3, 4], [4, 3]], k), st_ref, st_tri, 1, rows=rows, helpers=helpers,
                   miss_side=miss_side)
    assert res.device_slots.tolist() == [[0, 0, 1], [0, 1, -1]] and res.num_loads.tolist() == [2, 2]
    assert st_tri["resident"][2].tolist() == [3, 4, -1, -1] and st_tri["resident"][0].tolist() == [4, 3, -1, -1]
    assert st_tri["resident"][1].tolist() == [-1] * s
    check_consistent(st_tri)


@interpreted
@both_sides
@pytest.mark.parametrize("sel", [[1, 2, 6], [1, 6, 2, 6]])
def test_a_claim_marker_left_in_slot_of_cannot_win(sel, helpers, miss_side):
    # A corrupted reverse map holding a claim marker (column 0) for an absent id: the id's
    # own claim loses to it, the row takes the exact path, which claims again from -1.
    k, s, m = 4, 6, 10
    st_ref, st_tri = states_holding(1, s, m, 0, [1, 2], [1, 1])
    for st in (st_ref, st_tri):
        st["slot_of"][0, 6] = -2**31
    res = run_both(*make_topk([sel], k), st_ref, st_tri, 2, helpers=helpers, miss_side=miss_side)
    assert res.num_loads.tolist() == [1] and res.load_ids[0, 0] == 6
    assert int(st_tri["slot_of"][0, 6]) == int(res.load_slots[0, 0])
    check_consistent(st_tri)


@st.composite
def repeated_selections(draw):
    """A consistent state (consistent_states) whose selection repeats some of its ids."""
    k, state, ids, step, helpers, miss_side = draw(consistent_states())
    for src, pos in draw(st.lists(st.tuples(st.integers(0, 7), st.integers(0, 8)), min_size=1, max_size=4)):
        if ids:
            ids.insert(pos % (len(ids) + 1), ids[src % len(ids)])
    return k, state, ids[:k], step, helpers, miss_side


@interpreted
@settings(max_examples=30, deadline=None)
@given(case=repeated_selections())
def test_property_repeats_match_reference_and_naive(case):
    k, state, ids, step, helpers, miss_side = case
    st_ref, st_tri = clone(state), clone(state)
    naive_rows = [(state["resident"][0].tolist(), state["last_used"][0].tolist())]
    res = run_both(*make_topk([ids], k), st_ref, st_tri, step, helpers=helpers, miss_side=miss_side)
    check_against_naive(res, [ids], naive_rows, st_tri, step)
    check_consistent(st_tri)


@interpreted
@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 10_000), k=st.integers(1, 6), extra=st.integers(0, 6), helpers=st.sampled_from([0, 1]),
       miss_side=st.booleans(), repeat_p=st.sampled_from([0.1, 0.3, 0.6]))
def test_property_traces_with_repeats_stay_consistent(seed, k, extra, helpers, miss_side, repeat_p):
    # many steps of selections drawn with replacement (repeats, hits, evictions) on two rows
    s, m = k + extra, 3 * (k + extra) + 2
    g = torch.Generator().manual_seed(seed)
    st_ref, st_tri = new_state(2, s, m), new_state(2, s, m)
    naive_rows = [([-1] * s, [-1] * s) for _ in range(2)]
    prev = [[], []]
    for step in range(1, 13):
        rows_ids = []
        for i in range(2):
            n = int(torch.randint(0, k + 1, (1,), generator=g))
            ids = [prev[i][int(torch.randint(0, len(prev[i]), (1,), generator=g))]
                   if prev[i] and torch.rand(1, generator=g).item() < 0.5 else int(torch.randint(0, m, (1,), generator=g))
                   for _ in range(n)]
            ids = [ids[int(torch.randint(0, j, (1,), generator=g))] if j and torch.rand(1, generator=g).item() < repeat_p
                   else x for j, x in enumerate(ids)]
            rows_ids.append(ids)
            prev[i] = ids
        res = run_both(*make_topk(rows_ids, k), st_ref, st_tri, step, helpers=helpers, miss_side=miss_side)
        check_against_naive(res, rows_ids, naive_rows, st_tri, step)
        check_consistent(st_tri)


@interpreted
@pytest.mark.parametrize("helpers", [0, 1])
def test_padding_rows_select_nothing_and_change_no_state(helpers):
    """Rows with rows[b] == -1 (the unused rows of a CUDA-graph batch) output -1 and no load
    and leave every state row as it was, even with a nonzero valid and beside a live row 0
    that they alias."""
    K, S, M = 4, 6, 32
    st_ref, st_tri = new_state(2, S, M), new_state(2, S, M)
    g = torch.Generator().manual_seed(3)
    for step in range(1, 6):
        ids = [torch.randperm(M, generator=g)[:K].tolist() for _ in range(4)]
        topk, valid = make_topk(ids, K)
        rows = torch.tensor([0, -1, 1, -1])
        live = run_both(topk, valid, st_ref, st_tri, step, rows=rows, helpers=helpers)
        assert (live.device_slots[[1, 3]] == -1).all() and (live.load_ids[[1, 3]] == -1).all()
        assert live.num_loads[[1, 3]].tolist() == [0, 0]
        check_consistent(st_ref)
    only_pad = clone(st_ref)
    topk, valid = make_topk([[1, 2, 3, 4]], K)
    out = lru_diff_triton(topk, valid, st_tri["resident"], st_tri["last_used"], st_tri["slot_of"], 9,
                          rows=torch.tensor([-1]), helpers=helpers)
    assert int(out.num_loads[0]) == 0 and (out.device_slots == -1).all()
    for name in only_pad:
        assert torch.equal(st_tri[name], only_pad[name]), name


@interpreted
def test_num_valid_output_counts_selected_ids():
    """The optional num_valid output: valid clamped to [0, K] per live row, 0 for padding rows,
    the same from the kernel and the reference, and the other outputs unchanged by it."""
    K, S, M = 4, 6, 32
    st_ref, st_tri = new_state(3, S, M), new_state(3, S, M)
    topk, valid = make_topk([[1, 2, 3], [4, 5, 6, 7], [8], [9, 10]], K)
    rows = torch.tensor([0, -1, 2, 1])
    nv_tri = torch.full((4,), 99, dtype=torch.int32)

    def out(nv):
        return lru_diff_mod.LruDiffResult(*(torch.empty(4, K, dtype=torch.int32) for _ in range(3)),
                             torch.empty(4, dtype=torch.int32), nv)

    a = lru_diff_reference(topk, valid, st_ref["resident"], st_ref["last_used"], st_ref["slot_of"], 1, rows=rows)
    b = lru_diff_triton(topk, valid, st_tri["resident"], st_tri["last_used"], st_tri["slot_of"], 1, rows=rows,
                        out=out(nv_tri))
    assert a.num_valid.tolist() == [3, 0, 1, 2]
    assert torch.equal(b.num_valid, a.num_valid) and b.num_valid is nv_tri
    for name in ("device_slots", "load_ids", "load_slots", "num_loads"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    with pytest.raises(ValueError, match="num_valid"):
        lru_diff_triton(topk, valid, st_tri["resident"], st_tri["last_used"], st_tri["slot_of"], 2, rows=rows,
                        out=out(torch.zeros(3, dtype=torch.int32)))
