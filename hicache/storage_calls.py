"""Backend calls of the L3 threads, each bounded by a deadline (``StoragePolicy.backend_call_timeout_s``).

A backend call can block far longer than any request may wait: a read on a hung network file
system, an existence check whose metadata server stopped answering. ``StorageCalls.run`` runs
each call on a daemon thread of its own (``hicache.storage.bounded_call.BoundedCaller``) and
waits at most the deadline. A call that overruns is *abandoned*, not cancelled: the caller
gets ``StorageCallTimeout`` at once and serves it as a miss; the call finishes (or never does)
on its own thread and its result is dropped.

An abandoned call may still write into, or read from, the memory it was given, so what a call
is given decides what a late answer can do. The ``StorageController`` gives a call only keys
and a staging buffer of its own (``hicache.storage_staging``), never host-pool memory, so no
late answer can turn into wrong KV or hold host pages:

- **Existence checks** are given only keys.
- **Page reads** (``batch_get``) land in a staging buffer; once the call has returned within
  its deadline, the controller copies the pages that arrived intact into the host pages of
  the prefetch's reservation (a host memcpy on the prefetch thread). An abandoned read keeps
  its staging buffer, which is not handed out again until the call returns; the prefetch ends
  at the deadline, so its whole unused reservation goes back to the host pool when it is
  settled, and whatever the read delivers later is never copied, adopted or seen.
- **Page writes** (``batch_set``) are given a staging buffer the pages were copied into
  first. An abandoned write keeps its buffer the same way, so a late write stores the bytes
  the pages had when the write began (the right bytes for their keys) while the tree's nodes
  and host pages are released at the deadline.

While ``MAX_ABANDONED_CALLS`` abandoned calls have not returned, no further call is made:
``StorageCallSkipped`` is raised at once and served as a miss. A backend that hangs on every
call therefore costs that many threads and staging buffers and one deadline each (one more
if the other thread's call was already running), not one per request; calls resume as soon
as an abandoned one returns.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

from hicache.storage.bounded_call import BoundedCaller, CallTimeout

MAX_ABANDONED_CALLS = 2
"""Abandoned calls that may be outstanding before calls are skipped. Two lets one hung call
(one bad file, one lost request) leave the other thread, and later requests, working."""

DEFAULT_BACKEND_CALL_TIMEOUT_S = 10.0
"""Twice Mooncake's own ``op_timeout_s`` default, so its deadline fires first when both apply;
far above a healthy call (a batch of 8 pages of 8 MiB reads in ~40 ms from a local disk)."""


class StorageCallTimeout(TimeoutError):
    """The call did not return within its deadline; it was abandoned (it may still run)."""


class StorageCallSkipped(RuntimeError):
    """The call was not made: too many earlier calls were abandoned and have not returned."""


class StorageCalls:
    """Runs one controller's backend calls under ``timeout_s`` (see the module docstring)."""

    def __init__(self, timeout_s: float, name: str = "hicache-l3") -> None:
        self.timeout_s = timeout_s
        self._caller = BoundedCaller(name)

    @property
    def abandoned(self) -> int:
        """Abandoned calls that have not returned yet."""
        return self._caller.stuck

    def run(self, what: str, fn: Callable[[], Any], on_return: Optional[Callable[[], None]] = None) -> Any:
        """``fn()``'s result or exception, on a thread of its own. ``on_return()`` runs once
        ``fn`` will not touch what it was given any more: on ``fn``'s thread when it returns
        or raises (abandoned or not), or here when the call is skipped. Raises
        ``StorageCallTimeout`` after ``timeout_s`` and ``StorageCallSkipped`` (without calling
        ``fn``) while ``MAX_ABANDONED_CALLS`` abandoned calls are outstanding."""
        stuck = self._caller.stuck
        if stuck >= MAX_ABANDONED_CALLS:
            if on_return is not None:
                on_return()
            raise StorageCallSkipped(f"{what} not called: {stuck} earlier backend calls overran "
                                     f"{self.timeout_s:g} s and have not returned")

        def work() -> Any:
            try:
                return fn()
            finally:
                if on_return is not None:
                    on_return()

        try:
            return self._caller.call(work, self.timeout_s)
        except CallTimeout as e:
            raise StorageCallTimeout(f"{what} did not return within {self.timeout_s:g} s "
                                     "(abandoned; its answer will be dropped)") from e

    def wait_returned(self, timeout: float) -> bool:
        """Wait until no call runs, abandoned ones included (False after ``timeout`` s)."""
        return self._caller.wait_idle(timeout)
