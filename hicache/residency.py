"""KVResidency: host-backed virtual KV pages, and the GPU pages that hold some of them.

An engine whose KV lives in host memory hands out *virtual* pages: its allocator, request
tables and prefix tree name KV by them, and each virtual page has its home in the host
pool (virtual page ``v`` is host page ``v``). A GPU page holds a virtual page only while
the engine's own kernels read or write it there; ``v2p [virtual_pages + 1] int64`` maps a
virtual page to its GPU page, ``0`` meaning "not on the GPU" (page 0 of both spaces is the
engine's padding page, which every unmapped read lands on).

What the residency tracks, all on the device so that nothing here reads a tensor back to
the host:

- ``v2p``: the map above.
- ``pins [virtual_pages + 1] int32``: how many readers need each page on the GPU. A page
  whose pins drop to 0 may be *demoted*: its GPU page is given back, its KV stays in host
  memory (the caller makes sure the host copy is complete before demoting).
- a free stack of GPU pages (``_stack``, ``_top``): taking ``n`` pages and giving back a
  data-dependent subset are fixed-shape tensor operations.

Counts the host needs (can this allocation succeed?) come from a *lower bound* of the free
GPU pages: allocations lower it by what they may take (known on the host), device-side
frees are learned from snapshots of the stack's top copied back asynchronously
(:meth:`snapshot`, consumed by :meth:`settle`), or all at once by :meth:`settle` with
``exact=True`` (one host sync) when the bound alone would refuse. The bound, and so every
decision made from it, evolves the same way on every rank of a tensor-parallel group: it
changes only at calls the engine makes in the same order everywhere.

Every mutation runs on the stream current at its call and is ordered after the previous
mutation, whatever stream that ran on (one event chains them), so the scheduler thread and
the forward stream can both call in. A forward that reads ``v2p`` must wait for
:meth:`ready` first.
"""
from __future__ import annotations

import collections
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Optional

import torch


class ResidencyExhausted(RuntimeError):
    """The GPU pages a residency call needs may not be free (the caller checks
    :meth:`KVResidency.free_pages_lower_bound` first)."""


@dataclass
class _Snapshot:
    tag: int
    value: torch.Tensor  # [1] int64, pinned host copy of the stack's top
    event: Optional[torch.cuda.Event]
    taken_total: int  # the host's running total of pages allocations may have taken, then
    frees: int  # the host's count of freeing calls issued before it


