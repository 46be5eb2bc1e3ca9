"""Staging buffers of the storage controller: the only memory its backend calls are given.

A backend call past its deadline is abandoned, not cancelled (``hicache.storage_calls``): it
may go on writing into, or reading from, the memory it was given for as long as it runs,
forever if it never returns. So no call is given host-pool memory. Each read or write call
takes a *lease* on one buffer of a fixed set (``uint8 [pages, page_bytes]``, one row per
host-pool page record): a read lands there and the controller copies what arrived into the
reservation's host pages after the call returned; a write is copied there from host pages
before the call.

A leased buffer has up to two holders, the controller and the call it was given to. It is
free again once both are done: the controller after its copy (or at the deadline, when it
abandons the call), the call when it returns or raises, however late (a call that was never
made holds nothing). The buffer of an abandoned call is thus
*retired* until that call returns and is never handed out meanwhile; host pages are never
held for it.

A set holds ``MAX_ABANDONED_CALLS + 1`` buffers per thread that leases from it: a thread makes
a call only while fewer than ``MAX_ABANDONED_CALLS`` abandoned calls are outstanding, so at
most that many of its buffers are retired and one is always free. Each buffer is allocated
the first time it is leased (pinned when the host pool is) and kept for the set's lifetime:
a set whose calls never overrun uses one buffer.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable, Optional

import torch


@dataclass(eq=False)
class StagingLease:
    """The controller's use of buffer ``index`` of a ``StagingBuffers`` for one backend call;
    ``data`` is ``uint8 [pages, page_bytes]``, row ``r`` the ``r``-th page of the call."""

    owner: "StagingBuffers"
    index: int
    data: torch.Tensor
    in_call: bool = False
    """Given to a backend call that has not returned."""
    released: bool = False
    """The controller is done with it."""

    def page(self, r: int) -> torch.Tensor:
        """Row ``r``: ``uint8 [page_bytes]``, contiguous."""
        return self.data[r]

    def give_to_call(self) -> Callable[[], None]:
        """Mark the buffer as given to a backend call; returns what that call must run once it
        will not touch the buffer any more (``StorageCalls.run``'s ``on_return``)."""
        self.owner._update(self, in_call=True)
        return self._call_returned

    def _call_returned(self) -> None:
        self.owner._update(self, in_call=False)

    def release(self) -> None:
        """The controller is done with the buffer: after its copy, or when it abandoned the
        call (the buffer is then retired until the call returns)."""
        self.owner._update(self, released=True)


class StagingBuffers:
    """``count`` buffers of ``pages`` page records of ``page_bytes`` bytes each, leased to
    backend calls (see the module docstring). Thread-safe."""

    def __init__(self, count: int, pages: int, page_bytes: int, pin_memory: bool = False) -> None:
        for name, v in (("count", count), ("pages", pages), ("page_bytes", page_bytes)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"StagingBuffers {name} must be an int >= 1, got {v!r}")
        self.pages, self.page_bytes, self.pin_memory = pages, page_bytes, bool(pin_memory)
        self._bufs: list[Optional[torch.Tensor]] = [None] * count
        self._free = list(range(count - 1, -1, -1))  # a stack: the lowest index is reused first
        self._leases: dict[int, StagingLease] = {}
        self._lock = threading.Lock()

    @property
    def count(self) -> int:
        return len(self._bufs)

    @property
    def allocated(self) -> int:
        """Buffers allocated so far (each at most once)."""
        with self._lock:
            return sum(b is not None for b in self._bufs)

    @property
    def retired(self) -> int:
        """Buffers held by abandoned calls that have not returned."""
        with self._lock:
            return sum(1 for x in self._leases.values() if x.released and x.in_call)

    @property
    def free(self) -> int:
        with self._lock:
            return len(self._free)

    def lease(self) -> StagingLease:
        """A free buffer for one call. RuntimeError when none is free (more calls abandoned
        than the set was sized for)."""
        with self._lock:
            if not self._free:
                raise RuntimeError(f"no free staging buffer: all {self.count} are held by backend calls")
            index = self._free.pop()
            buf = self._bufs[index]
            if buf is None:
                try:
                    buf = torch.empty((self.pages, self.page_bytes), dtype=torch.uint8, pin_memory=self.pin_memory)
                except BaseException:
                    self._free.append(index)
                    raise
                self._bufs[index] = buf
            lease = StagingLease(self, index, buf)
            self._leases[index] = lease
            return lease

    def _update(self, lease: StagingLease, **state: bool) -> None:
        with self._lock:
            if self._leases.get(lease.index) is not lease:  # already free: nothing holds it
                return
            for k, v in state.items():
                setattr(lease, k, v)
            if lease.released and not lease.in_call:
                del self._leases[lease.index]
                self._free.append(lease.index)
