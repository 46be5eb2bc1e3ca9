"""The controller's staging buffers (``hicache.storage_staging``) with real bounded calls
(``hicache.storage_calls``): a buffer given to a call that overran its deadline is retired
until that call returns, never handed out meanwhile; a skipped call holds nothing; the set
is allocated lazily and never grows."""
from __future__ import annotations

import threading

import pytest
import torch

from hicache.storage_calls import MAX_ABANDONED_CALLS, StorageCalls, StorageCallSkipped, StorageCallTimeout
from hicache.storage_staging import StagingBuffers
from l3_kit import wait_until


def _hung_write(calls: StorageCalls, stages: StagingBuffers, gate: threading.Event, value: int):
    """A call that writes ``value`` into its buffer once ``gate`` opens, abandoned at the
    deadline; returns its lease (released by the controller side, as the controller does)."""
    lease = stages.lease()

    def late_write() -> None:
        gate.wait()
        lease.data.fill_(value)

    with pytest.raises(StorageCallTimeout):
        calls.run("read", late_write, lease.give_to_call())
    lease.release()
    return lease


def test_an_abandoned_call_keeps_its_buffer_until_it_returns():
    calls = StorageCalls(0.05)
    stages = StagingBuffers(MAX_ABANDONED_CALLS + 1, pages=2, page_bytes=64)
    gate = threading.Event()
    hung = _hung_write(calls, stages, gate, 7)
    assert stages.retired == 1 and stages.free == MAX_ABANDONED_CALLS

    # the next calls get other buffers, whatever the hung one does meanwhile
    ok = stages.lease()
    assert ok.index != hung.index
    calls.run("read", lambda: ok.data.fill_(1), ok.give_to_call())
    gate.set()  # the late call writes into its own buffer only
    wait_until(lambda: calls.abandoned == 0)
    assert bool((ok.data == 1).all()) and bool((hung.data == 7).all())
    ok.release()
    assert stages.retired == 0 and stages.free == stages.count
    assert stages.allocated == 2  # the set never grew past what was needed at once


def test_one_buffer_is_free_while_calls_are_skipped():
    calls = StorageCalls(0.05)
    stages = StagingBuffers(MAX_ABANDONED_CALLS + 1, pages=1, page_bytes=16)
    gate = threading.Event()
    held = [_hung_write(calls, stages, gate, i) for i in range(MAX_ABANDONED_CALLS)]
    assert stages.retired == MAX_ABANDONED_CALLS and stages.free == 1
    lease = stages.lease()  # the one left: the call is skipped and holds nothing
    with pytest.raises(StorageCallSkipped):
        calls.run("read", lambda: lease.data.fill_(9), lease.give_to_call())
    lease.release()
    assert stages.free == 1 and stages.retired == MAX_ABANDONED_CALLS
    extra = stages.lease()
    with pytest.raises(RuntimeError, match="no free staging buffer"):  # sized for no more
        stages.lease()
    extra.release()  # never given to a call: free at once
    assert stages.free == 1
    gate.set()
    wait_until(lambda: calls.abandoned == 0 and stages.retired == 0)
    assert stages.free == stages.count and {x.index for x in held} | {lease.index} == set(range(stages.count))


def test_a_call_that_raises_frees_its_buffer_and_nothing_is_freed_twice():
    calls = StorageCalls(1.0)
    stages = StagingBuffers(2, pages=1, page_bytes=8)
    lease = stages.lease()

    def boom() -> None:
        raise OSError("read failed")

    with pytest.raises(OSError):
        calls.run("read", boom, lease.give_to_call())
    lease.release()
    lease.release()
    assert stages.free == 2
    assert stages.lease().index == lease.index and stages.free == 1  # reused, not reallocated
    assert stages.allocated == 1


def test_bad_sizes_are_refused():
    for kw in ({"count": 0}, {"pages": True}, {"page_bytes": 1.5}):
        args = {"count": 3, "pages": 2, "page_bytes": 8, **kw}
        name = next(iter(kw))
        with pytest.raises(ValueError, match=name):
            StagingBuffers(**args)
    assert StagingBuffers(1, 2, 8).lease().data.shape == (2, 8)
    assert StagingBuffers(1, 2, 8).lease().data.dtype == torch.uint8
