"""KVResidency (hicache/residency.py): GPU residency of host-backed virtual pages.

A random walk of the operations an engine makes (map, pin, unpin and demote, release) is
checked step by step against a plain-Python model: which virtual pages are on the GPU, that
no GPU page is both free and mapped or mapped twice, that pins are honoured and that the
host's lower bound of free pages never exceeds the truth.
"""
import random

import pytest
import torch

from hicache.residency import KVResidency, ResidencyExhausted


def _t(xs):
    return torch.tensor(xs, dtype=torch.int64)


def test_map_gives_distinct_gpu_pages_and_release_returns_them():
    r = KVResidency(virtual_pages=20, physical_pages=5, device="cpu")
    new = r.map(_t([3, 7, 3, 0, 9]))  # a duplicate and the padding page
    got = new.tolist()
    assert got[1] and got[4] and not got[3] and got[0] != got[2]  # one entry of page 3 gets it
    phys = r.v2p[[3, 7, 9]].tolist()
    assert len(set(phys)) == 3 and all(1 <= p <= 5 for p in phys)
    assert int(r.v2p[0]) == 0
    r.check()
    assert r.counts() == {"free": 2, "resident": 3, "pinned": 0}
    r.release(_t([7, 7]))
    r.check()
    assert int(r.v2p[7]) == 0 and r.counts()["free"] == 3
    # mapping again takes a free page; already-resident pages keep theirs
    before = int(r.v2p[3])
    r.settle(exact=True)
    r.map(_t([3, 11]))
    assert int(r.v2p[3]) == before and int(r.v2p[11]) > 0
    r.check()


def test_pins_keep_pages_and_demotion_frees_the_rest():
    r = KVResidency(virtual_pages=10, physical_pages=6, device="cpu")
    r.map(_t([1, 2, 3, 4]))
    r.pin(_t([1, 2]))
    r.pin(_t([2]))  # page 2 has two readers
    r.demote(_t([1, 2, 3, 4]))
    assert (r.v2p[[1, 2, 3, 4]] > 0).tolist() == [True, True, False, False]
    r.demote(_t([1, 2]), unpin=True)  # one reader of each leaves: 1 drops, 2 stays
    assert (r.v2p[[1, 2]] > 0).tolist() == [False, True]
    r.demote(_t([2, 2]), unpin=True)  # the last two pins of page 2, named twice in one call
    assert int(r.v2p[2]) == 0
    r.check()
    assert r.counts() == {"free": 6, "resident": 0, "pinned": 0}


def test_keep_exempts_a_page_named_by_any_entry():
    r = KVResidency(virtual_pages=10, physical_pages=4, device="cpu")
    r.map(_t([5, 6]))
    r.demote(_t([5, 5, 6]), keep=torch.tensor([False, True, False]))
    assert int(r.v2p[5]) > 0 and int(r.v2p[6]) == 0
    r.check()


def test_lower_bound_refuses_and_exact_settle_sees_device_frees():
    r = KVResidency(virtual_pages=10, physical_pages=3, device="cpu")
    r.map(_t([1, 2, 3]))
    assert r.free_pages_lower_bound() == 0
    with pytest.raises(ResidencyExhausted):
        r.map(_t([4]))
    r.demote(_t([1, 2]))  # device-side frees: the bound does not know yet
    assert r.free_pages_lower_bound() == 0
    r.snapshot(tag=5)
    assert r.settle(up_to_tag=4) == 0  # a younger snapshot is not consumed
    assert r.settle(up_to_tag=5) == 2
    r.map(_t([4]))
    assert r.free_pages_lower_bound() == 1
    r.demote(_t([3]))
    assert r.settle(exact=True) == 2
    r.check()


def test_physical_slots_follow_the_map():
    r = KVResidency(virtual_pages=8, physical_pages=8, device="cpu")
    r.map(_t([2]))
    p = int(r.v2p[2])
    slots = r.physical_slots(_t([8, 9, 11, 12, 0]), page_size=4)  # page 2 = slots 8..11
    assert slots.tolist() == [p * 4, p * 4 + 1, p * 4 + 3, -1, -1]


@pytest.mark.parametrize("seed", range(6))
def test_random_walk_matches_a_python_model(seed):
    rng = random.Random(seed)
    V, P = 40, 12
    r = KVResidency(virtual_pages=V, physical_pages=P, device="cpu")
    resident: set[int] = set()
    pins = [0] * (V + 1)
    for step in range(200):
        op = rng.choice(["map", "map", "pin", "unpin", "demote", "release", "snapshot"])
        pages = [rng.randrange(0, V + 1) for _ in range(rng.randrange(1, 6))]
        if op == "map":
            n = len(pages)
            if n > r.free_pages_lower_bound():
                r.settle(exact=True)
            if n > r.free_pages_lower_bound():
                with pytest.raises(ResidencyExhausted):
                    r.map(_t(pages))
                continue
            new = r.map(_t(pages)).tolist()
            fresh = {p for p in pages if p > 0 and p not in resident}
            assert {p for p, is_new in zip(pages, new) if is_new} == fresh
            assert sum(new) == len(fresh)
            resident |= fresh
        elif op == "pin":
            pages = list(dict.fromkeys(p for p in pages if p > 0))
            r.pin(_t(pages))
            for p in pages:
                pins[p] += 1
        elif op in ("unpin", "demote"):
            unpin = op == "unpin"
            r.demote(_t(pages), unpin=unpin)
            if unpin:
                for p in pages:
                    pins[p] = max(0, pins[p] - 1)
            resident -= {p for p in pages if p > 0 and pins[p] == 0}
        elif op == "release":
            r.release(_t(pages))
            for p in pages:
                pins[p] = 0
            resident -= set(pages)
        else:
            r.snapshot(tag=step)
            r.settle(up_to_tag=step - rng.randrange(0, 3))
        got = {i for i in range(1, V + 1) if int(r.v2p[i]) > 0}
        assert got == resident, (step, op, pages)
        assert r.pins.tolist()[1:] == pins[1:]
        r.check()


def test_bad_pages_argument_names_it():
    r = KVResidency(virtual_pages=4, physical_pages=2, device="cpu")
    with pytest.raises(ValueError, match="vpages"):
        r.map(torch.zeros(2, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match="virtual_pages"):
        KVResidency(virtual_pages=0, physical_pages=2, device="cpu")
