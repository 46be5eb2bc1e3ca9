"""PagedSlotAllocator and ReqToTokenPool: page alignment, reserved page 0, no double hand-out."""
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hicache.allocator import PagedSlotAllocator
from hicache.req_to_token import ReqToTokenPool


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_alloc_returns_whole_pages_and_skips_page_zero(page_size):
    alloc = PagedSlotAllocator(8 * page_size, page_size)
    assert alloc.num_pages == 8
    assert alloc.available_size() == 7 * page_size
    slots = alloc.alloc(page_size + 1)  # needs two pages
    assert slots.dtype == torch.int64
    assert slots.numel() == 2 * page_size
    pages = slots.view(-1, page_size)
    assert torch.equal(pages - pages[:, :1], torch.arange(page_size).expand_as(pages))
    assert bool((pages[:, 0] % page_size == 0).all())
    assert int(slots.min()) >= page_size  # page 0 never handed out
    assert alloc.available_size() == 5 * page_size


def test_alloc_when_short_returns_none_and_changes_nothing():
    alloc = PagedSlotAllocator(16, 4)
    assert alloc.alloc(13) is None  # 4 pages needed, 3 free
    assert alloc.available_size() == 12
    assert alloc.alloc(12).numel() == 12
    assert alloc.alloc(1) is None
    assert alloc.alloc(0).numel() == 0


def test_free_makes_pages_reusable():
    alloc = PagedSlotAllocator(16, 4)
    a = alloc.alloc(12)
    alloc.free(a[4:8])
    b = alloc.alloc(4)
    assert torch.equal(b, a[4:8])
    alloc.free_pages(torch.tensor([1], dtype=torch.int32))
    assert alloc.available_size() == 4


@pytest.mark.parametrize(
    "bad, match",
    [
        (lambda a, s: a.free(s[:4]), "already free"),  # freeing twice (first free below)
        (lambda a, s: a.free(s[1:5]), "page-aligned"),
        (lambda a, s: a.free(s[:3]), "whole pages"),
        (lambda a, s: a.free(torch.arange(4)), "reserved"),
        (lambda a, s: a.free(torch.tensor([64, 65, 66, 67])), r"\[1, 16\)"),
        (lambda a, s: a.free(s[:4].float()), "dtype"),
        (lambda a, s: a.free_pages(torch.tensor([2, 2])), "duplicates"),
        (lambda a, s: a.alloc(-1), "num_tokens"),
    ],
)
def test_bad_free_raises_and_leaves_state(bad, match):
    alloc = PagedSlotAllocator(64, 4)
    slots = alloc.alloc(16)
    alloc.free(slots[:4])
    before = alloc.available_size()
    with pytest.raises(ValueError, match=match):
        bad(alloc, slots)
    assert alloc.available_size() == before


@pytest.mark.parametrize("num_slots, page_size", [(6, 4), (4, 4), (0, 1), (8, 0)])
def test_bad_construction(num_slots, page_size):
    with pytest.raises(ValueError):
        PagedSlotAllocator(num_slots, page_size)


class AllocatorMachine(RuleBasedStateMachine):
    """Random alloc/free sequences: every slot is held by at most one owner, freed pages
    come back, bad frees are rejected without side effects."""

    def __init__(self):
        super().__init__()
        self.page_size = 4
        self.alloc = PagedSlotAllocator(32 * self.page_size, self.page_size)
        self.held: list[torch.Tensor] = []
        self.freed: list[torch.Tensor] = []

    @rule(n=st.integers(0, 40))
    def allocate(self, n):
        before = self.alloc.available_size()
        slots = self.alloc.alloc(n)
        need = -(-n // self.page_size) * self.page_size
        if need > before:
            assert slots is None
            assert self.alloc.available_size() == before
        else:
            assert slots is not None and slots.numel() == need
            if need:
                self.held.append(slots)

    @precondition(lambda self: self.held)
    @rule(i=st.integers(0, 1000), whole=st.booleans())
    def free(self, i, whole):
        slots = self.held.pop(i % len(self.held))
        if not whole and slots.numel() > self.page_size:
            # Free only the first page; keep the rest held.
            self.alloc.free(slots[: self.page_size])
            self.freed.append(slots[: self.page_size])
            self.held.append(slots[self.page_size:])
        else:
            self.alloc.free(slots)
            self.freed.append(slots)

    @precondition(lambda self: self.freed)
    @rule(i=st.integers(0, 1000))
    def double_free_rejected(self, i):
        slots = self.freed[i % len(self.freed)]
        held = torch.cat(self.held) if self.held else torch.empty(0, dtype=torch.int64)
        if torch.isin(slots, held).any():
            return  # page was handed out again; freeing it is legitimate for its new owner
        before = self.alloc.available_size()
        with pytest.raises(ValueError):
            self.alloc.free(slots)
        assert self.alloc.available_size() == before

    @invariant()
    def no_slot_held_twice_and_sizes_add_up(self):
        held = torch.cat(self.held) if self.held else torch.empty(0, dtype=torch.int64)
        assert torch.unique(held).numel() == held.numel()
        assert not bool((held < self.page_size).any())  # page 0 stays reserved
        assert held.numel() + self.alloc.available_size() == (self.alloc.num_pages - 1) * self.page_size


TestAllocatorMachine = AllocatorMachine.TestCase
TestAllocatorMachine.settings = settings(max_examples=40, stateful_step_count=25, deadline=None,
                                         suppress_health_check=[HealthCheck.too_slow])


def test_req_to_token_pool():
    pool = ReqToTokenPool(3, 16, "cpu")
    assert pool.req_to_token.shape == (3, 16) and pool.req_to_token.dtype == torch.int64
    rows = [pool.alloc() for _ in range(3)]
    assert sorted(rows) == [0, 1, 2]
    assert pool.alloc() is None
    pool.write(rows[1], slice(0, 4), torch.tensor([8, 9, 10, 11]))
    assert pool.req_to_token[rows[1], :4].tolist() == [8, 9, 10, 11]
    pool.free(rows[1])
    assert pool.available_size() == 1
    with pytest.raises(ValueError, match="double free"):
        pool.free(rows[1])
    with pytest.raises(ValueError, match="idx"):
        pool.free(5)
    assert pool.alloc() == rows[1]