class KVResidency:
    """GPU residency of ``virtual_pages`` host-backed pages over ``physical_pages`` GPU
    pages (ids ``1..`` in both spaces; 0 is the padding page). See the module docstring."""

    def __init__(self, virtual_pages: int, physical_pages: int, device: torch.device | str) -> None:
        for name, v in (("virtual_pages", virtual_pages), ("physical_pages", physical_pages)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        dev = torch.device(device)
        self.device = dev
        self.virtual_pages = virtual_pages
        self.physical_pages = physical_pages
        self.v2p = torch.zeros(virtual_pages + 1, dtype=torch.int64, device=dev)
        self.pins = torch.zeros(virtual_pages + 1, dtype=torch.int32, device=dev)
        self._claim = torch.zeros(virtual_pages + 1, dtype=torch.int64, device=dev)
        self._keep = torch.zeros(virtual_pages + 1, dtype=torch.int32, device=dev)
        # free GPU pages on a stack; one extra entry past the end absorbs masked-out pushes
        self._stack = torch.zeros(physical_pages + 1, dtype=torch.int64, device=dev)
        self._stack[:physical_pages] = torch.arange(physical_pages, 0, -1, dtype=torch.int64, device=dev)
        self._top = torch.full((1,), physical_pages, dtype=torch.int64, device=dev)
        self._cuda = dev.type == "cuda"
        self._chain = torch.cuda.Event() if self._cuda else None
        self._lb = physical_pages
        self._taken_total = 0
        self._snapshots: collections.deque[_Snapshot] = collections.deque()
        self._frees = 0  # freeing calls issued (release, demote of many pages)
        self._frees_settled = 0  # of them, those a settled snapshot has counted

    def reset(self) -> None:
        """Every page off the GPU, every GPU page free, no pins (the engine cleared its pool)."""
        with self._ordered():
            self.v2p.zero_()
            self.pins.zero_()
            self._stack[: self.physical_pages] = torch.arange(self.physical_pages, 0, -1, dtype=torch.int64,
                                                             device=self.device)
            self._top.fill_(self.physical_pages)
        self._snapshots.clear()
        self._lb = self.physical_pages
        self._frees_settled = self._frees

    @contextmanager
    def ordered(self) -> Iterator[None]:
        """Run the caller's own reads / writes of state that residency mutations touch
        (e.g. an engine table the next mutation's page list is read from) in the same
        order as the mutations (see the module docstring)."""
        with self._ordered():
            yield

    # ------------------------------------------------------------------ ordering
    @contextmanager
    def _ordered(self) -> Iterator[None]:
        """Run a mutation on the current stream after every earlier one (any stream)."""
        if not self._cuda:
            yield
            return
        cur = torch.cuda.current_stream(self.device)
        cur.wait_event(self._chain)
        yield
        self._chain.record(cur)

    def ready(self, stream: Optional[torch.cuda.Stream] = None) -> None:
        """Make ``stream`` (default: the current one) wait for every mutation so far, so its
        next reads of ``v2p`` / the GPU pages see them. No host sync."""
        if self._cuda:
            (stream or torch.cuda.current_stream(self.device)).wait_event(self._chain)

    # ------------------------------------------------------------------ host-side counts
    def free_pages_lower_bound(self) -> int:
        """GPU pages certainly free now (a lower bound: frees done on the device since the
        last settled snapshot are not counted yet)."""
        return self._lb

    def snapshot(self, tag: int) -> None:
        """Queue an asynchronous copy of the free count (after every mutation so far),
        labelled ``tag`` (e.g. the number of forwards run), for :meth:`settle`."""
        pin = self._cuda
        value = torch.empty(1, dtype=torch.int64, pin_memory=pin)
        with self._ordered():
            value.copy_(self._top, non_blocking=pin)
        event = None
        if pin:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
        self._snapshots.append(_Snapshot(tag, value, event, self._taken_total, self._frees))

    def settle(self, up_to_tag: Optional[int] = None, *, exact: bool = False) -> int:
        """Raise the lower bound from the snapshots tagged ``<= up_to_tag`` (waiting for
        their copies, which callers choose old enough to be done), or with ``exact`` from
        the free count as of every mutation so far (one host sync). Returns the bound."""
        if exact:
            self.snapshot(tag=-1)
            up_to_tag = None
        while self._snapshots and (up_to_tag is None or self._snapshots[0].tag <= up_to_tag):
            snap = self._snapshots.popleft()
            if snap.event is not None:
                snap.event.synchronize()
            bound = int(snap.value[0]) - (self._taken_total - snap.taken_total)
            self._lb = max(self._lb, bound)
            self._frees_settled = max(self._frees_settled, snap.frees)
        return self._lb

    def frees_pending(self) -> bool:
        """Whether GPU pages were given back (``release``, or ``demote`` with ``counted``)
        that the lower bound does not count yet: a count that refused an allocation may
        allow it once they are settled."""
        return self._frees > self._frees_settled

    def _take(self, upper: int) -> None:
        if upper > self._lb:
            raise ResidencyExhausted(f"{upper} GPU pages needed, at least {self._lb} free (of {self.physical_pages})")
        self._lb -= upper
        self._taken_total += upper

    # ------------------------------------------------------------------ device ops
    def _first_of(self, vpages: torch.Tensor) -> torch.Tensor:
        """``[n] bool``: one entry of every distinct page of ``vpages`` (page 0 never)."""
        n = vpages.numel()
        idx = torch.arange(n, dtype=torch.int64, device=self.device)
        self._claim.scatter_(0, vpages, idx)
        return (self._claim[vpages] == idx) & (vpages > 0)

    def _push(self, phys: torch.Tensor, mask: torch.Tensor) -> None:
        """Give the GPU pages ``phys[mask]`` back (data-dependent count, fixed shapes)."""
        m = mask.to(torch.int64)
        pos = torch.where(mask, self._top + torch.cumsum(m, 0) - 1, self.physical_pages)
        self._stack.scatter_(0, pos, phys.to(torch.int64))
        self._top += m.sum()

    def _vpages(self, vpages: torch.Tensor, name: str = "vpages") -> torch.Tensor:
        if not isinstance(vpages, torch.Tensor) or vpages.dim() != 1 or vpages.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be a 1-D int32/int64 tensor of virtual pages, got "
                             f"{getattr(vpages, 'shape', type(vpages).__name__)}")
        return vpages.to(device=self.device, dtype=torch.int64)

    def map(self, vpages: torch.Tensor, upper: Optional[int] = None) -> torch.Tensor:
        """Give every page of ``vpages`` that has no GPU page one (duplicates and page 0
        ignored). Returns ``[n] bool``, the entries that got a new GPU page (their KV is
        whatever the GPU page held: the caller loads or writes it). ``upper``: how many
        pages it may take at most, when the caller knows better than ``len(vpages)``;
        that many come off the lower bound, and ResidencyExhausted (nothing changed) is
        raised when the bound is lower."""
        v = self._vpages(vpages)
        n = v.numel()
        if n == 0:
            return torch.zeros(0, dtype=torch.bool, device=self.device)
        self._take(n if upper is None else min(int(upper), n))
        with self._ordered():
            new = self._first_of(v) & (self.v2p[v] == 0)
            m = new.to(torch.int64)
            pos = self._top - torch.cumsum(m, 0)  # pops from the top, one per new page
            phys = self._stack[pos.clamp(min=0)]
            self._top -= m.sum()
            # only the new entries write; the others (duplicates, resident pages) write 0 to
            # the padding page's entry, which stays 0
            self.v2p.index_put_((torch.where(new, v, 0),), torch.where(new, phys, 0))
        return new

    def release(self, vpages: torch.Tensor) -> None:
        """The engine freed ``vpages``: their GPU pages (if any) go back, pins reset."""
        v = self._vpages(vpages)
        if v.numel() == 0:
            return
        self._frees += 1
        with self._ordered():
            first = self._first_of(v)
            phys = self.v2p[v]
            self._push(phys, first & (phys > 0))
            self.v2p.index_fill_(0, v, 0)
            self.pins.index_fill_(0, v, 0)

    def pin(self, vpages: torch.Tensor, delta: int = 1) -> None:
        """Add ``delta`` pins to each entry of ``vpages`` (pins never go below 0)."""
        v = self._vpages(vpages)
        if v.numel() == 0:
            return
        with self._ordered():
            self.pins.index_add_(0, v, torch.full_like(v, delta, dtype=torch.int32))
            if delta < 0:
                self.pins.clamp_(min=0)

    def demote(self, vpages: torch.Tensor, *, unpin: bool = False, keep: Optional[torch.Tensor] = None,
               counted: bool = False) -> None:
        """Give back the GPU pages of the pages of ``vpages`` that have no pins (after
        removing one pin per entry with ``unpin``); ``keep [n] bool`` exempts entries. Their
        KV must be complete in host memory, and no queued GPU work may still read them
        (the caller orders this after both). ``counted``: report it in ``frees_pending``
        (a caller's large give-back, which may let a refused allocation through)."""
        v = self._vpages(vpages)
        if v.numel() == 0:
            return
        if counted:
            self._frees += 1
        with self._ordered():
            if unpin:
                self.pins.index_add_(0, v, torch.full_like(v, -1, dtype=torch.int32))
                self.pins.clamp_(min=0)
            first = self._first_of(v)
            phys = self.v2p[v]
            drop = first & (phys > 0) & (self.pins[v] <= 0)
            if keep is not None:  # a page is kept when any of its entries says so
                self._keep.index_fill_(0, v, 0)
                self._keep.index_add_(0, v, keep.to(device=self.device, dtype=torch.int32))
                drop &= self._keep[v] == 0
            self._push(phys, drop)
            self.v2p.index_put_((torch.where(drop, v, 0),), torch.zeros_like(phys))

    def physical_slots(self, virtual_slots: torch.Tensor, page_size: int) -> torch.Tensor:
        """``[n] int64`` GPU slot of each virtual slot (``page_size`` tokens a page), ``-1``
        where the page is not on the GPU. Read-only; no ordering (call after :meth:`ready`)."""
        s = virtual_slots.to(device=self.device, dtype=torch.int64)
        page = self.v2p[s.div(page_size, rounding_mode="floor").clamp(0, self.virtual_pages)]
        return torch.where((page > 0) & (s > 0), page * page_size + s % page_size, -1)

    # ------------------------------------------------------------------ checks
    def counts(self) -> dict:
        """``{free, resident, pinned}`` pages (reads back to the host: tests, stats)."""
        with self._ordered():
            top = int(self._top[0])
            resident = int((self.v2p[1:] > 0).sum())
            pinned = int((self.pins[1:] > 0).sum())
        return {"free": top, "resident": resident, "pinned": pinned}

    def check(self) -> None:
        """Invariants (reads back to the host: tests): every GPU page is free or holds
        exactly one virtual page, never both; pins never negative. Raises AssertionError."""
        with self._ordered():
            top = int(self._top[0])
            free = self._stack[:top].tolist()
            mapped = self.v2p[1:][self.v2p[1:] > 0].tolist()
            neg = int((self.pins < 0).sum())
        if neg:
            raise AssertionError(f"{neg} pages have negative pins")
        if len(set(mapped)) != len(mapped):
            raise AssertionError("a GPU page holds two virtual pages")
        if len(set(free)) != len(free):
            raise AssertionError("a GPU page is on the free stack twice")
        both = set(free) & set(mapped)
        if both:
            raise AssertionError(f"GPU pages both free and mapped: {sorted(both)[:8]}")
        if len(free) + len(mapped) != self.physical_pages:
            raise AssertionError(f"{len(free)} free + {len(mapped)} mapped != {self.physical_pages} GPU pages (leak)")
        if top < self._lb:
            raise AssertionError(f"lower bound {self._lb} exceeds the free count {top}")
